"""Expert parallelism: routed experts inside ``shard_map``, tokens sent to their experts' owners.

Same maths as ``kdsa.model.moe.experts_ragged`` (``y_n = sum_j w_nj * FFN_{e_nj}(z_n)``), with
the ``E`` experts split over the ``experts`` mesh axes (``ep`` devices own ``E/ep`` each) and
the expert hidden ``I`` over the ``expert_mlp`` axes (``tp``). Per device (MaxText ``moe.py``
``sparse_matmul``, ``maxtext.md`` 2)::

    sort local assignments by expert -> grouped by owner device       [M = N_loc * k]
    exchange over the expert axes (all-to-all)                        rows to their owners
    local grouped matmuls (ragged_dot) over the E/ep owned experts    I/tp columns
    exchange back, unsort, weighted combine in float32, psum over tensor axes

Exchanges (``ShardingContext.ep_collectives``):

* ``padded``: ``all_to_all`` of a ``[ep, C, De]`` buffer, ``C = ceil(cf * M / ep)`` rows per
  (source, destination) pair, ``C = M`` when ``moe_capacity_factor`` is None (worst case,
  dropless). XLA:CPU has no ragged all-to-all, so CPU uses this.
* ``ragged``: ``jax.lax.ragged_all_to_all`` with exact counts (GPU/TPU). Each receiver has
  ``R = ceil(cf * M)`` rows (``M * ep`` when cf is None); a sender learns its offset in each
  receiver from an all-gather of the ``[ep, ep]`` count matrix (senders in device order) and
  sends at most what still fits. ``ragged_emulated`` runs the same offsets with an all-gather
  stand-in for the collective, so CPU tests check them.

Assignments that do not fit are dropped (contribute 0) and counted: the second output is the
number of dropped assignments over all tokens (``metrics["moe_dropped"]``). When tokens are not
sharded over the expert axes (the ``generate`` layout), no exchange is needed: each device runs
its own experts on all tokens and the outputs are summed (``psum``) over the expert axes.
Weights enter with specs ``P(ep, None, tp)`` / ``P(ep, tp, None)``: an FSDP-sharded ``De`` is
all-gathered at the ``shard_map`` boundary by the partitioner (reduce-scattered in backward).

Measured (tiny experts E 8, De 32, I 32, N 32, k 2, float32, 8 CPU devices): max abs error
against ``experts_ragged`` 6.0e-7 forward and 3.6e-6 on the gradients of z, the routing
weights and w1/w3/w2, for ``expert=4,tensor=2`` (padded), ``expert=2,fsdp=2,tensor=2`` (padded
and emulated ragged) and ``expert=4,data=2`` (replicated tokens); ``tests/test_sharding.py``
bounds them at 2e-6 / 1e-5.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdsa.kernels_pallas.common import resolve_interpret, vary_alike
from kdsa.model.activations import gated_activation
from kdsa.model.config import ModelConfig
from kdsa.model.layers import inverse_permutation
from kdsa.model.partitioning import ShardingContext, current, spec_axes, spec_entry
from kdsa.model.mxfp4 import BLOCK
from kdsa.model.stacked_experts import PackedMatrix, ragged_dot, spec_of


def expert_parallel_experts():
    """:func:`experts_sharded` bound to the active sharding context when its rules shard the
    experts or their hidden dim over a mesh axis; None otherwise (single-device experts)."""
    ctx = current()
    if ctx is None or not (ctx.axes("experts") or ctx.axes("expert_mlp")):
        return None
    return functools.partial(experts_sharded, ctx=ctx)


def _name(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def token_axes(ctx: ShardingContext, n: int, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Mesh axes that shard the flattened ``[B*T]`` token dim: the batch axes then the sequence
    axes of the rules (the block order of :func:`token_order`), longest prefix whose product
    divides ``n``."""
    axes = [a for a in ctx.axes("act_batch") + ctx.axes("act_seq") if a not in exclude]
    while axes and n % ctx.size(tuple(axes)):
        axes.pop()
    return tuple(axes)


