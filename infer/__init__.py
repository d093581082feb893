"""kdsa.infer: generation and serving (engine, caches, chat formats, sampling, HTTP server).

Public (imported on first use)::

    from kdsa.infer import Engine, Request, Completion, Event, EngineDead, GenerationError

``Engine`` runs continuous batching over a runner (``runner.ModelRunner``); ``Request`` is
what it takes, ``Completion`` / ``Event`` what it gives. ``generate.py`` (the batch job) and
``server.py`` (the OpenAI-compatible server) are built on these. infer/ never imports train/.
"""

_PUBLIC = {
    "Engine": "kdsa.infer.engine",
    "Request": "kdsa.infer.requests",
    "Completion": "kdsa.infer.requests",
    "Event": "kdsa.infer.requests",
    "EngineDead": "kdsa.infer.requests",
    "GenerationError": "kdsa.infer.requests",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kdsa.infer' has no attribute {name!r}")
