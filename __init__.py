"""kdsa: the Kimi K3 successor (KDA + Gated DSA hybrid MoE) in JAX / Flax NNX.

The project folders install as subpackages of this namespace: ``kdsa.model``,
``kdsa.sharding``, ``kdsa.kernels_pallas``, ``kdsa.train``, ``kdsa.infer``, ``kdsa.cli``.
"""

__version__ = "0.1.0"
