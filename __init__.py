"""kdsa: the Kimi K3 successor (KDA + Gated DSA hybrid MoE) in JAX / Flax NNX.

The project folders install as subpackages of this namespace: ``kdsa.model``,
``kdsa.sharding``, ``kdsa.kernels_pallas``, ``kdsa.train``, ``kdsa.infer``, ``kdsa.cli``.
"""

__version__ = "0.1.0"


def lazy_exports(package: str, public: dict[str, str]):
    """A module ``__getattr__`` (PEP 562) for ``package``'s public names: ``public[name]`` is
    the module that defines ``name``, imported on first use, so importing a light submodule
    (``kdsa.model.config``) does not import the whole package's public API."""
    import importlib

    def __getattr__(name: str):
        if name in public:
            return getattr(importlib.import_module(public[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
