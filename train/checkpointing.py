"""Training checkpoints on Orbax's v1 API: asynchronous saves, exact resume, fallback.

One checkpoint per saved step under ``run_dir/checkpoints/<step>/`` with two checkpointables:

* ``state``: the whole ``TrainState`` (trainable parameters, the rest of the model incl. the
  routing biases ``e_score_correction_bias``, optimizer state, step, RNG) as a flat dict
  ``{"params.segments.0...": array}`` (plain keys, restored into the abstract target's
  structure and shardings), an Orbax PyTree in ``<step>/state/``;
* ``meta``: JSON (``<step>/meta/data.json``; Orbax's ``JsonHandler``, bound to the name ``meta``
  in a local handler registry): the data iterator position (batches consumed), the configs,
  and per-array checksums of the state (:func:`checksums`: one jitted function, exact and
  independent of the sharding, so a run resumes on another mesh).
  Steps written before the port to the v1 API (v0 ``CheckpointManager``: ``meta/metadata``)
  read the same.

The one Orbax API is ``orbax.checkpoint.experimental.v1`` (as for model folders,
``kdsa.model.checkpoint``): its ``training.Checkpointer`` with a ``LatestN(keep)``
preservation policy; :meth:`Checkpointer.save` decides which steps are saved and passes
``force`` (the save-decision policy, ``FixedIntervalPolicy(every)``, is only what
``should_save`` answers: Orbax's own check would also refuse a step at or below the newest one,
and the re-done step after a corrupt one is exactly that). ``process_local`` (this process
alone, no barriers) runs on v1's ``save_checkpointables_async`` / ``load_checkpointables``
instead (``train/local_steps.py``): the training ``Checkpointer`` always asks its v0
``CheckpointManager`` to create the root directory, which Orbax refuses with
``active_processes`` set.

Saves are asynchronous (Orbax copies the arrays off the device, then writes in a background
thread; ``wait()`` joins). Orbax writes into a temporary directory and renames it when complete,
so a partial save is never listed as a step; leftovers of an interrupted run are reported at
restore and removed by the first save after it (process 0, the others wait: no save of this run
has started yet, and a save it would redo is written anew). On restore the newest step
is read and its checksums recomputed; if reading fails or a checksum differs (corrupted
bytes), the reason is printed to stderr (one line; Orbax's own logging is kept quiet) and the
previous step is tried.

A step skipped that way is garbage, but it still counts as a step: ``save`` would skip it as
existing (the redone work never saved) and pruning would count it as one of the kept ones. So
the first save after such a restore moves every skipped step out of Orbax's sight, renaming
``N`` to ``N.corrupt`` (process 0 renames, the others wait; nothing is deleted, so a step
misjudged as corrupt can still be recovered by hand), and then saves: the redone step replaces
it atomically (Orbax's temporary directory and rename) and pruning counts readable steps only,
so it never removes the newest readable checkpoint in favour of a corrupt one.

A checkpoint written with another config would fail inside Orbax (the arrays do not fit the
template) and read as corrupt. ``restore_latest(check=...)`` first reads each step's ``meta``
item (JSON, cheap) and lets ``check`` refuse it: :func:`config_check` raises a ``ValueError``
naming the model-config fields and the state-shaping train-config fields (:data:`STATE_FIELDS`)
that differ, with both values.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from orbax.checkpoint.experimental import v1 as ocp

from kdsa.model.folders import orbax_context, orbax_reason, quiet_orbax
from kdsa.sharding.agreement import every_process, from_first_process
from kdsa.train.checksums import checksums, mismatched
from kdsa.train.local_steps import LocalSteps

# Orbax's temporary folder of a save (``N.orbax-checkpoint-tmp...``): one left behind is an
# interrupted save (``find_unfinished``; the run-dir space check counts it as room)
UNFINISHED_MARK = ".orbax-checkpoint-tmp"
# TrainConfig fields that change the state's tree (which parameters train, the optimizer state)
STATE_FIELDS = ("optimizer", "indexer_stage")
# ... and those that change the data stream the saved position counts in (batches of
# ``batch_size`` rows of ``seq_len`` tokens, shuffled by ``seed``): another value would resume
# at another row, repeating or skipping data
STREAM_FIELDS = ("batch_size", "seq_len", "seed")
# RLConfig fields that shape an RL run's task stream (its position is a task counter): which
# environments and efforts the tasks are drawn from, and which steps are SFT
RL_STREAM_FIELDS = ("envs", "effort_weights", "sft_steps")


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


def _context(process_local: bool) -> ocp.Context:
    """The v1 ``Context`` of every call: the ``meta`` item is JSON (``JsonHandler`` bound to that
    name; unbound, Orbax would pick its PyTree handler for a dict), and ``process_local`` makes
    this process the only one Orbax waits for."""
    registry = ocp.handlers.local_registry()
    registry.add(ocp.handlers.JsonHandler, checkpointable_name="meta")
    ctx = orbax_context()
    ctx.checkpointables.registry = registry
    if process_local:
        me = jax.process_index()
        ctx.multiprocessing.primary_host = me
        ctx.multiprocessing.active_processes = {me}
    return ctx


class Checkpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True,
                 process_local: bool = False):
        """``process_local``: this process alone (no barriers with the job's other processes);
        for state replicated per process (only one process saves). ``async_save=False``: each
        :meth:`save` returns once the step is written."""
        self.directory = Path(directory).absolute()
        self.every = every
        self.async_save = async_save
        self.process_local = process_local
        self.skipped: list[int] = []  # steps restore_latest found unreadable, set aside at save
        self.unfinished: list[Path] = []  # interrupted saves found at restore, removed at save
        self._tidy = False  # the next save sets aside / removes first (every process agrees)
        self._log = _stderr
        ctx = _context(process_local)
        if process_local:
            self.manager = LocalSteps(self.directory, keep, ctx)
        else:
            self.manager = ocp.training.Checkpointer(
                self.directory, context=ctx,
                save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(
                    every),
                preservation_policy=ocp.training.preservation_policies.LatestN(keep))

    def all_steps(self) -> list[int]:
        return sorted(c.step for c in self.manager.checkpoints)

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` at ``step`` (if due, or ``force``); returns whether it does."""
        if not force and step % self.every:
            return False
        if self.skipped or self._tidy:
            self._set_aside(self.skipped)
        if step in self.all_steps():
            return False
        flat = flatten_state(state)
        if self.process_local:  # Orbax refuses host-local jax.Arrays in a multi-process job
            flat = {k: np.asarray(v) for k, v in flat.items()}
        # as JSON now: a value JSON cannot hold fails here, not in the background write
        meta = json.loads(json.dumps(dict(meta, step=int(step), checksums=checksums(flat))))
        # force: save() has decided (the manager would refuse a step at or below its newest)
        saving = self.manager.save_checkpointables_async(step, {"state": flat, "meta": meta},
                                                         force=True)
        if saving is None:
            return False
        if not self.async_save:
            self.manager.wait()  # written, and older steps pruned
        return True

    def _set_aside(self, steps: list[int]) -> None:
        """Rename the unreadable ``steps`` to ``N.corrupt`` (process 0; the others wait), so
        Orbax neither lists nor prunes nor skips them, and remove the unfinished saves found at
        restore (partial writes of steps this run redoes; they held disk space nothing freed)."""
        if self.process_local or jax.process_index() == 0:
            for p in self.unfinished:
                shutil.rmtree(p, ignore_errors=True)
                self._log(f"checkpoint: removed unfinished save {p.name}")
            for step in steps:
                src = self.directory / str(step)
                if not src.is_dir():
                    continue
                dst = aside_path(src, "corrupt")
                os.rename(src, dst)
                self._log(f"checkpoint: unreadable step {step} moved to {dst} (delete it when "
                          f"you no longer need it); saving anew")
        if not self.process_local and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("kdsa_checkpoint_set_aside")
        self.skipped, self.unfinished, self._tidy = [], [], False
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        self.manager.close()

    def find_unfinished(self, log) -> None:
        """Note the unfinished saves here (Orbax's temporary folders of an interrupted save) for
        the next save to remove. Process 0's list decides: every process learns whether it has
        any, so all of them take that save's barrier (``_set_aside``) or none does."""
        self.unfinished = sorted(self.directory.glob(f"*{UNFINISHED_MARK}*"))
        for p in self.unfinished:
            log(f"checkpoint: ignoring unfinished save {p.name} (interrupted while writing; "
                f"the next save into this folder removes it)")
        found = bool(self.unfinished)
        if not self.process_local:  # process 0's list decides, on every process
            found = bool(from_first_process(found))
        self._tidy = self._tidy or found

    def restore_run(self, template, *, resume: bool, model_config: dict, train_config: dict,
                    rl_config: dict | None = None, log=None) -> tuple[int, Any, dict] | None:
        """The start of a run writing here: None for a fresh run (refused with a ValueError
        when checkpoints exist, so two runs' steps never mix in one folder), else with
        ``resume`` the newest readable checkpoint (:meth:`restore_latest`) whose config matches
        the run's (:func:`config_check`); None (logged) when there is no checkpoint, a
        ValueError when none is readable (a fresh start would drop the metrics and reference
        of the run they belong to)."""
        steps = self.all_steps()
        if steps and not resume:
            raise ValueError(f"{self.directory.parent} already holds checkpoints (steps "
                             f"{steps}); pass --resume to continue that run, or choose "
                             f"another --run-dir")
        if not steps:  # an interrupted first save may have left its folder: removed at save
            self._log = log or _stderr
            self.find_unfinished(self._log)
            if resume:
                self._log(f"--resume: no checkpoint in {self.directory}; starting from step 0")
            return None
        restored = self.restore_latest(template, log=log,
                                       check=config_check(model_config, train_config, rl_config))
        if restored is None:
            raise ValueError(f"--resume: no readable checkpoint in {self.directory}")
        return restored

    def restore_latest(self, template, *, log=None,
                       check: Callable[[Path, dict], None] | None = None
                       ) -> tuple[int, Any, dict] | None:
        """``(step, state, meta)`` of the newest readable checkpoint, or None if there is none.

        ``template``: a state pytree of ``jax.ShapeDtypeStruct`` (with shardings) or arrays.
        ``check(step_dir, meta)``: called with each step's ``meta`` item before its state is
        read; an exception it raises (e.g. :func:`config_check`'s ``ValueError``) propagates
        instead of counting the step as corrupt. Skipped steps are remembered in ``skipped``
        and set aside by the next :meth:`save`.
        """
        log = log or _stderr
        self._log = log
        self.find_unfinished(log)
        abstract = {k: _abstract(v) for k, v in flatten_state(template).items()}
        local = None
        if self.process_local:  # read as NumPy, then onto this process's first device
            local = jax.local_devices()[0]
        # a NumPy target (np.zeros: no pages touched) reads as host NumPy; a leaf without a
        # sharding does too (Orbax v1 would place it by the shardings it was saved with)
        abstract = {k: np.zeros(v.shape, v.dtype) if local is not None or v.sharding is None
                    else v for k, v in abstract.items()}
        self.skipped = []
        for step in reversed(self.all_steps()):
            try:
                with quiet_orbax():
                    meta = self.manager.load_checkpointables(step, {"meta": None})["meta"]
                if not isinstance(meta, dict):
                    raise ValueError(f"the meta item is a {type(meta).__name__}, not a dict")
                unread = None
            except Exception as e:  # noqa: BLE001 - an unreadable meta item: a corrupt step
                unread = e
            # agreed, as the state's read below: one process skipping alone would leave the
            # others waiting in that read's collective
            if not self.process_local and not every_process(unread is None):
                unread = unread or RuntimeError("another process of the job could not read "
                                                "its meta item")
            if unread is not None:
                self._skip(step, unread, log)
                continue
            if check is not None:
                check(self.directory / str(step), meta)
            try:
                with quiet_orbax(collect=True):
                    flat = dict(self.manager.load_checkpointables(
                        step, {"state": abstract})["state"])
                if local is not None:
                    flat = jax.device_put(flat, local)
                if set(flat) != set(abstract):
                    raise ValueError(f"state keys differ from the model's: "
                                     f"{sorted(set(flat) ^ set(abstract))[:4]}")
                read = None
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
                read = e
            # every process reads its own shards: one that failed fails the step for all, so
            # all fall back together (and meet in the same collectives: the checksums are one)
            if not self.process_local and not every_process(read is None):
                read = read or RuntimeError("another process of the job could not read it")
            if read is None:
                bad = mismatched(meta, flat)  # replicated values: the same verdict everywhere
                if bad:
                    read = ValueError(f"{len(bad)} arrays do not match their saved checksum "
                                      f"(first: {bad[0]})")
            if read is not None:
                self._skip(step, read, log)
                continue
            return step, unflatten_state(template, flat), meta
        return None

    def _skip(self, step: int, e: BaseException, log) -> None:
        self.skipped.append(step)
        older = [s for s in self.all_steps() if s < step]
        nxt = f"falling back to step {older[-1]}" if older else "no older checkpoint"
        log(f"checkpoint: step {step} in {self.directory} is corrupted or unreadable "
            f"({orbax_reason(e)}); {nxt}; it is moved to {step}.corrupt at the next save")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _show(v) -> str:
    return "absent" if v is None else v if isinstance(v, str) else json.dumps(v)


def _differences(old, new, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix[:-1]}: checkpoint {_show(old)}, now {_show(new)}"]


def config_differences(meta: dict, model_config: dict, train_config: dict,
                       rl_config: dict | None = None) -> list[str]:
    """``["num_hidden_layers: checkpoint 4, now 8", "train.optimizer: ...", ...]``: where a
    checkpoint's ``meta`` differs from this run in its model config (any field, nested ones
    dotted) or in the train-config fields that shape the state or the data stream
    (:data:`STATE_FIELDS`, :data:`STREAM_FIELDS`), and with ``rl_config`` (an RL run's, as
    JSON) in the RL fields that shape its task stream (:data:`RL_STREAM_FIELDS`)."""
    out = _differences(meta.get("model_config") or {}, model_config)
    old = meta.get("train_config") or {}
    out += [f"train.{f}: checkpoint {_show(old.get(f))}, now {_show(train_config.get(f))}"
            for f in STATE_FIELDS + STREAM_FIELDS if f in old and old[f] != train_config.get(f)]
    old = meta.get("rl_config") or {}
    ordered = lambda v: list(v.items()) if isinstance(v, dict) else v  # noqa: E731 (draws
    # index the levels in order: the same weights in another order are another stream)
    out += [f"rl.{f}: checkpoint {_show(old.get(f))}, now {_show(rl_config.get(f))}"
            for f in RL_STREAM_FIELDS if rl_config is not None and f in old
            and ordered(old[f]) != ordered(rl_config.get(f))]
    return out


def config_check(model_config: dict, train_config: dict,
                 rl_config: dict | None = None) -> Callable[[Path, dict], None]:
    """A ``restore_latest(check=...)`` that refuses a checkpoint written with another config:
    one-line ``ValueError`` naming the differing fields with both values."""
    def check(step_dir: Path, meta: dict) -> None:
        diff = config_differences(meta, model_config, train_config, rl_config)
        if diff:
            more = f" (and {len(diff) - 6} more)" if len(diff) > 6 else ""
            raise ValueError(f"--resume: {step_dir} was written with another config: "
                             f"{'; '.join(diff[:6])}{more}; resume with that config, or use "
                             f"another --run-dir")
    return check


def aside_path(path: Path, tag: str) -> Path:
    """Where ``path`` is set aside: ``path.tag``, or ``path.tag-2``, ``-3``, ... when taken."""
    dst, k = path.with_name(f"{path.name}.{tag}"), 1
    while os.path.lexists(dst):
        k += 1
        dst = path.with_name(f"{path.name}.{tag}-{k}")
    return dst


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
