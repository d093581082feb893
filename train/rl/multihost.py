"""Multi-host RL: rollouts split across processes, the update on the train layout over all.

With ``P = jax.process_count() > 1`` (the same ``kdsa rl`` command on every host, or
``kdsa launch-local --processes P -- rl ...``):

* **rollouts** (``play_split``): every process draws the same tasks (same seeds) and plays the
  groups ``g`` with ``g % P == process_index`` on its own engine (its local generate mesh); the
  finished episodes are then exchanged (pickled, ``process_allgather``), so every process holds
  every group in the same order and takes the same dynamic-sampling, batch and metric decisions.
  An episode's sampling seed is its position in the whole list (``Episode.index``), so the split
  draws the same tokens as one process would;
* **update** (``train/placement.py``): the train state lives on the ``train`` layout of a mesh over
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
