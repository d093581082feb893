"""kdsa.sharding."""
