"""Move parameters between layouts (``train`` <-> ``generate``): array by array, device to device.

RL weight sync: the trainer's tree (FSDP + EP + TP, ``train`` rules) becomes the sampler's
(EP + TP, requests over data, ``generate`` rules), possibly on another mesh shape or another
subset of devices, and back. Each array goes with one ``jax.device_put`` to its target
``NamedSharding``: the runtime copies shards between devices (collectives / transfers), no
host ever holds a whole array, let alone the tree. Peak memory per device is the source tree
plus the target arrays moved so far; with ``donate=True`` each source array is released once
its copy exists, so the peak stays near ``max(source, target) + one array`` (the bound
``ReshardReport.peak_device_bytes`` computes shard by shard; ``measured_peak_bytes`` reads the
allocator where it reports, GPU/TPU). MaxText/Tunix reshard in chunks the same way
(``rl.reshard_chunk_size``).

Multi-process RL: the trainer's arrays span every process, but each process's sampler holds a
whole copy on its own devices (a *local* mesh). An array going from a global sharding to a
local one takes two moves: one ``device_put`` to the local layout repeated on every process (a
global mesh ``[process, *local mesh]`` with the same partition spec: replicated over the
process axis, a collective all-gather; the global mesh spans the source's devices, as JAX
requires, so every local device of a process beyond its local mesh holds one more copy until
the move ends), after which this process's shards on its local mesh are exactly the local
array's, which :func:`jax.make_array_from_single_device_arrays` relabels without a copy.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, Sharding

from kdsa.sharding.mesh import device_array
from kdsa.sharding.rules import state_shardings


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    """Time and memory of one move. Bytes are per device (the busiest one) unless noted."""

    seconds: float
    arrays: int
    tree_bytes: int  # logical bytes of the whole tree (all shards once)
    source_device_bytes: int  # before the move
    target_device_bytes: int  # after the move
    peak_device_bytes: int  # live source + target shards at the worst moment (computed)
    measured_peak_bytes: int | None  # allocator peak, where the platform reports it

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _shard_bytes(sharding: Sharding, shape: tuple[int, ...], itemsize: int) -> dict:
    """Bytes per addressable device of an array of ``shape`` under ``sharding``."""
    out = {}
    for dev, idx in sharding.addressable_devices_indices_map(shape).items():
        n = 1
        for sl, dim in zip(idx, shape):
            start, stop, step = sl.indices(dim)
            n *= len(range(start, stop, step))
        out[dev] = n * itemsize
    return out


def _buffers(x: jax.Array) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _peak_allocated() -> int | None:
    stats = [d.memory_stats() for d in jax.local_devices()]
    if not stats or any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return max(s["peak_bytes_in_use"] for s in stats)


CHUNK_BYTES = 256 * 2**20  # per device: arrays moved together, then waited for


def reshard(tree, shardings, *, donate: bool = False, chunk_bytes: int = CHUNK_BYTES):
    """``(moved tree, ReshardReport)``: every array of ``tree`` put to the matching sharding
    of ``shardings`` (same structure, ``Sharding`` leaves), a chunk at a time.

    Consecutive arrays are moved together by one ``device_put`` until their target shards on
    the busiest device reach ``chunk_bytes`` (an array larger than that alone); each chunk
    completes before the next starts, so the peak is the source tree plus one chunk (bounded
    memory) while the per-array dispatch cost is paid once per chunk (measured against one
    plain ``device_put`` of the whole tree: ``bench/bench_rl.py``). With ``donate`` each source
    array is given to ``device_put`` to consume (buffers already where the target wants them
    are reused, the rest freed): the caller's tree is spent.
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    for x, target in zip(leaves, targets):
        if not isinstance(target, Sharding):
            raise ValueError(f"reshard: target for an array of shape {x.shape} is {target!r}, "
                             f"not a Sharding")
    if any(not x.is_fully_addressable for x in leaves) and any(
            isinstance(t, NamedSharding) and t.is_fully_addressable and jax.process_count() > 1
            for t in targets):
        return _reshard_to_local(leaves, treedef, targets)
    live: collections.Counter = collections.Counter()
    for x in leaves:
        live.update(_shard_bytes(x.sharding, x.shape, x.dtype.itemsize))
    source = max(live.values(), default=0)
    peak, moved, total = source, [], 0
    t0 = time.perf_counter()
    for chunk in _chunks(leaves, targets, chunk_bytes):
        xs, ts = [leaves[i] for i in chunk], [targets[i] for i in chunk]
        for x, t in zip(xs, ts):
            live.update(_shard_bytes(t, x.shape, x.dtype.itemsize))
        peak = max(peak, max(live.values(), default=0))
        ys = jax.block_until_ready(jax.device_put(xs, ts, donate=donate))
        for x, y in zip(xs, ys):
            if donate:  # buffers already in place may be reused; the rest are freed now
                if not x.is_deleted() and not _buffers(x) & _buffers(y):
                    x.delete()
                live.subtract(_shard_bytes(x.sharding, x.shape, x.dtype.itemsize))
            total += math.prod(x.shape) * x.dtype.itemsize
        moved.extend(ys)
    seconds = time.perf_counter() - t0
    after: collections.Counter = collections.Counter()
    for y in moved:
        after.update(_shard_bytes(y.sharding, y.shape, y.dtype.itemsize))
    report = ReshardReport(seconds=seconds, arrays=len(moved), tree_bytes=total,
                           source_device_bytes=source,
                           target_device_bytes=max(after.values(), default=0),
                           peak_device_bytes=peak, measured_peak_bytes=_peak_allocated())
    return jax.tree.unflatten(treedef, moved), report


