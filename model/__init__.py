"""kdsa.model: configs, layers and the hybrid KDA + Gated DSA MoE transformer.

Public (imported on first use, so ``import kdsa.model.config`` stays light)::

    from kdsa.model import Transformer, ModelConfig, get_preset, load_model, save_model
    from kdsa.model import Output, Collect, RoutingReplay, ImageInputs   # forward's types

Everything else in the package is importable but internal: the pure maths (``kda.py``,
``dsa.py``, ``moe.py`` functions, ``mxfp4.py``), the NNX layers, their sequence- and
expert-parallel forms, and ``partitioning.py``, the one sharding interface the model calls.
"""

from kdsa import lazy_exports

_PUBLIC = {
    "Transformer": "kdsa.model.transformer",
    "Output": "kdsa.model.outputs",
    "Collect": "kdsa.model.outputs",
    "RoutingReplay": "kdsa.model.outputs",
    "ImageInputs": "kdsa.model.outputs",
    "ModelConfig": "kdsa.model.config",
    "get_preset": "kdsa.model.config",
    "load_model": "kdsa.model.checkpoint",
    "save_model": "kdsa.model.checkpoint",
}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_exports("kdsa.model", _PUBLIC)
