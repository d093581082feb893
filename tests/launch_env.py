"""The environment of the multi-process tests' subprocesses (``kdsa launch-local``, selfcheck)."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))


def launch_env(**extra: str) -> dict[str, str]:
    """CPU, unbuffered output, XLA at optimisation level 0 like the in-process tests
    (``conftest.py``); no inherited device count (``launch-local`` sets one per process) and no
    inherited process coordinates; this folder on ``PYTHONPATH``, so ``--module selfcheck`` /
    ``jobcheck`` / ``rl_entry`` import. ``extra`` entries are added last."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=path,
               XLA_FLAGS="--xla_backend_optimization_level=0 "
               "--xla_cpu_copy_insertion_use_region_analysis=false")
    for k in ("KDSA_COORDINATOR", "KDSA_NUM_PROCESSES", "KDSA_PROCESS_ID"):
        env.pop(k, None)
    env.update(extra)
    return env
