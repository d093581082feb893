"""Pallas sparse top-k MLA attention (absorbed / MQA form): forward and backward kernels.

Problem (``kdsa.model.dsa.sparse_mla_attention``, ``dsa.md`` 3): query ``t`` of row ``b`` attends
to the K latent rows ``kv[b, idx[b, t, :]]``; all N heads share those rows (MLA's absorbed form),
so the heads are the matmul M dimension and one gathered tile serves every head (FlashMLA /
tilelang ``sparse_mla_fwd`` design).

Layout (:func:`plan` and :func:`to_layout`, done once per call by the wrapper in ``ops.py``):

* key parts ``ka [B, S, Da]`` (the values: its first ``v_dim`` columns) and ``kb [B, S, Db]``
  (the rest of the key, e.g. the RoPE key; absent when ``v_dim = Dk``); queries split the same way
  ``qa [B, T, Hp, Da]``, ``qb [B, T, Hp, Db]``. The layer's cache already keeps latent (512) and
  RoPE key (64) apart, so for K3 both parts are used as they are; other splits are made by one
  concatenate + slice (a copy of kv).
* widths padded with zeros to powers of two >= 16 (Triton tiles are powers of two and ``tl.dot``
  wants K >= 16; zero columns change no dot product), heads to ``Hp`` (a multiple of the head
  block ``bh``, >= 16), the K slots to ``Kp`` (a multiple of the slot tile ``bk``) with -1.
  That is the Triton plan; the Mosaic plan pads only heads and slots (``_plan_tpu``).

Grid ``(B, T, Hp / bh)``: one program per (row, query, head block), the same grid for prefill
(T queries) and decode (T = 1, many heads). Each program walks its ``Kp / bk`` slot tiles
(``fori_loop``): the tile's indices are read from the query's index row (a BlockSpec block, so
Triton reads them like any other input; no scalar prefetch needed), the selected rows are gathered
with an integer-array index on the key ref (``ka_ref[rows, :]``, pointer arithmetic on GPU, a
gather in interpret mode), scores ``[bh, bk]`` are one matmul per part, and an online softmax in
float32 keeps ``(max, sum, acc [bh, Da])``. Slots outside ``[0, S)`` (-1 padding) score -inf; a
query with no valid slot ends with sum 0 and writes out 0, lse -inf. Duplicate indices are
separate slots and count twice, as in the reference and FlashMLA.

Backward (same grid): with ``p = exp(s - lse)`` recomputed from the saved lse,
``dp = dO v^T``, ``ds = p (dp - delta)``, ``delta = rowsum(dO * O) - dlse``:
``dq = scale ds K`` accumulates in the program (the gather side), and each slot tile writes its
key/value cotangent rows ``scale ds^T q + p^T dO`` (summed over the block's heads) to
``[B, T, Hb, Kp, D]``; ``ops.py`` sums the head blocks and scatter-adds the rows into dKV in XLA
(see there for why).

Accuracy (f32, interpret mode): see ``ops.py`` and ``tests/test_sparse_mla_kernel.py``.
Backends: CPU (``interpret=True``) and GPU (Pallas Triton; the lowering is tested on CPU through
``jax.export`` for CUDA). Mosaic (TPU) has no per-row gather from a ref, so TPU runs
``kernel_tpu.py`` (rows copied by DMA) on the same layout; :func:`plan` picks either's tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.sparse_mla import kernel_tpu

f32 = jnp.float32
_NT, _NN = common.DIMS_NT, common.DIMS_NN
_TN = (((0,), (0,)), ((), ()))  # a [K, M] x b [K, N] -> [M, N]
_dot = common.dot_f32

# GPU (Triton): tl.dot needs every dim >= 16; FlashMLA runs 64 heads x 64 rows per step.
# CPU (interpret): the same minimums, so tests see the GPU's padded shapes.
_DEFAULT_BLOCK_H, _DEFAULT_BLOCK_K, _MIN_TILE = 64, 64, 16


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static sizes of one call: true ``s, h, k, v_dim, d_b``; padded ``hp, kp, da, db``; tiles
    ``bh`` (heads per program) and ``bk`` (slots per step); ``backend`` "triton" (this file) or
    "mosaic" (``kernel_tpu.py``); Triton ``num_warps`` / ``num_stages`` (8 warps: a 64 x 512
    float32 accumulator is 128 registers per thread; untuned, no GPU was available when this was
    written; ``bench/gpu_check.py`` sweeps them)."""
    s: int
    h: int
    k: int
    v_dim: int
    d_b: int
    hp: int
    kp: int
    da: int
    db: int
    bh: int
    bk: int
    num_warps: int = 8
    num_stages: int = 2
    backend: str = "triton"

    @property
    def two_parts(self) -> bool:
        return self.d_b > 0


