"""The environment of the multi-process tests' subprocesses (``kdsa launch-local``, selfcheck)."""

import os


def launch_env(**extra: str) -> dict[str, str]:
    """CPU, unbuffered output, XLA at optimisation level 0 like the in-process tests
    (``conftest.py``); no inherited device count (``launch-local`` sets one per process) and no
    inherited process coordinates. ``extra`` entries are added last."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_backend_optimization_level=0")
    for k in ("KDSA_COORDINATOR", "KDSA_NUM_PROCESSES", "KDSA_PROCESS_ID"):
        env.pop(k, None)
    env.update(extra)
    return env
