"""Pallas MXFP4 x {bf16, f32} matmuls, dense and grouped (MoE), dequantising per tile.

Re-layout (``prepare_mxfp4_weights``, once per weight, e.g. at load time): the Hugging Face
``blocks [(E,) N, K/32, 16]`` are transposed to packed bytes ``[(E,) K/2, N]`` and the scales to
``[(E,) K/32, N]``, zero-padded to the tile grid (zero bytes with scale code 0 contribute exactly
0) and viewed as int8. Output features N are the minor (lane / coalesced) axis, so a weight tile is
``[block_k/2, block_n]`` bytes and its scales ``[block_k/32, block_n]``; each scale row is
broadcast over its 16 byte rows (a reshape of leading dims, Mosaic- and Triton-friendly).

Kernel: byte row j of block g holds element 32g + 2j in the low nibble and 32g + 2j + 1 in the
high nibble, so instead of interleaving nibbles in-kernel the activations are split once into
even and odd columns ``x_even, x_odd [M, K/2]`` (x-sized, cheap) and

    y = x_even @ decode(low nibbles) + x_odd @ decode(high nibbles)

with ``decode = decode.mxfp4_f32_bits`` (integer bit arithmetic, exact, no table) cast
to x's dtype (exact for bf16). Each program owns one ``[block_m, block_n]`` output tile and loops
over K in-kernel (``fori_loop``) with a float32 accumulator, so the full dequantised weight never
exists in HBM and no grid axis has to run sequentially (Triton programs run in parallel).

Grouped (MoE) variant: rows sorted by expert; on the host side of the kernel (plain XLA on
``group_sizes``) every group is padded to whole row tiles, giving a tile -> expert map, a
tile-valid flag and row gather/scatter indices; static tile count ``cdiv(M, bm) + min(E, M)``.
Two ways to pick the expert's weights:

* ``"gather"`` (GPU Triton, CPU): the weight ref spans all experts and the kernel indexes it with
  the expert id read from the map (pointer arithmetic on GPU); tiles past the last group skip.
* ``"prefetch"`` (TPU Mosaic): the map is scalar-prefetched (``pltpu.PrefetchScalarGridSpec``)
  and the weight BlockSpec's index_map selects the expert's tile, as megablox does; grid (N, tile)
  so consecutive tiles of one expert reuse the weight tile in VMEM.

Accuracy: float32 accumulation; results equal ``ref.py`` bit for bit whenever every partial sum is
exact (integer-like data, tested for all 16 codes and extreme scales), else to ~1e-7 relative
(summation order differs: per K tile, low then high nibbles).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.mxfp4_matmul.ref import (check_activation, check_group_sizes,
                                                  check_weight)
from kdsa.kernels_pallas.mxfp4_matmul.decode import BLOCK, mxfp4_f32_bits

_HALF = BLOCK // 2


# ----------------------------------------------------------------------------- weights

@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scales"],
                   meta_fields=["k", "n", "block_n", "block_k"])
@dataclasses.dataclass(frozen=True)
class MXFP4Weights:
    """Kernel layout: ``packed`` int8 ``[(E,) Kp/2, Np]``, ``scales`` int8 ``[(E,) Kp/32, Np]``
    (raw E8M0 bytes), padded to multiples of ``block_k`` / ``block_n``; true sizes ``k``, ``n``."""
    packed: jax.Array
    scales: jax.Array
    k: int
    n: int
    block_n: int
    block_k: int


def _pick(size: int, default: int, minimum: int, pow2: bool) -> int:
    want = common.next_pow2(size) if pow2 else common.round_up(size, minimum)
    return max(minimum, min(default, want))


def _check_pow2(platform: str, **sizes: int) -> None:
    if common.needs_pow2(platform):
        for name, v in sizes.items():
            if v & (v - 1):
                raise ValueError(f"{name} = {v} must be a power of two on {platform} (Triton)")


def prepare_mxfp4_weights(blocks: jax.Array, scales: jax.Array, *,
                          block_sizes: common.BlockSizes | None = None,
                          platform: str | None = None) -> MXFP4Weights:
    """HF ``blocks [(E,) N, K/32, 16]``, ``scales [(E,) N, K/32]`` -> :class:`MXFP4Weights`.

    ``platform`` ("cpu" | "gpu" | "tpu", default: the current backend) picks default tiles;
    ``block_sizes`` overrides them (its ``block_m`` is ignored here)."""
    platform = platform or common.backend()
    if blocks.ndim not in (3, 4):
        raise ValueError(f"prepare_mxfp4_weights: blocks must be [N, K/32, 16] or "
                         f"[E, N, K/32, 16], got {tuple(blocks.shape)}")
    lead = check_weight(blocks, scales, blocks.ndim - 1, "prepare_mxfp4_weights")
    n, k = lead[-2], lead[-1]
    dflt, low = common.default_block_sizes(platform), common.minimum_block_sizes(platform)
    pow2 = common.needs_pow2(platform)
    bn = block_sizes.block_n if block_sizes else _pick(n, dflt.block_n, low.block_n, pow2)
    bk = block_sizes.block_k if block_sizes else _pick(k, dflt.block_k, low.block_k, pow2)
    _check_pow2(platform, block_n=bn, block_k=bk)
    np_, kp = common.round_up(n, bn), common.round_up(k, bk)
    g = k // BLOCK
    packed = jnp.swapaxes(blocks.reshape(*blocks.shape[:-3], n, g * _HALF), -1, -2)  # [.,K/2,N]
    sc = jnp.swapaxes(scales, -1, -2)                                               # [.,K/32,N]
    pad = [(0, 0)] * (blocks.ndim - 3)
    packed = jnp.pad(packed, [*pad, (0, (kp - k) // 2), (0, np_ - n)])
    sc = jnp.pad(sc, [*pad, (0, (kp - k) // BLOCK), (0, np_ - n)])
    as_i8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int8)
    return MXFP4Weights(as_i8(packed), as_i8(sc), k=k, n=n, block_n=bn, block_k=bk)


# ----------------------------------------------------------------------------- kernel body

def _decode(codes: jax.Array, scale_codes: jax.Array, dtype) -> jax.Array:
    bits = mxfp4_f32_bits(codes, scale_codes)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _accumulate(xe_ref, xo_ref, w_ref, s_ref, expert, *, block_k: int, kp: int):
    """float32 ``[bm, bn]`` = sum over K tiles of x_even @ low + x_odd @ high (one expert)."""
    bm, bn = xe_ref.shape[0], w_ref.shape[-1]
    bk2, bk32 = block_k // 2, block_k // BLOCK
    lead = () if expert is None else (expert,)
    precision = jax.lax.Precision.HIGHEST if xe_ref.dtype == jnp.float32 else None

    def step(t, acc):
        r0 = pl.multiple_of(t * bk2, bk2)
        g0 = pl.multiple_of(t * bk32, bk32)
        xe = xe_ref[:, pl.ds(r0, bk2)]                                        # [bm, bk2]
        xo = xo_ref[:, pl.ds(r0, bk2)]                                        # [bm, bk2]
        b = w_ref[(*lead, pl.ds(r0, bk2), slice(None))].astype(jnp.int32)     # [bk2, bn]
        s = s_ref[(*lead, pl.ds(g0, bk32), slice(None))].astype(jnp.int32) & 0xFF  # [bk32, bn]
        s = jnp.broadcast_to(s[:, None, :], (bk32, _HALF, bn)).reshape(bk2, bn)   # [bk2, bn]
        lo = _decode(b & 0xF, s, xe.dtype)                                    # [bk2, bn]
        hi = _decode((b >> 4) & 0xF, s, xe.dtype)                             # [bk2, bn]
        acc = acc + jnp.dot(xe, lo, precision=precision, preferred_element_type=jnp.float32)
        return acc + jnp.dot(xo, hi, precision=precision, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, kp // block_k, step, jnp.zeros((bm, bn), jnp.float32))


def _dense_kernel(xe_ref, xo_ref, w_ref, s_ref, o_ref, *, block_k, kp):
    o_ref[...] = _accumulate(xe_ref, xo_ref, w_ref, s_ref, None, block_k=block_k, kp=kp)


def _gather_kernel(te_ref, tv_ref, xe_ref, xo_ref, w_ref, s_ref, o_ref, *, block_k, kp):
    @pl.when(tv_ref[0] != 0)
    def _():
        o_ref[...] = _accumulate(xe_ref, xo_ref, w_ref, s_ref, te_ref[0], block_k=block_k,
                                 kp=kp)


def _prefetch_kernel(te_ref, tv_ref, xe_ref, xo_ref, w_ref, s_ref, o_ref, *, block_k, kp):
    del te_ref  # used by the index maps

    @pl.when(tv_ref[pl.program_id(1)] != 0)
    def _():
        o_ref[...] = _accumulate(xe_ref, xo_ref, w_ref, s_ref, None, block_k=block_k, kp=kp)


# ----------------------------------------------------------------------------- wrappers

def _split_even_odd(x: jax.Array, rows: int, kp: int) -> tuple[jax.Array, jax.Array]:
    """``x [M, K]`` -> even and odd columns, zero-padded to ``[rows, Kp/2]`` each."""
    m, k = x.shape
    pairs = jnp.pad(x, ((0, rows - m), (0, kp - k))).reshape(rows, kp // 2, 2)
    return pairs[..., 0], pairs[..., 1]


def _block_m(m: int, block_m: int | None, platform: str) -> int:
    dflt, low = common.default_block_sizes(platform), common.minimum_block_sizes(platform)
    bm = block_m or max(low.block_m, min(dflt.block_m, common.next_pow2(m)))
    _check_pow2(platform, block_m=bm)
    return bm


def _check_prepared(x, w: MXFP4Weights, ndim: int, name: str) -> None:
    if not isinstance(w, MXFP4Weights) or w.packed.ndim != ndim:
        raise ValueError(f"{name}: expected MXFP4Weights with {ndim}-d packed bytes from "
                         f"prepare_mxfp4_weights, got {type(w).__name__}")
    check_activation(x, w.k, name)


def mxfp4_matmul_prepared(x: jax.Array, w: MXFP4Weights, *, interpret: bool | None = None,
                          block_m: int | None = None, platform: str | None = None) -> jax.Array:
    """``y[..., N] = x[..., K] @ dequant(W)^T``, float32, W from :func:`prepare_mxfp4_weights`."""
    _check_prepared(x, w, 2, "mxfp4_matmul")
    platform = platform or common.backend()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)                                                   # [M, K]
    m = x2.shape[0]
    if m == 0:
        return jnp.zeros((*lead, w.n), jnp.float32)
    kp, np_ = w.packed.shape[0] * 2, w.packed.shape[1]
    bm = _block_m(m, block_m, platform)
    mp = common.round_up(m, bm)
    xe, xo = _split_even_odd(x2, mp, kp)                                      # [Mp, Kp/2] x2
    y = pl.pallas_call(
        functools.partial(_dense_kernel, block_k=w.block_k, kp=kp),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // w.block_n),
        in_specs=[pl.BlockSpec((bm, kp // 2), lambda i, j: (i, 0)),
                  pl.BlockSpec((bm, kp // 2), lambda i, j: (i, 0)),
                  pl.BlockSpec((kp // 2, w.block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((kp // BLOCK, w.block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, w.block_n), lambda i, j: (i, j)),
        interpret=common.resolve_interpret(interpret),
        name="mxfp4_matmul",
    )(xe, xo, w.packed, w.scales)
    return y[:m, :w.n].reshape(*lead, w.n)


def group_tiles(group_sizes: jax.Array, m: int, block_m: int, num_tiles: int):
    """Pad every group to whole row tiles. Returns ``(tile_expert [T], tile_valid [T],
    src [T*bm] (row of x feeding each padded row; m = a zero row), dest [M] (padded row of each
    x row), row_valid [M])``. Tiles past the last group repeat the last expert (no weight
    re-fetch) and are marked invalid; rows past sum(group_sizes) are invalid."""
    e = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)  # [E]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])         # [E]
    sizes = ends - starts
    tiles = (sizes + block_m - 1) // block_m                                  # [E]
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_valid = t < tile_end[-1]
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), e - 1)  # [T]
    last = expert[jnp.maximum(tile_end[-1] - 1, 0)]
    tile_expert = jnp.where(tile_valid, expert, last).astype(jnp.int32)
    r = jnp.arange(num_tiles * block_m, dtype=jnp.int32)                      # padded rows
    re_ = tile_expert[r // block_m]
    j = r - tile_start[re_] * block_m
    ok = tile_valid[r // block_m] & (j < sizes[re_])
    src = jnp.where(ok, starts[re_] + j, m)
    i = jnp.arange(m, dtype=jnp.int32)
    ie = jnp.minimum(jnp.searchsorted(ends, i, side="right"), e - 1)          # [M]
    dest = tile_start[ie] * block_m + i - starts[ie]
    row_valid = i < ends[-1]
    return tile_expert, tile_valid.astype(jnp.int32), src, jnp.where(row_valid, dest, 0), row_valid


def mxfp4_grouped_matmul_prepared(x_sorted: jax.Array, w: MXFP4Weights, group_sizes: jax.Array,
                                  *, interpret: bool | None = None, block_m: int | None = None,
                                  mode: str | None = None,
                                  platform: str | None = None) -> jax.Array:
    """``[M, N]`` float32: row r of group e times expert e's weight (``ragged_dot`` semantics;
    rows past ``sum(group_sizes)`` give 0). ``mode``: "gather" | "prefetch" (default: prefetch on
    TPU, gather elsewhere)."""
    _check_prepared(x_sorted, w, 3, "mxfp4_grouped_matmul")
    if x_sorted.ndim != 2:
        raise ValueError(f"mxfp4_grouped_matmul: x_sorted must be [M, K], got "
                         f"{tuple(x_sorted.shape)}")
    platform = platform or common.backend()
    mode = mode or ("prefetch" if platform == "tpu" else "gather")
    if mode not in ("gather", "prefetch"):
        raise ValueError(f"mode must be 'gather' or 'prefetch', got {mode!r}")
    e, kp2, np_ = w.packed.shape
    kp = kp2 * 2
    m = x_sorted.shape[0]
    check_group_sizes(group_sizes, e, m, "mxfp4_grouped_matmul")
    if m == 0:
        return jnp.zeros((0, w.n), jnp.float32)
    bm = _block_m(max(1, m // e), block_m, platform)
    num_tiles = -(-m // bm) + min(e, m)
    tile_expert, tile_valid, src, dest, row_valid = group_tiles(group_sizes, m, bm, num_tiles)
    x_pad = jnp.concatenate([x_sorted, jnp.zeros((1, w.k), x_sorted.dtype)])[src]  # [T*bm, K]
    xe, xo = _split_even_odd(x_pad, num_tiles * bm, kp)                       # [T*bm, Kp/2] x2
    kernel_args = dict(block_k=w.block_k, kp=kp)
    grid = (np_ // w.block_n, num_tiles)
    # (inside an expert-parallel shard_map the operands vary over different mesh axes)
    (tile_expert, tile_valid, xe, xo, packed, scales), vma = common.vary_alike(
        tile_expert, tile_valid, xe, xo, w.packed, w.scales)
    out_shape = jax.ShapeDtypeStruct((num_tiles * bm, np_), jnp.float32, manual_axis_type=vma)
    if mode == "gather":
        y = pl.pallas_call(
            functools.partial(_gather_kernel, **kernel_args),
            out_shape=out_shape, grid=grid,
            in_specs=[pl.BlockSpec((1,), lambda j, t: (t,)),
                      pl.BlockSpec((1,), lambda j, t: (t,)),
                      pl.BlockSpec((bm, kp2), lambda j, t: (t, 0)),
                      pl.BlockSpec((bm, kp2), lambda j, t: (t, 0)),
                      pl.BlockSpec((e, kp2, w.block_n), lambda j, t: (0, 0, j)),
                      pl.BlockSpec((e, kp // BLOCK, w.block_n), lambda j, t: (0, 0, j))],
            out_specs=pl.BlockSpec((bm, w.block_n), lambda j, t: (t, j)),
            interpret=common.resolve_interpret(interpret), name="mxfp4_grouped_matmul",
        )(tile_expert, tile_valid, xe, xo, packed, scales)
    else:
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid,
            in_specs=[pl.BlockSpec((bm, kp2), lambda j, t, te, tv: (t, 0)),
                      pl.BlockSpec((bm, kp2), lambda j, t, te, tv: (t, 0)),
                      pl.BlockSpec((None, kp2, w.block_n), lambda j, t, te, tv: (te[t], 0, j)),
                      pl.BlockSpec((None, kp // BLOCK, w.block_n),
                                   lambda j, t, te, tv: (te[t], 0, j))],
            out_specs=pl.BlockSpec((bm, w.block_n), lambda j, t, te, tv: (t, j)))
        y = pl.pallas_call(
            functools.partial(_prefetch_kernel, **kernel_args),
            out_shape=out_shape, grid_spec=grid_spec,
            interpret=common.resolve_interpret(interpret), name="mxfp4_grouped_matmul",
        )(tile_expert, tile_valid, xe, xo, packed, scales)
    return jnp.where(row_valid[:, None], y[dest, :w.n], 0.0)


def mxfp4_matmul(x: jax.Array, blocks: jax.Array, scales: jax.Array, *,
                 interpret: bool | None = None,
                 block_sizes: common.BlockSizes | None = None) -> jax.Array:
    """Same signature as ``mxfp4_matmul_ref``; re-lays the weight on every call (serving code
    should call :func:`prepare_mxfp4_weights` once and use :func:`mxfp4_matmul_prepared`)."""
    check_weight(blocks, scales, 2, "mxfp4_matmul")
    w = prepare_mxfp4_weights(blocks, scales, block_sizes=block_sizes)
    return mxfp4_matmul_prepared(x, w, interpret=interpret,
                                 block_m=block_sizes.block_m if block_sizes else None)


def mxfp4_grouped_matmul(x_sorted: jax.Array, blocks: jax.Array, scales: jax.Array,
                         group_sizes: jax.Array, *, interpret: bool | None = None,
                         block_sizes: common.BlockSizes | None = None) -> jax.Array:
    """Same signature as ``mxfp4_grouped_matmul_ref``; re-lays the weight on every call."""
    check_weight(blocks, scales, 3, "mxfp4_grouped_matmul")
    w = prepare_mxfp4_weights(blocks, scales, block_sizes=block_sizes)
    return mxfp4_grouped_matmul_prepared(x_sorted, w, group_sizes, interpret=interpret,
                                         block_m=block_sizes.block_m if block_sizes else None)