BACKENDS = ("triton", "mosaic")

# TPU (Mosaic): up to 128 heads per program (the MXU's M), slot tiles of 128 (one lane row of
# scores and of the index row); fewer slots than that run as one tile.
_TPU_BLOCK_H, _TPU_BLOCK_K = 128, 128


def _width(d: int) -> int:
    return max(_MIN_TILE, common.next_pow2(d))


def plan(s: int, h: int, k: int, v_dim: int, d_b: int, *, block_h: int | None = None,
         block_k: int | None = None, num_warps: int = 8, num_stages: int = 2,
         backend: str = "triton", dtype=jnp.float32) -> Plan:
    """Pad and tile sizes for ``S`` keys, ``N = h`` heads, ``K = k`` slots and widths
    ``v_dim`` (part a) / ``d_b`` (part b) on ``backend``; ``dtype`` of the keys (TPU tiles)."""
    if backend == "mosaic":
        return _plan_tpu(s, h, k, v_dim, d_b, block_h, block_k, dtype)
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, v in (("block_h", block_h), ("block_k", block_k)):
        if v is not None and (v < 1 or v & (v - 1)):
            raise ValueError(f"{name} = {v} must be a power of two")
    bh = block_h or min(_DEFAULT_BLOCK_H, max(_MIN_TILE, common.next_pow2(h)))
    bk = block_k or min(_DEFAULT_BLOCK_K, max(_MIN_TILE, common.next_pow2(k)))
    return Plan(s=s, h=h, k=k, v_dim=v_dim, d_b=d_b, hp=common.round_up(h, bh),
                kp=max(bk, common.round_up(k, bk)), da=_width(v_dim),
                db=_width(d_b) if d_b else 0, bh=bh, bk=bk, num_warps=num_warps,
                num_stages=num_stages)


def _plan_tpu(s, h, k, v_dim, d_b, block_h, block_k, dtype) -> Plan:
    """Mosaic plan: heads padded to the sublane tile (8 f32 / 16 bf16) and to ``bh``, slots to
    ``bk``, key widths unpadded (``kernel_tpu.check_tiles`` says what is allowed)."""
    sub = common.sublanes(dtype) if jnp.dtype(dtype).itemsize in (2, 4) else 8
    for name, v in (("block_h", block_h), ("block_k", block_k)):
        if v is not None and v < 1:
            raise ValueError(f"{name} = {v} must be positive")
    bh = block_h or min(_TPU_BLOCK_H, common.round_up(h, sub))
    bk = block_k or min(_TPU_BLOCK_K, max(sub, common.round_up(k, sub)))
    hp, kp = common.round_up(h, bh), max(bk, common.round_up(k, bk))
    kernel_tpu.check_tiles(bh, bk, hp, dtype)
    return Plan(s=s, h=h, k=k, v_dim=v_dim, d_b=d_b, hp=hp, kp=kp, da=v_dim, db=d_b, bh=bh,
                bk=bk, backend="mosaic")


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def to_layout(q: jax.Array, ka: jax.Array, kb: jax.Array | None, indices: jax.Array, p: Plan):
    """q ``[B, T, N, Dk]``, key parts ``[B, S, v_dim]`` / ``[B, S, Dk - v_dim]``, indices
    ``[B, T, K]`` -> padded ``(qa, qb, ka, kb, idx)`` (``qb``, ``kb`` None for one part)."""
    q = jnp.pad(q, [(0, 0), (0, 0), (0, p.hp - p.h), (0, 0)])
    qa = _pad_last(q[..., :p.v_dim], p.da)                                   # [B, T, Hp, Da]
    qb = _pad_last(q[..., p.v_dim:], p.db) if p.two_parts else None          # [B, T, Hp, Db]
    ka = _pad_last(ka, p.da)                                                 # [B, S, Da]
    kb = _pad_last(kb, p.db) if p.two_parts else None                        # [B, S, Db]
    idx = jnp.pad(indices.astype(jnp.int32), [(0, 0), (0, 0), (0, p.kp - p.k)],
                  constant_values=-1)                                        # [B, T, Kp]
    return qa, qb, ka, kb, idx


# ----------------------------------------------------------------------------- kernel bodies

