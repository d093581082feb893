"""Multi-host start-up: ``initialize()`` from flags or environment, with a clear timeout.

Every host of a job runs the same command. The coordinator address, process count and this
process's id come from arguments, else from ``KDSA_COORDINATOR`` / ``KDSA_NUM_PROCESSES`` /
``KDSA_PROCESS_ID`` (set by ``kdsa launch-local``), else from JAX's cluster auto-detection
(TPU pods, SLURM, Open MPI, ...) when ``auto=True``. A single process needs nothing.
On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

import jax

ENV_COORDINATOR = "KDSA_COORDINATOR"
ENV_NUM_PROCESSES = "KDSA_NUM_PROCESSES"
ENV_PROCESS_ID = "KDSA_PROCESS_ID"
ENV_SHARE_COMPILES = "KDSA_SHARE_COMPILES"

_initialized = False


class JoinError(RuntimeError):
    """A process could not join the multi-process job (peer missing or unreachable)."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 120,
               auto: bool = False) -> bool:
    """Join the multi-process job if one is configured. Returns True if distributed.

    Raises ``ValueError`` for incomplete settings and ``JoinError`` naming the coordinator
    and the process count when the peers do not all arrive within ``timeout_s``.
    """
    global _initialized
    if _initialized:
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if not any(given):
        if auto:
            jax.distributed.initialize(initialization_timeout=timeout_s)
            _initialized = True
            _compile_in_every_process()
            return jax.process_count() > 1
        return False
    if not all(given):
        raise ValueError(
            f"multi-host settings are incomplete: coordinator={coordinator_address!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}; set all three "
            f"(flags or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is outside [0, num_processes={num_processes})")
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        with _raising_client():
            jax.distributed.initialize(coordinator_address=coordinator_address,
                                       num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - re-raised with the job's shape in the message
        _forget_failed_client()
        raise JoinError(
            f"process {process_id} of {num_processes} could not join the job at coordinator "
            f"{coordinator_address} within {timeout_s}s: a peer is missing or unreachable "
            f"(every host must run the same command; process 0 hosts the coordinator). "
            f"Cause: {_cause(e)}") from e
    _initialized = True
    if not _compile_in_every_process() and os.environ.get(ENV_SHARE_COMPILES):
        share_compiles(os.environ[ENV_SHARE_COMPILES])
    return True


def _compile_in_every_process() -> bool:
    """After joining: in a multi-process CPU job whose JAX cannot run a program another process
    compiled (:func:`_loaded_cpu_programs_deadlock`), turn the persistent compilation cache off
    and say that ``KDSA_SHARE_COMPILES`` is ignored. Returns whether it did."""
    if jax.process_count() < 2 or not _loaded_cpu_programs_deadlock():
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    if os.environ.get(ENV_SHARE_COMPILES):
        print(f"kdsa: {ENV_SHARE_COMPILES} ignored: JAX {jax.__version__} on CPU cannot run a "
              "program another process compiled (docs/sharding.md, section 7)",
              file=sys.stderr, flush=True)
    return True


def _loaded_cpu_programs_deadlock() -> bool:
    """Whether this multi-process CPU job must compile every program in every process.

    Under JAX 0.12.1 (released 2026-12-06) a multi-process program on CPU that one process
    loads from the persistent compilation cache, or receives from process 0
    (``share_compiles``), hangs in its first gloo collective while the peer runs the copy it
    compiled itself: two processes of two devices, four small jitted reductions, a warm cache
    (0.12.0 runs the same script, and the two-process jobs of the test suite, either way).
    Later versions are treated alike until one is shown to work."""
    version = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])  # 0.12.1rc1 too
    return jax.default_backend() == "cpu" and version >= (0, 12, 1)


def share_compiles(cache_dir: str) -> None:
    """Process 0 compiles every multi-process program and hands the executable to the others
    (``jax_share_binary_between_hosts``, keyed by the persistent compilation cache in
    ``cache_dir``); set by ``KDSA_SHARE_COMPILES=DIR`` (``kdsa launch-local`` tests: one compile
    instead of one per process on a machine whose cores they share).

    On CPU, JAX keys the cache by the device topology's fingerprint, which differs between the
    processes of one job (each sees its own local devices), so they would never find each
    other's program and every process but 0 would wait forever; here the key hashes the
    program's global device ids and kinds instead (``jax._src.cache_key``, JAX 0.12).
    """
    from jax._src import cache_key

    cpu = jax.default_backend() == "cpu"
    if cpu and not callable(getattr(cache_key, "_hash_accelerator_config", None)):
        raise ValueError(f"{ENV_SHARE_COMPILES}: this JAX ({jax.__version__}) has no "
                         "jax._src.cache_key._hash_accelerator_config to re-key on CPU; unset "
                         "it (each process then compiles for itself)")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_share_binary_between_hosts", True)
    if cpu:
        def by_device_ids(hash_obj, devices):
            for d in devices.flat:
                hash_obj.update(f"{d.id}:{d.device_kind};".encode())

        cache_key._hash_accelerator_config = by_device_ids


@contextlib.contextmanager
def _raising_client():
    """Make a failed join raise instead of killing the process.

    JAX 0.12's distributed client, built without an error callback, aborts the whole process
    (absl FATAL, exit 134) when registration times out, so no Python handler could name the
    problem. ``jax.distributed.initialize`` does not expose the callback; while it runs, the
    client factory gets one, and the failure surfaces as an exception from ``connect()``.
    """
    from jax._src import distributed as jax_distributed

    factory = jax_distributed._jax.get_distributed_runtime_client

    def with_callback(*args, **kwargs):
        kwargs.setdefault("missed_heartbeat_callback", _on_coordination_error)
        return factory(*args, **kwargs)

    jax_distributed._jax.get_distributed_runtime_client = with_callback
    try:
        yield
    finally:
        jax_distributed._jax.get_distributed_runtime_client = factory


def _cause(e: Exception) -> str:
    if "bad_cast" in str(e):  # our callback fired: the service's status did not reach Python
        return "the coordination service reported an error (registration timed out)"
    return str(e)


def _on_coordination_error(*_):
    raise JoinError("the JAX coordination service reported an error")


def _forget_failed_client() -> None:
    """Drop the half-initialised client and service so exit does not re-raise their error."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    for name in ("client", "service", "preemption_sync_manager"):
        if hasattr(state, name):
            setattr(state, name, None)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