def token_order(b: int, t: int):
    """``(flatten, unflatten)`` between token arrays ``[B, T, ...]`` and the MoE's rows
    ``[N = B*T, ...]``. Without rules: row-major reshapes. Under a layout's rules the rows are
    ordered so that each device's tokens (its batch block and sequence block of ``[B, T]``)
    are one contiguous block of ``N``, over the batch then the sequence axes: a permutation
    that moves no data between devices, where a row-major reshape of a batch and sequence
    sharded ``[B, T]`` is a reshard that XLA's partitioner did by replicating the tokens
    ("involuntary full rematerialization", e.g. ``tensor=2,sequence=4``). Tokens are
    independent in the MoE, so any fixed order that ``unflatten`` undoes gives the same
    outputs."""
    ctx = current()
    if ctx is None:
        return (lambda a: a.reshape((b * t,) + a.shape[2:]),
                lambda a: a.reshape((b, t) + a.shape[1:]))
    batch_axes, seq_axes = map(spec_axes, ctx.spec(("act_batch", "act_seq"), (b, t)))
    axes, nb, ns = batch_axes + seq_axes, ctx.size(batch_axes), ctx.size(seq_axes)

    def rows(a):  # [N, ...] on the tokens' devices, the rest replicated
        p = P(spec_entry(axes), *(None,) * (a.ndim - 1))
        return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(ctx.mesh, p))

    def flatten(a):  # [B, T, ...] -> [Nb, B/Nb, Ns, T/Ns, ...] -> [Nb, Ns, B/Nb, T/Ns, ...]
        rest = a.shape[2:]
        a = a.reshape((nb, b // nb, ns, t // ns) + rest)
        return rows(jnp.swapaxes(a, 1, 2).reshape((b * t,) + rest))

    def unflatten(a):
        rest = a.shape[1:]
        a = rows(a).reshape((nb, ns, b // nb, t // ns) + rest)
        return jnp.swapaxes(a, 1, 2).reshape((b, t) + rest)

    return flatten, unflatten


def capacity(m: int, ep: int, factor: float | None) -> int:
    """Rows per (source, destination) pair of the padded exchange."""
    if factor is None:
        return m
    return max(1, min(m, math.ceil(factor * m / ep)))


def receive_rows(m: int, ep: int, factor: float | None) -> int:
    """Rows per receiver of the ragged exchange."""
    if factor is None:
        return m * ep
    return max(1, min(m * ep, math.ceil(factor * m)))


def experts_sharded(z, topk_idx, topk_weight, w1, w3, w2, config: ModelConfig, *,
                    ctx: ShardingContext):
    """Expert-parallel ``experts_ragged``: ``(y [N, De] in z.dtype, {"moe_dropped": [] int32})``.

    Same arguments as ``kdsa.model.moe.experts_ragged`` (global shapes): z ``[N, De]``,
    topk ``[N, k]``, w1/w3 ``[E, De, I]``, w2 ``[E, I, De]`` (or ``StackedWeight``s, whose
    stacks enter split the same way behind their repeat axis, or MXFP4 ``PackedMatrix``es,
    whose bytes enter split as the float weight would be and are multiplied inside).
    """
    n, de = z.shape
    e, _, i = w1.shape
    ep_axes = ctx.axes("experts")
    tp_axes = tuple(a for a in ctx.axes("expert_mlp") if a not in ep_axes)
    ep, tp = ctx.size(ep_axes), ctx.size(tp_axes)
    if e % ep:
        raise ValueError(f"num_experts={e} is not divisible by the expert mesh axes "
                         f"{dict((a, ctx.mesh.shape[a]) for a in ep_axes)} (product {ep})")
    if i % (tp * (BLOCK if isinstance(w2, PackedMatrix) else 1)):
        tp_axes, tp = (), 1  # I stays whole, as the rules table's fallback does (MXFP4:
        # w2's contracting I splits only at whole blocks of 32)
    tok = token_axes(ctx, n, exclude=tp_axes)
    exchange = bool(ep_axes) and set(ep_axes) <= set(tok)
    if not exchange:
        tok = tuple(a for a in tok if a not in ep_axes)
    mode = ctx.ep_collectives() if exchange else "replicated"
    body = functools.partial(_BODIES[mode], config=config, ep_axes=ep_axes, tp_axes=tp_axes,
                             tok_axes=tok, factor=ctx.moe_capacity_factor)
    t = P(spec_entry(tok), None)
    ep_entry, tp_entry = spec_entry(ep_axes), spec_entry(tp_axes)
    up, down = P(ep_entry, None, tp_entry), P(ep_entry, tp_entry, None)
    fn = jax.shard_map(body, mesh=ctx.mesh, in_specs=(t, t, t, spec_of(w1, up), spec_of(w3, up),
                                                       spec_of(w2, down)),
                       out_specs=(t, P()), check_vma=_checks_vma(w1))
    y, dropped = fn(z, topk_idx, topk_weight, w1, w3, w2)
    return y, {"moe_dropped": dropped}


def _checks_vma(w) -> bool:
    """Whether the ``shard_map`` checks how values vary over the mesh: always, except around
    the MXFP4 Pallas kernel in interpret mode (CPU tests), whose emulation indexes its refs
    with values that vary over no axis (JAX 0.12 refuses that under the check). Without the
    check the bodies compute the same values and gradients (tested so on CPU); compiling for
    a TPU (``compile_target``) keeps the check and the real kernel."""
    return not (isinstance(w, PackedMatrix) and w.impl == "pallas" and resolve_interpret(None))


# ---------------------------------------------------------------------------------------------
# per-device pieces (inside shard_map: local shapes)
# ---------------------------------------------------------------------------------------------

def _inverse(order: jax.Array) -> jax.Array:
    return inverse_permutation(order)


def _local_experts(rows, ids, w1, w3, w2, config):
    """Rows ``[R, De]`` with local expert ids ``[R]`` (``E_loc`` = empty) through the owned
    experts; ``[R, De]``, zero for empty rows. w1/w3 ``[E_loc, De, I_loc]``, w2
    ``[E_loc, I_loc, De]``."""
    e_loc = w1.shape[0]
    dt = rows.dtype
    order = jnp.argsort(ids, stable=True)                               # empty rows last
    sizes = jnp.zeros((e_loc,), jnp.int32).at[ids].add(1, mode="drop")  # [E_loc]
    x = jnp.take(rows, order, axis=0)                                   # [R, De]
    valid = (jnp.take(ids, order) < e_loc)[:, None]                     # [R, 1]
    gate = ragged_dot(x, w1, sizes, dt)                                 # [R, I_loc]
    up = ragged_dot(x, w3, sizes, dt)
    h = jnp.where(valid, gated_activation(gate, up, config), 0)
    out = jnp.where(valid, ragged_dot(h, w2, sizes, dt), 0)             # [R, De]
    return jnp.take(out, _inverse(order), axis=0)


def _combine(out_sorted, order, topk_weight, tp_axes):
    """Unsort ``[M, De]`` assignment outputs, weight and sum over k in float32, psum over TP."""
    n, k = topk_weight.shape
    out = jnp.take(out_sorted, _inverse(order), axis=0).reshape(n, k, -1)  # [N, k, De]
    y = jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), topk_weight.astype(jnp.float32))
    return jax.lax.psum(y, _name(tp_axes)) if tp_axes else y


def _vary(x, axes):
    """Mark ``x`` varying over ``axes`` (its cotangent is then psum-ed over them). Explicit:
    leaving it to JAX 0.12's implicit insertion gave a wrong z-gradient (ratios 0.2-2.8) on the
    replicated path, while the values were right."""
    return jax.lax.pcast(x, _name(axes), to="varying") if axes else x


def _count(dropped, tok_axes):
    dropped = jnp.sum(dropped, dtype=jnp.int32)
    return jax.lax.psum(dropped, _name(tok_axes)) if tok_axes else dropped


def _sorted_by_owner(z, topk_idx, e_loc, ep):
    """Assignments sorted by owner, and within an owner round-robin over its experts (each
    expert's first assignment, then each one's second, ...: by the rank within the expert,
    then the local id): order [M], owner [M], local id [M], counts and starts [ep], and whether
    each is dispatched at all [M]. A capacity that keeps an owner's first rows then shares it
    max-min fairly among its experts; sorted by expert id, a hot expert took it all and the
    experts after it on the device lost every assignment. An expert id of ``E`` (= ep x
    e_loc: padding under a capacity factor, ``MoE._routed``) sorts last and is counted
    nowhere."""
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    m, n_e = flat.shape[0], ep * e_loc
    by_e = jnp.argsort(flat, stable=True)                               # [M] by expert
    per_e = jnp.zeros((n_e + 1,), jnp.int32).at[flat].add(1)            # [E + 1]
    first = jnp.cumsum(per_e) - per_e
    rank_e = jnp.zeros((m,), jnp.int32).at[by_e].set(
        jnp.arange(m, dtype=jnp.int32) - jnp.take(first, jnp.take(flat, by_e)))
    owner_of = jnp.where(flat < n_e, flat // e_loc, ep)                 # padding: last
    order = jnp.lexsort((flat % e_loc, rank_e, owner_of))               # [M]
    e_sorted = jnp.take(flat, order)
    real = e_sorted < ep * e_loc                                        # [M]
    owner, local = jnp.minimum(e_sorted // e_loc, ep - 1), e_sorted % e_loc
    counts = jnp.zeros((ep,), jnp.int32).at[owner].add(real.astype(jnp.int32))  # [ep]
    starts = jnp.cumsum(counts) - counts
    rows = jnp.take(z, order // k, axis=0)                              # [M, De]
    return order, owner, local, counts, starts, rows, real


def _padded_body(z, topk_idx, topk_weight, w1, w3, w2, *, config, ep_axes, tp_axes, tok_axes,
                 factor):
    e_loc, de = w1.shape[0], z.shape[1]
    ep, m = jax.lax.axis_size(_name(ep_axes)), topk_idx.size
    z, topk_weight = _vary(z, tp_axes), _vary(topk_weight, tp_axes)
    order, owner, local, _, starts, rows, real = _sorted_by_owner(z, topk_idx, e_loc, ep)
    cap = capacity(m, ep, factor)
    rank = jnp.arange(m, dtype=jnp.int32) - jnp.take(starts, owner)    # [M] within its owner
    keep = real & (rank < cap)
    slot = jnp.where(keep, owner * cap + rank, ep * cap)                # ep*cap = dropped
    send = jnp.zeros((ep * cap, de), z.dtype).at[slot].set(rows, mode="drop")
    send_ids = jnp.full((ep * cap,), e_loc, jnp.int32).at[slot].set(local, mode="drop")
    a2a = functools.partial(jax.lax.all_to_all, axis_name=_name(ep_axes), split_axis=0,
                            concat_axis=0, tiled=True)
    out = _local_experts(a2a(send), a2a(send_ids), w1, w3, w2, config)  # [ep*cap, De]
    back = a2a(out)                                                     # my slots, answered
    res = jnp.where(keep[:, None], jnp.take(back, jnp.minimum(slot, ep * cap - 1), axis=0), 0)
    y = _combine(res, order, topk_weight, tp_axes)
    return y.astype(z.dtype), _count(real & ~keep, tok_axes)


def ragged_exchange_plan(counts_all: jax.Array, me: jax.Array, rows: int):
    """Offsets for ``ragged_all_to_all`` from the ``[ep(src), ep(dst)]`` count matrix.

    A receiver whose ``rows``-row buffer cannot hold every sender's rows shares it max-min
    fairly (:func:`fair_shares`): no device's tokens are dropped first because of where it sits
    on the mesh. Senders' rows lie in the buffer in source order. Returns, for device ``me``:
    ``send [ep]`` (rows it sends to each destination), ``out_off [ep]`` (where they land there),
    ``recv [ep]`` (rows it receives from each source) and ``recv_off [ep]`` (where those sit in
    its buffer). Pure; tested against a NumPy emulation of the collective.
    """
    fits = fair_shares(counts_all, rows)                               # [src, dst] accepted
    at = jnp.cumsum(fits, axis=0) - fits                               # after lower sources
    return fits[me], at[me], fits[:, me], at[:, me]


def fair_shares(counts: jax.Array, rows: int) -> jax.Array:
    """Max-min fair shares ``[src, dst]`` of each destination's ``rows`` among the sources'
    ``counts [src, dst]``: everything when it fits; else every source gets ``min(count, L)``
    for the largest level ``L`` that fits, and the rows left (fewer than the sources above
    ``L``) go one each to the lowest-numbered sources above it. Each column sums to
    ``min(rows, total)``."""
    ep = counts.shape[0]
    c = jnp.sort(counts, axis=0)                                       # ascending per column
    below = jnp.cumsum(c, axis=0) - c                                  # rows of smaller ones
    left = jnp.arange(ep, 0, -1, dtype=counts.dtype)[:, None]          # sources from i on
    over = c * left + below > rows                                     # level c_i overflows
    first = jnp.argmax(over, axis=0)                                   # [dst] first such i
    level = jnp.where(jnp.any(over, axis=0),
                      (rows - jnp.take_along_axis(below, first[None], 0)[0])
                      // jnp.take_along_axis(left, first[None], 0)[0],
                      jnp.max(counts, axis=0))                         # [dst]
    share = jnp.minimum(counts, level)
    spare = jnp.maximum(rows - jnp.sum(share, axis=0), 0)              # < sources above level
    above = counts > level
    extra = above & (jnp.cumsum(above, axis=0) <= spare)               # one each, in order
    return share + extra.astype(counts.dtype)


def _ragged_body(z, topk_idx, topk_weight, w1, w3, w2, *, config, ep_axes, tp_axes, tok_axes,
                 factor, emulate=False):
    e_loc, de = w1.shape[0], z.shape[1]
    axis = _name(ep_axes)
    z, topk_weight = _vary(z, tp_axes), _vary(topk_weight, tp_axes)
    ep, m = jax.lax.axis_size(axis), topk_idx.size
    me = jax.lax.axis_index(axis)
    order, owner, local, counts, starts, rows, real = _sorted_by_owner(z, topk_idx, e_loc, ep)
    r = receive_rows(m, ep, factor)
    counts_all = jax.lax.all_gather(counts, axis, to="invarying")      # [ep, ep]
    starts_all = jnp.cumsum(counts_all, axis=1) - counts_all           # senders' own offsets
    send, out_off, recv, recv_off = ragged_exchange_plan(counts_all, me, r)
    rank = jnp.arange(m, dtype=jnp.int32) - jnp.take(starts, owner)
    keep = real & (rank < jnp.take(send, owner))
    a2a = _ragged_emulated if emulate else _ragged_all_to_all
    got = a2a(rows, jnp.zeros((r, de), z.dtype), starts, send, out_off, recv, axis)
    got_ids = a2a(local[:, None], jnp.full((r, 1), e_loc, jnp.int32), starts, send, out_off,
                  recv, axis)[:, 0]
    out = _local_experts(got, got_ids, w1, w3, w2, config)             # [R, De]
    back = a2a(out, jnp.zeros((m, de), z.dtype), recv_off, recv, starts_all[:, me], send, axis)
    res = jnp.where(keep[:, None], back, 0)
    y = _combine(res, order, topk_weight, tp_axes)
    return y.astype(z.dtype), _count(real & ~keep, tok_axes)


def _ragged_all_to_all(operand, output, in_off, send, out_off, recv, axis):
    """``jax.lax.ragged_all_to_all`` with its result typed as varying like ``operand``. JAX
    types the result like the ``output`` buffer, and a buffer of zeros varies over no mesh
    axis: the received rows, different on every device, were typed the same on all of them,
    and autodiff then summed their cotangents over the expert axes (the backward's
    ``psum_invariant`` over ``expert``): wrong gradients for every token. Only the real
    collective types so (the CPU emulation builds its result from the device index)."""
    (operand, output), _ = vary_alike(operand, output)
    return jax.lax.ragged_all_to_all(operand, output, in_off, send, out_off, recv,
                                     axis_name=axis)


def _ragged_emulated(operand, output, in_off, send, out_off, recv, axis):
    """``ragged_all_to_all`` semantics from an all-gather (CPU tests only; ep x the traffic).

    Rows from source s land at ``out_off_s[me]``; a row counts only if it is within both the
    sender's ``send`` and this receiver's ``recv`` for the pair, so inconsistent plans fail."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, to="invarying")
    ops, offs, sizes, dests = gather(operand), gather(in_off), gather(send), gather(out_off)
    me = jax.lax.axis_index(axis)
    rows_in, rows_out = operand.shape[0], output.shape[0]
    idx = jnp.arange(rows_in, dtype=jnp.int32)
    for s in range(ops.shape[0]):
        n = jnp.minimum(sizes[s, me], recv[s])
        src = jnp.take(ops[s], jnp.clip(offs[s, me] + idx, 0, rows_in - 1), axis=0)
        dst = jnp.where(idx < n, dests[s, me] + idx, rows_out)
        output = output.at[dst].set(src, mode="drop")
    return output


def _replicated_body(z, topk_idx, topk_weight, w1, w3, w2, *, config, ep_axes, tp_axes,
                     tok_axes, factor):
    """Tokens replicated over the expert axes: own experts on all tokens, psum the outputs."""
    del factor
    e_loc = w1.shape[0]
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)                                         # [M]
    me = jax.lax.axis_index(_name(ep_axes)) if ep_axes else 0
    local = flat - me * e_loc
    ids = jnp.where((local >= 0) & (local < e_loc), local, e_loc)
    z, topk_weight = _vary(z, ep_axes + tp_axes), _vary(topk_weight, ep_axes + tp_axes)
    rows = jnp.repeat(z, k, axis=0)                                     # [M, De]
    out = _local_experts(rows, ids, w1, w3, w2, config)
    order = jnp.arange(flat.shape[0])
    y = _combine(out, order, topk_weight, ())
    axes = ep_axes + tp_axes
    y = jax.lax.psum(y, _name(axes)) if axes else y
    return y.astype(z.dtype), jnp.zeros((), jnp.int32)


_BODIES = {
    "padded": _padded_body,
    "ragged": _ragged_body,
    "ragged_emulated": functools.partial(_ragged_body, emulate=True),
    "replicated": _replicated_body,
}
