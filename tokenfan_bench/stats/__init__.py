"""The bench's estimators: per-arm metrics and the A/B difference with its bootstrap interval (pure numpy)."""
