"""kdsa.model: configs, layers and the hybrid KDA + Gated DSA MoE transformer."""
