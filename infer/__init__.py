"""kdsa.infer."""
