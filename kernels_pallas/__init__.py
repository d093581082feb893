"""kdsa.kernels_pallas."""