def _chunks(leaves, targets, chunk_bytes: int) -> list[list[int]]:
    """Indices of consecutive arrays whose target shards on any one device stay within
    ``chunk_bytes`` together (an array larger than that forms a chunk alone)."""
    out, cur, load = [], [], collections.Counter()
    for i, (x, t) in enumerate(zip(leaves, targets)):
        add = collections.Counter(_shard_bytes(t, x.shape, x.dtype.itemsize))
        if cur and max((load + add).values(), default=0) > chunk_bytes:
            out.append(cur)
            cur, load = [], collections.Counter()
        cur.append(i)
        load += add
    if cur:
        out.append(cur)
    return out


def local_gather_problem(devices, n: int, all_devices=None) -> str | None:
    """Why arrays on ``devices`` (a job's device set, every process's) cannot be gathered onto
    each process's local mesh of its first ``n`` devices by id (:func:`_per_process_mesh`), or
    None. Each process must hold the same number of them, a multiple of ``n``, including its
    own first ``n``; checked from the device list alone, so a run can refuse a layout before it
    compiles anything. ``all_devices``: the job's devices (default ``jax.devices()``)."""
    all_devices = jax.devices() if all_devices is None else all_devices
    by_process: dict[int, list] = collections.defaultdict(list)
    for d in sorted(devices, key=lambda d: d.id):
        by_process[d.process_index].append(d)
    counts = {p: len(v) for p, v in sorted(by_process.items())}
    firsts = {p: sorted((d for d in all_devices if d.process_index == p),
                        key=lambda d: d.id)[:n] for p in by_process}
    missing = {p: [d.id for d in firsts[p] if d not in by_process[p]] for p in by_process}
    if any(c % n for c in counts.values()) or len(set(counts.values())) > 1 \
            or any(missing.values()):
        return (f"the devices ({counts} per process) do not hold every process's first {n} "
                f"devices in equal numbers (a multiple of {n} per process; missing "
                f"{ {p: m for p, m in missing.items() if m} })")
    return None


