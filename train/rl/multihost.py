"""Multi-host RL: rollouts split across processes, the update on the train layout over all.

With ``P = jax.process_count() > 1`` (the same ``kdsa rl`` command on every host, or
``kdsa launch-local --processes P -- rl ...``):

* **rollouts** (``play_split``): every process draws the same tasks (same seeds) and plays the
  groups ``g`` with ``g % P == process_index`` on its own engine (its local generate mesh); the
  finished episodes are then exchanged (pickled, ``process_allgather``), so every process holds
  every group in the same order and takes the same dynamic-sampling, batch and metric decisions.
  An episode's sampling seed is its position in the whole list (``Episode.index``), so the split
  draws the same tokens as one process would;
* **update** (:class:`Placement`): the train state lives on the ``train`` layout of a mesh over
  every process's devices (FSDP / EP / TP / sequence, ``kdsa rl --mesh``), each process holding
  only its shards; the batch's rows are split over the batch axes (each process hands over its
  own rows of its identical copy), and the exact accumulation of ``train/rl/step.py`` holds
  (denominators come from the whole batch);
* **weight sync and checkpoints**: the sampler's whole copy on each process's local generate
  mesh comes from ``sharding.reshard`` (global -> local: an all-gather, then a relabel); every
  process writes its shards of the checkpoint together (Orbax).

On one process every function here is the identity.
"""

from __future__ import annotations

import contextlib
import pickle

import jax
import numpy as np


def allgather_objects(obj) -> list:
    """``[obj of process 0, obj of process 1, ...]`` on every process (pickled bytes through
    ``multihost_utils.process_allgather``, padded to the longest)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [pickle.loads(every[p, :int(sizes[p])].tobytes()) for p in range(len(sizes))]


def play_split(play, groups: list[list], **kw) -> tuple[list[list], int]:
    """Play ``groups`` (lists of episodes) with ``play(episodes, **kw)``, each process its share
    (``g % P == process_index``); returns ``(every group in order, episodes played here)``.
    Episodes get their global ``index`` first (their sampling seed)."""
    i = 0
    for grp in groups:
        for e in grp:
            e.index, i = i, i + 1
    n, me = jax.process_count(), jax.process_index()
    mine = [(g, grp) for g, grp in enumerate(groups) if g % n == me]
    play([e for _, grp in mine for e in grp], **kw)
    if n == 1:
        return groups, i
    out: list = [None] * len(groups)
    for share in allgather_objects(mine):
        for g, grp in share:
            out[g] = grp
    return out, sum(len(grp) for _, grp in mine)


class Placement:
    """Where the RL update runs: one device (``mesh=None`` in a one-process job, as before
    any layout is asked for) or the ``train`` layout on ``mesh`` (``kdsa rl --mesh``: data,
    fsdp, expert, tensor, sequence; every process's devices in a multi-process job), the same
    placement ``kdsa train`` uses (``sharding/train_state.py``): the state sharded by the
    rules, the step-0 state computed in its layout, batches split over the batch axes with
    each process handing over its own rows, the step traced under ``use_sharding``."""

    def __init__(self, mesh, graphdef, template):
        self.mesh, self.graphdef = mesh, graphdef
        if mesh is None:
            if jax.process_count() > 1:
                raise ValueError("a multi-process RL job needs a train mesh over every "
                                 "process's devices")
            self.device, self.shardings = jax.local_devices()[0], None
            return
        from kdsa.sharding.train_state import train_state_shardings
        self.shardings = train_state_shardings(graphdef, template, mesh, "train")

    @property
    def size(self) -> int:
        """Devices the update runs on (``update_devices`` in metrics.jsonl)."""
        return 1 if self.mesh is None else self.mesh.size

    @property
    def collective(self) -> bool:
        """Checkpoints are written by every process together (the state spans them)."""
        return self.mesh is not None and jax.process_count() > 1

    def template(self, template):
        """A restore target: the abstract state with the layout's shardings attached."""
        if self.mesh is None:
            return template
        from kdsa.sharding.train_state import sharded_template
        return sharded_template(template, self.shardings)

    def params_template(self, template):
        return self.template(template).params

    def initial(self, build, compiler_options=None):
        """The step-0 state where the update runs (on a mesh: computed in its layout)."""
        if self.mesh is None:
            return jax.device_put(build(), self.device)
        from kdsa.sharding.train_state import init_sharded
        return init_sharded(build, self.shardings, compiler_options)

    def batch(self, batch: dict) -> dict:
        """Host batch (the same on every process) -> rows over the batch axes."""
        if self.mesh is None:
            return batch
        from kdsa.sharding.train_state import place_batch
        return place_batch(batch, self.mesh, "train")

    def rules(self):
        """The context the update is traced in (the train rules), or a no-op."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from kdsa.sharding.constrain import use_sharding
        return use_sharding(self.mesh, "train")


def local_copy(tree):
    """This process's copy of a tree whose arrays are replicated over processes (identity for
    local arrays); a non-replicated multi-process array is an error, never a silent shard."""
    def one(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            return a
        if not a.sharding.is_fully_replicated:
            raise ValueError(f"array {a.shape} with sharding {a.sharding} is split over "
                             "processes; a local copy needs it replicated")
        return a.addressable_data(0)

    return jax.tree.map(one, tree)
