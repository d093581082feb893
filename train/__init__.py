"""kdsa.train."""
