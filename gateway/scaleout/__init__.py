"""Scale-out: the broker (Redis) and --workers, both feeding one mirror."""