def _tile(idx_ref, ka_ref, kb_ref, j, p: Plan):
    """Slot tile ``j``: validity ``[bk]``, start, gathered rows ``[bk, Da]`` (and ``[bk, Db]``)."""
    k0 = pl.multiple_of(j * p.bk, p.bk)
    ids = idx_ref[pl.ds(k0, p.bk)]                                           # [bk] int32
    valid = (ids >= 0) & (ids < p.s)
    rows = jnp.where(valid, ids, 0)
    # unused slots read row 0 and are zeroed: its values (another token's, or an unwritten pool
    # row's) would reach the output through their zero weight if not finite (0 x NaN)
    ra = jnp.where(valid[:, None], ka_ref[rows, :], 0)                       # [bk, Da]
    rb = jnp.where(valid[:, None], kb_ref[rows, :], 0) if kb_ref is not None else None
    return valid, k0, ra, rb


def _scores(qa, qb, ra, rb, scale):
    s = _dot(qa, ra, _NT)                                                    # [bh, bk]
    if qb is not None:
        s = s + _dot(qb, rb, _NT)
    return s * scale


def _fwd_kernel(idx_ref, qa_ref, ka_ref, *refs, p: Plan, scale: float):
    qb_ref, kb_ref, o_ref, lse_ref = refs if p.two_parts else (None, None, *refs)
    qa = qa_ref[...]                                                         # [bh, Da]
    qb = qb_ref[...] if p.two_parts else None                                # [bh, Db]

    def step(j, carry):
        m, l, acc = carry                                                    # [bh] [bh] [bh,Da]
        valid, _, ra, rb = _tile(idx_ref, ka_ref, kb_ref, j, p)
        s = jnp.where(valid[None, :], _scores(qa, qb, ra, rb, scale), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)                     # all masked so far
        alpha = jnp.exp(m - shift)
        e = jnp.exp(s - shift[:, None])                                      # masked -> 0
        l = l * alpha + jnp.sum(e, axis=1)
        acc = acc * alpha[:, None] + _dot(e.astype(ra.dtype), ra, _NN)
        return m_new, l, acc

    init = (jnp.full((p.bh,), -jnp.inf, f32), jnp.zeros((p.bh,), f32),
            jnp.zeros((p.bh, p.da), f32))
    m, l, acc = jax.lax.fori_loop(0, p.kp // p.bk, step, init)
    live = l > 0
    l_safe = jnp.where(live, l, 1.0)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(live, m + jnp.log(l_safe), -jnp.inf)


def _bwd_kernel(idx_ref, qa_ref, ka_ref, *refs, p: Plan, scale: float):
    if p.two_parts:
        qb_ref, kb_ref, do_ref, lse_ref, delta_ref, dqa_ref, dka_ref, dqb_ref, dkb_ref = refs
    else:
        do_ref, lse_ref, delta_ref, dqa_ref, dka_ref = refs
        qb_ref = kb_ref = dqb_ref = dkb_ref = None
    qa = qa_ref[...]                                                         # [bh, Da]
    qb = qb_ref[...] if p.two_parts else None                                # [bh, Db]
    do = do_ref[...]                                                         # [bh, Da] f32
    lse = lse_ref[...]                                                       # [bh]
    live = lse > -jnp.inf
    lse_safe = jnp.where(live, lse, 0.0)
    delta = delta_ref[...]                                                   # [bh]

    def step(j, carry):
        dqa, dqb = carry
        valid, k0, ra, rb = _tile(idx_ref, ka_ref, kb_ref, j, p)
        s = _scores(qa, qb, ra, rb, scale)                                   # [bh, bk]
        prob = jnp.where(valid[None, :] & live[:, None], jnp.exp(s - lse_safe[:, None]), 0.0)
        dp = _dot(do, ra.astype(f32), _NT)                                   # [bh, bk]
        ds = prob * (dp - delta[:, None]) * scale                            # d logits * scale
        dqa = dqa + _dot(ds, ra.astype(f32), _NN)
        dka_ref[pl.ds(k0, p.bk), :] = (_dot(ds, qa.astype(f32), _TN)
                                       + _dot(prob, do, _TN))                # [bk, Da]
        if p.two_parts:
            dqb = dqb + _dot(ds, rb.astype(f32), _NN)
            dkb_ref[pl.ds(k0, p.bk), :] = _dot(ds, qb.astype(f32), _TN)     # [bk, Db]
        return dqa, dqb

    init = (jnp.zeros((p.bh, p.da), f32), jnp.zeros((p.bh, p.db or 1), f32))
    dqa, dqb = jax.lax.fori_loop(0, p.kp // p.bk, step, init)
    dqa_ref[...] = dqa
    if p.two_parts:
        dqb_ref[...] = dqb


# ----------------------------------------------------------------------------- pallas calls

def _specs(p: Plan, two: bool, widths: tuple[int, ...]):
    """BlockSpecs of (idx, qa, ka[, qb, kb]) for the grid (b, t, h)."""
    idx = pl.BlockSpec((None, None, p.kp), lambda b, t, h: (b, t, 0))
    q = lambda d: pl.BlockSpec((None, None, p.bh, d), lambda b, t, h: (b, t, h, 0))  # noqa: E731
    kv = lambda d: pl.BlockSpec((None, p.s, d), lambda b, t, h: (b, 0, 0))  # noqa: E731
    specs = [idx, q(widths[0]), kv(widths[0])]
    if two:
        specs += [q(widths[1]), kv(widths[1])]
    return specs


def _out(shape, like) -> jax.ShapeDtypeStruct:
    """float32 output struct varying over the same manual mesh axes as ``like`` (the queries),
    so the kernel can run inside ``shard_map`` with ``check_vma`` (sequence parallelism)."""
    return jax.ShapeDtypeStruct(shape, f32, manual_axis_type=jax.typeof(like).mat)


def _triton_params(p: Plan):
    return plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages)


def _check_platform(interpret: bool) -> None:
    if not interpret and common.backend() == "tpu":
        raise NotImplementedError("sparse_mla_attention: the Triton kernel does not run on TPU "
                                  "(it gathers rows with pointer arithmetic); use "
                                  "backend='mosaic' (kernel_tpu.py, the default there)")


def sparse_mla_fwd(qa, qb, ka, kb, idx, *, p: Plan, scale: float, interpret: bool):
    """Padded layout in -> ``out [B, T, Hp, Da]`` f32, ``lse [B, T, Hp]`` f32."""
    _check_platform(interpret)
    b, t = qa.shape[:2]
    args = [idx, qa, ka] + ([qb, kb] if p.two_parts else [])
    return pl.pallas_call(
        functools.partial(_fwd_kernel, p=p, scale=scale),
        out_shape=(_out((b, t, p.hp, p.da), qa), _out((b, t, p.hp), qa)),
        grid=(b, t, p.hp // p.bh),
        in_specs=_specs(p, p.two_parts, (p.da, p.db)),
        out_specs=(pl.BlockSpec((None, None, p.bh, p.da), lambda b, t, h: (b, t, h, 0)),
                   pl.BlockSpec((None, None, p.bh), lambda b, t, h: (b, t, h))),
        compiler_params=_triton_params(p), interpret=interpret, name="sparse_mla_fwd",
    )(*args)


def sparse_mla_bwd(qa, qb, ka, kb, idx, do, lse, delta, *, p: Plan, scale: float,
                   interpret: bool):
    """Cotangents: ``dqa [B, T, Hp, Da]``, per-slot rows ``dka [B, T, Hb, Kp, Da]`` and, with two
    parts, ``dqb``, ``dkb``; all float32. do ``[B, T, Hp, Da]``, lse / delta ``[B, T, Hp]``."""
    _check_platform(interpret)
    b, t = qa.shape[:2]
    hb = p.hp // p.bh
    args = [idx, qa, ka] + ([qb, kb] if p.two_parts else []) + [do, lse, delta]
    row = lambda d: pl.BlockSpec((None, None, p.bh, d), lambda b, t, h: (b, t, h, 0))  # noqa
    vec = pl.BlockSpec((None, None, p.bh), lambda b, t, h: (b, t, h))
    slots = lambda d: pl.BlockSpec((None, None, None, p.kp, d),  # noqa: E731
                                   lambda b, t, h: (b, t, h, 0, 0))
    outs = [_out((b, t, p.hp, p.da), qa), _out((b, t, hb, p.kp, p.da), qa)]
    out_specs = [row(p.da), slots(p.da)]
    if p.two_parts:
        outs += [_out((b, t, p.hp, p.db), qa), _out((b, t, hb, p.kp, p.db), qa)]
        out_specs += [row(p.db), slots(p.db)]
    return pl.pallas_call(
        functools.partial(_bwd_kernel, p=p, scale=scale),
        out_shape=tuple(outs), grid=(b, t, hb),
        in_specs=_specs(p, p.two_parts, (p.da, p.db)) + [row(p.da), vec, vec],
        out_specs=tuple(out_specs),
        compiler_params=_triton_params(p), interpret=interpret, name="sparse_mla_bwd",
    )(*args)