def _per_process_mesh(local: Mesh, devices) -> Mesh:
    """A mesh over ``devices`` (the source arrays' device set: JAX moves arrays across hosts
    only within one set) shaped ``[process, copies, *local.shape]``: each process's block is
    its first devices by id arranged as ``make_mesh`` arranges them into ``local``'s shape (as
    ``Sampler`` builds every process's local mesh; on TPU that order follows the torus, not the
    ids), then its other devices, arranged alike, as further copies (one copy per device of the
    block; with the generate mesh over every local device there is one)."""
    n = local.devices.size
    sizes = dict(zip(local.axis_names, local.devices.shape))
    by_process: dict[int, list] = collections.defaultdict(list)
    for d in sorted(devices, key=lambda d: d.id):
        by_process[d.process_index].append(d)
    mine = sorted(jax.local_devices(), key=lambda d: d.id)[:n]
    if list(local.devices.flat) != list(device_array(sizes, mine).flat):
        raise ValueError(f"a local target mesh must be this process's first {n} devices as "
                         f"make_mesh arranges them, got {[d.id for d in local.devices.flat]}")
    problem = local_gather_problem(devices, n)
    if problem:
        raise ValueError(f"{problem}; cannot gather the arrays onto a local mesh")
    blocks = [np.stack([device_array(sizes, v[i:i + n]) for i in range(0, len(v), n)])
              for v in (by_process[p] for p in sorted(by_process))]
    return Mesh(np.stack(blocks), ("process", "copies") + tuple(local.axis_names))


def _reshard_to_local(leaves, treedef, targets):
    """Global arrays -> this process's whole copies on its local mesh (module docstring)."""
    source: collections.Counter = collections.Counter()
    for x in leaves:
        source.update(_shard_bytes(x.sharding, x.shape, x.dtype.itemsize))
    t0 = time.perf_counter()
    meshes: dict = {}
    moved, total = [], 0
    for x, target in zip(leaves, targets):
        if not isinstance(target, NamedSharding) or not target.is_fully_addressable:
            raise ValueError("reshard: a tree moves either within the job's devices or to "
                             "this process's local mesh, not both")
        key = (id(target.mesh), frozenset(d.id for d in x.sharding.device_set))
        if key not in meshes:
            meshes[key] = _per_process_mesh(target.mesh, x.sharding.device_set)
        glob = meshes[key]
        y = jax.device_put(x, NamedSharding(glob, target.spec))
        by_device = {s.device: s.data for s in y.addressable_shards}
        local = jax.make_array_from_single_device_arrays(
            x.shape, target, [by_device[d] for d in target.addressable_devices_indices_map(
                x.shape)])
        moved.append(jax.block_until_ready(local))
        total += math.prod(x.shape) * x.dtype.itemsize
    after: collections.Counter = collections.Counter()
    for y in moved:
        after.update(_shard_bytes(y.sharding, y.shape, y.dtype.itemsize))
    src, dst = max(source.values(), default=0), max(after.values(), default=0)
    report = ReshardReport(seconds=time.perf_counter() - t0, arrays=len(moved),
                           tree_bytes=total, source_device_bytes=src, target_device_bytes=dst,
                           peak_device_bytes=src + dst,  # no donation: both at the end
                           measured_peak_bytes=_peak_allocated())
    return jax.tree.unflatten(treedef, moved), report


def reshard_state(state: nnx.State, mesh: Mesh, layout: str, *, donate: bool = False,
                  chunk_bytes: int = CHUNK_BYTES):
    """``(state on mesh by layout's rules, ReshardReport)``; variables keep their metadata."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    shardings = state_shardings(state, mesh, layout)
    values = jax.tree.map(lambda v: v[...], state, is_leaf=is_var)
    targets = jax.tree.map(lambda s: s, shardings, is_leaf=lambda x: isinstance(x, Sharding))
    moved, report = reshard(values, targets, donate=donate, chunk_bytes=chunk_bytes)
    out = jax.tree.map(lambda v, a: v.replace(a), state, moved, is_leaf=is_var)
    return out, report


def reshard_model(model: nnx.Module, mesh: Mesh, layout: str, *,
                  donate: bool = False) -> ReshardReport:
    """Move ``model``'s variables to ``mesh`` by ``layout`` in place; returns the report."""
    state, report = reshard_state(nnx.state(model), mesh, layout, donate=donate)
    nnx.update(model, state)
    return report
