"""Training checkpoints: Orbax ``CheckpointManager``, asynchronous saves, exact resume, fallback.

One checkpoint per saved step under ``run_dir/checkpoints/<step>/`` with two items:

* ``state``: the whole ``TrainState`` (trainable parameters, the rest of the model incl. the
  routing biases ``e_score_correction_bias``, optimizer state, step, RNG) as a flat dict
  ``{"params.segments.0...": array}`` (plain keys, restored into the abstract target's
  structure and shardings);
* ``meta``: JSON: the data iterator position (batches consumed), the configs, and a fingerprint
  of the state (per-array float32 sums computed by one jitted function).

Saves are asynchronous (Orbax copies the arrays off the device, then writes in a background
thread; ``wait()`` joins). Orbax writes into a temporary directory and renames it when complete,
so a partial save is never listed as a step; leftovers are reported. On restore the newest step
is read and its fingerprint recomputed; if reading fails or the fingerprint differs (corrupted
bytes), the reason is printed to stderr and the previous step is tried.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten_state(tree) -> dict[str, Any]:
    """``{"a.b.0.c": leaf}`` over the pytree's leaves (dots join the path)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {".".join(_key_name(k) for k in path): leaf for path, leaf in flat}
    if len(out) != len(flat):
        raise ValueError("two state leaves flatten to the same key")
    return out


def unflatten_state(template, flat: dict[str, Any]):
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(
        treedef, [flat[".".join(_key_name(k) for k in p)] for p, _ in paths])


@jax.jit
def _fingerprint(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: jnp.sum(v.astype(jnp.float32)) for k, v in flat.items()}


def fingerprint(flat: dict[str, jax.Array]) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(_fingerprint(flat)).items()}


class Checkpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True,
                 process_local: bool = False):
        """``process_local``: this process alone (no barriers with the job's other processes);
        for state replicated per process (``kdsa rl`` multi-host: only process 0 saves)."""
        self.directory = Path(directory).absolute()
        self.every = every
        self.process_local = process_local
        me = jax.process_index()
        mp = (ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
              if process_local else ocp.options.MultiprocessingOptions())
        if process_local:  # Orbax creates no root directory with active_processes set
            self.directory.mkdir(parents=True, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, save_interval_steps=every, create=not process_local,
                enable_async_checkpointing=async_save, multiprocessing_options=mp),
            item_names=("state", "meta"))

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` at ``step`` (if due, or ``force``); returns whether it does."""
        if not force and step % self.every:
            return False
        if step in self.manager.all_steps():
            return False
        flat = flatten_state(state)
        if self.process_local:  # Orbax refuses host-local jax.Arrays in a multi-process job
            flat = {k: np.asarray(v) for k, v in flat.items()}
        meta = dict(meta, step=int(step), fingerprint=fingerprint(flat))
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore_latest(self, template, *, log=None) -> tuple[int, Any, dict] | None:
        """``(step, state, meta)`` of the newest readable checkpoint, or None if there is none.

        ``template``: a state pytree of ``jax.ShapeDtypeStruct`` (with shardings) or arrays.
        """
        log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        for p in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
            log(f"checkpoint: ignoring unfinished save {p.name} (interrupted while writing)")
        abstract = {k: _abstract(v) for k, v in flatten_state(template).items()}
        local = None
        if self.process_local:  # read as NumPy, then onto this process's first device
            local = jax.local_devices()[0]
            abstract = {k: np.zeros(v.shape, v.dtype) for k, v in abstract.items()}
        for step in reversed(self.all_steps()):
            try:
                got = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
                flat, meta = dict(got["state"]), dict(got["meta"])
                if local is not None:
                    flat = jax.device_put(flat, local)
                if set(flat) != set(abstract):
                    raise ValueError(f"state keys differ from the model's: "
                                     f"{sorted(set(flat) ^ set(abstract))[:4]}")
                want = meta.get("fingerprint", {})
                have = fingerprint(flat)
                bad = [k for k in have if not np.float32(want.get(k, np.nan)) == np.float32(
                    have[k])]
                if bad:
                    raise ValueError(f"{len(bad)} arrays do not match their saved fingerprint "
                                     f"(first: {bad[0]})")
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
                older = [s for s in self.all_steps() if s < step]
                nxt = f"falling back to step {older[-1]}" if older else "no older checkpoint"
                log(f"checkpoint: step {step} in {self.directory} is corrupted or unreadable "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); {nxt}")
                continue
            return step, unflatten_state(template, flat), meta
        return None


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
