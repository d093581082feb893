"""kdsa.cli."""
