"""kdsa.infer: generation and serving (engine, caches, chat formats, sampling, HTTP server).

Public (imported on first use)::

    from kdsa.infer import Engine, Request, Completion, Event, EngineDead, GenerationError

``Engine`` runs continuous batching over a runner (``runner.ModelRunner``); ``Request`` is
what it takes, ``Completion`` / ``Event`` what it gives. ``generate.py`` (the batch job) and
``server.py`` (the OpenAI-compatible server) are built on these. infer/ never imports train/.
"""

from kdsa import lazy_exports

_PUBLIC = {
    "Engine": "kdsa.infer.engine",
    "Request": "kdsa.infer.requests",
    "Completion": "kdsa.infer.requests",
    "Event": "kdsa.infer.requests",
    "EngineDead": "kdsa.infer.requests",
    "GenerationError": "kdsa.infer.requests",
}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_exports("kdsa.infer", _PUBLIC)
