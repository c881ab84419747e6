"""CPU costs: the gateway's per token beside the raw floor, its engine-step pass in-process, and the bench
client's own."""
