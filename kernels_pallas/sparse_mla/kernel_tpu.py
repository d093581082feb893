"""Pallas TPU (Mosaic) sparse top-k MLA attention: forward and backward kernels.

Same problem, padded layout (``kernel.to_layout``) and outputs as the Triton kernels in
``kernel.py``, so ``ops.py``'s ``custom_vjp`` (dQ in the kernel, dKV scatter-added in XLA) serves
both; only the gather differs. A Mosaic kernel cannot index a ref with a vector of row ids (the
Triton kernel's ``ka_ref[rows, :]``), so the selected key rows are **copied by DMA**:

* the key parts stay in HBM, where the caller keeps them (``memory_space=pltpu.HBM`` and
  ``pltpu.with_memory_space_constraint(.., HBM)``: without the constraint XLA may copy a cache
  that fits into VMEM before each call); the query's index row ``[Kp]`` is an SMEM block (scalar
  reads give the DMA addresses) and also a VMEM block (the tile's validity mask);
* grid ``(B, T, Hp / bh, Kp / bk)``, the last axis walks the slot tiles in order ("arbitrary"),
  the others are "parallel". At slot tile ``j`` the kernel starts ``bk`` one-row DMAs per key
  part for tile ``j + 1`` into the other half of a double buffer ``[2, bk, D]`` (one DMA
  semaphore per half and key part; a single wait on the whole half counts all ``bk`` rows, as
  jax's ``paged_attention`` waits for its pages), then waits for tile ``j`` and computes on it.
  Tile 0 of each program is started and waited at ``j = 0`` (not hidden behind the previous
  program).
* **the row DMA** (what Mosaic accepts, measured with libtpu 0.0.52 for v5e, v5p and v6e; TPU
  HBM arrays are stored in ``(8, 128)`` tiles, row-major within a tile): a 32-bit row
  ``k_hbm.at[b, pl.ds(r, 1)]`` at any offset compiles (a row is a run of whole words, one 512 B
  granule per 128 lanes), into any row of a ``[bk, D]`` VMEM buffer. A 16-bit row does not: bf16
  tiles ``(8, 128)(2, 1)`` pack rows ``2k`` and ``2k + 1`` into the two halves of one 32-bit word,
  so a single row is half of every word ("Offsets along tiled dimensions must be aligned to
  tiles"). 16-bit parts are therefore read through ``k_hbm.bitcast(uint32)`` (a view, ``[B, S/2,
  D]`` in ``(4, 128)`` tiles: the same bytes), one word row ``r // 2`` per selected row (the pair
  holding it: 2x the row's bytes, the minimum for this layout), into a ``uint32 [bk, D]``
  buffer; after the wait each row is unpacked in registers from the high or low half of its
  words (``r`` odd or even), exactly (a bf16 is the top half of its float32).
* invalid slots (-1 padding, indices outside ``[0, S)``) copy row 0; their rows are zeroed
  after the gather (unused rows of a pool may hold anything, and ``0 * NaN`` would leak into
  ``p @ V`` and the gradients) and their scores are -inf.
* forward: online softmax in float32 scratch ``(m, l [bh, 128], acc [bh, Da])`` carried over the
  slot axis, written at the last tile; a query with no valid slot writes out 0 and lse -inf.
* backward: ``dq`` accumulates in its output block across the slot axis; each tile writes its
  per-slot key/value cotangent rows ``[bk, D]`` (``ds^T q + p^T dO``) as an output block.

What was measured instead and rejected (``bench/aot.py``, docs/kernels.md "TPU compile"): rows
on a leading dimension (a ``[S, 1, D]`` operand) compile, but XLA re-lays the whole cache into
``T(2, 128)`` tiles (twice its size) before every call; whole aligned 8-row tiles per selected
row compile and need no copy but read 8x the bytes. The key parts must reach the kernel
row-major (``major_to_minor = (0, 1, 2)``): XLA's default layout for a bf16 ``[B, S, 64]``
array (the RoPE key) is S-minor, and then XLA copies it before each call; a decode step keeps
the cache in :func:`cache_layout` to avoid that.

Patterns from jax's ``pallas/ops/tpu/paged_attention`` (multi-row async copies on one semaphore,
waited once) and ``flash_attention`` (``(rows, 128)`` softmax statistics, explicit ``.T`` before
a matmul); tokamax's TPU ``sparse_mla`` instead gathers rows in a separate SparseCore kernel
(``csa_gather``). Tested on CPU in interpret mode (the generic interpreter, f32 and bf16; the
TPU simulator ``pltpu.InterpretParams``, f32 only: it has no ref bitcast), compiled for TPU by
libtpu on a CPU host (``tests/test_tpu_compile.py``, ``bench/aot.py``); never run on a TPU.

Tile rules (checked in :func:`check_tiles`, sizes chosen in ``kernel.plan``): heads per program
``bh`` a multiple of the sublane tile, 8 rows for f32 and 16 for bf16 (or all padded heads); slot
tile ``bk`` a multiple of it too (the index row arrives as ``(1, bk)`` blocks, the gathered rows
fill whole ``[bk, D]`` tiles); defaults 128 and 128 (MXU-sized score tiles). Key widths are not
padded (the HBM cache is never copied; a Triton plan pads them to powers of two); 16-bit parts
with an odd ``S`` get one zero row (a copy: keep ``S`` even). float16 raises
``NotImplementedError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas.common import DIMS_NT, dot_f32, sublanes

f32 = jnp.float32
_NT = DIMS_NT
_LANES = 128
_dot = dot_f32


def check_tiles(bh: int, bk: int, hp: int, dtype) -> None:
    """ValueError / NotImplementedError for what this kernel cannot tile (see module doc)."""
    if jnp.dtype(dtype) not in (jnp.dtype(f32), jnp.dtype(jnp.bfloat16)):
        raise NotImplementedError(f"sparse_mla_attention TPU kernel: dtype {jnp.dtype(dtype)} "
                                  "not supported (float32 or bfloat16)")
    sub = sublanes(dtype)
    if bh % sub and bh != hp:
        raise ValueError(f"sparse_mla_attention TPU kernel: block_h = {bh} must be a multiple of "
                         f"{sub} for {jnp.dtype(dtype)} (or cover all {hp} padded heads)")
    if bk % sub:
        raise ValueError(f"sparse_mla_attention TPU kernel: block_k = {bk} must be a multiple of "
                         f"{sub} for {jnp.dtype(dtype)}")


def cache_layout(ndim: int = 3):
    """The layout a caller should keep the key caches in (row-major, ``(8, 128)`` tiles): pass
    ``jax.experimental.layout.Format(cache_layout(), sharding)`` as the cache arguments' (and
    results') format of a jitted decode step. XLA's default for a bf16 ``[B, S, 64]`` array is
    S-minor, which the kernel's row DMAs cannot read, so XLA would copy it before every call."""
    from jax.experimental.layout import Layout

    return Layout(major_to_minor=tuple(range(ndim)))


def interpret_params(interpret):
    """``pallas_call``'s ``interpret`` for this kernel: ``False`` (compile with Mosaic),
    ``True`` (the generic interpreter: DMAs become plain copies; fast, what most CPU tests use)
    or a ``pltpu.InterpretParams`` (the TPU simulator: HBM/VMEM/SMEM buffers, DMAs executed on
    wait, semaphores counted, out-of-bounds accesses caught; ~10x slower)."""
    return interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)


# ----------------------------------------------------------------------------- gather

def packed(dtype) -> bool:
    """16-bit keys: HBM packs row pairs into 32-bit words (``T(8,128)(2,1)``), gathered as pairs."""
    return jnp.dtype(dtype).itemsize == 2


def _sources(hbm, dtype):
    """DMA views of the key parts ``[B, S, D]``: as they are (32-bit: a row is a run of words,
    any row offset compiles), or 16-bit parts as ``uint32 [B, S / 2, D]`` (word ``[k, d]`` holds
    rows ``2k`` (low half) and ``2k + 1`` (high half) of column ``d``; a bitcast of the ref, not
    a copy)."""
    return [h.bitcast(jnp.uint32) for h in hbm] if packed(dtype) else list(hbm)


def _start(idx_smem, srcs, bufs, sems, b, j, slot, p):
    """Start the one-row DMAs of slot tile ``j`` (every key part) into buffer half ``slot``: row
    ``r`` (32-bit keys) or the word row ``r // 2`` holding it (16-bit keys)."""
    shift = 1 if bufs[0].dtype == jnp.uint32 else 0

    def row(i, carry):
        r = idx_smem[0, j * p.bk + i]
        r = jnp.where((r >= 0) & (r < p.s), r, 0)                              # invalid: row 0
        r = jax.lax.shift_right_logical(r, shift)
        for part in range(len(srcs)):
            pltpu.make_async_copy(srcs[part].at[b, pl.ds(r, 1)],
                                  bufs[part].at[slot, pl.ds(i, 1)],
                                  sems.at[part, slot]).start()
        return carry
    jax.lax.fori_loop(0, p.bk, row, 0)


def _wait(bufs, sems, slot):
    """One wait per key part for the whole half (its semaphore counts all ``bk`` rows)."""
    for part, buf in enumerate(bufs):
        pltpu.make_async_copy(buf.at[slot], buf.at[slot], sems.at[part, slot]).wait()


def _column(row):
    """``[1, n]`` -> ``[n, 1]`` (a 2-D transpose of 8 sublane copies: the Mosaic-friendly form)."""
    return jnp.broadcast_to(row, (8, row.shape[1])).T[:, :1]


def _unpack(words, odd, dtype):
    """``uint32 [bk, D]`` row pairs -> the selected rows ``[bk, D]`` in ``dtype``: the high half
    where ``odd [bk, 1]``, else the low half (a 16-bit float is the top half of its float32, so
    the shift or mask is exact)."""
    hi = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), f32)
    lo = jax.lax.bitcast_convert_type(jax.lax.shift_left(words, jnp.uint32(16)), f32)
    return jnp.where(odd, hi, lo).astype(dtype)


def _tile(idx_smem, idx_vmem, hbm, bufs, sems, p, dtype):
    """Double-buffered gather of this step's tile: ``(valid [1, bk], rows per part [bk, D])``.
    Rows of invalid slots are zeros (they fetch row 0, or rows 0 and 1 for 16-bit keys; garbage
    there, e.g. an unused pool row, must not turn a zero probability into NaN)."""
    b, j, nk = pl.program_id(0), pl.program_id(3), pl.num_programs(3)
    slot = j % 2
    srcs = _sources(hbm, dtype)

    @pl.when(j == 0)
    def _():
        _start(idx_smem, srcs, bufs, sems, b, 0, 0, p)

    @pl.when(j + 1 < nk)
    def _():
        _start(idx_smem, srcs, bufs, sems, b, j + 1, 1 - slot, p)

    _wait(bufs, sems, slot)
    ids = idx_vmem[...]                                                        # [1, bk]
    valid = (ids >= 0) & (ids < p.s)
    col = _column(jnp.where(valid, ids, -1))                                   # [bk, 1]
    live = col >= 0
    if packed(dtype):
        odd = (col & 1) == 1
        rows = [_unpack(buf[slot], odd, dtype) for buf in bufs]
    else:
        rows = [buf[slot] for buf in bufs]
    return valid, [jnp.where(live, r, jnp.zeros_like(r)) for r in rows]


def _scores(qs, rows, scale):
    s = _dot(qs[0], rows[0], _NT)                                              # [bh, bk]
    for q, r in zip(qs[1:], rows[1:]):
        s = s + _dot(q, r, _NT)
    return s * scale


# ----------------------------------------------------------------------------- kernels

def _fwd_kernel(idx_smem, idx_vmem, *refs, p, scale):
    n = 2 if p.two_parts else 1
    q_refs, hbm, (o_ref, lse_ref) = refs[:n], refs[n:2 * n], refs[2 * n:2 * n + 2]
    bufs, (sems, m_ref, l_ref, acc_ref) = refs[2 * n + 2:3 * n + 2], refs[3 * n + 2:]
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, f32)
        l_ref[...] = jnp.zeros(l_ref.shape, f32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

    valid, rows = _tile(idx_smem, idx_vmem, hbm, bufs, sems, p, hbm[0].dtype)
    s = jnp.where(valid, _scores([r[...] for r in q_refs], rows, scale), -jnp.inf)  # [bh, bk]
    m_prev = m_ref[...]                                                        # [bh, 128]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))             # [bh, 128]
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)                           # all masked so far
    alpha = jnp.exp(m_prev - shift)                                            # [bh, 128]
    e = jnp.exp(s - shift[:, :1])                                              # masked -> 0
    l_ref[...] = l_ref[...] * alpha + jnp.sum(e, axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + _dot(e.astype(rows[0].dtype), rows[0])
    m_ref[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        l = l_ref[...][:, :1]                                                  # [bh, 1]
        live = l > 0
        l_safe = jnp.where(live, l, 1.0)
        o_ref[...] = acc_ref[...] / l_safe
        lse_ref[...] = jnp.where(live, m_ref[...][:, :1] + jnp.log(l_safe), -jnp.inf)


def _bwd_kernel(idx_smem, idx_vmem, *refs, p, scale):
    n = 2 if p.two_parts else 1
    q_refs, hbm = refs[:n], refs[n:2 * n]
    do_ref, lse_ref, delta_ref = refs[2 * n:2 * n + 3]
    outs = refs[2 * n + 3:4 * n + 3]                                           # dqa, dka(, ...)
    dq_refs, dk_refs = outs[0::2], outs[1::2]
    bufs, sems = refs[4 * n + 3:5 * n + 3], refs[5 * n + 3]
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _():
        for r in dq_refs:
            r[...] = jnp.zeros(r.shape, f32)

    valid, rows = _tile(idx_smem, idx_vmem, hbm, bufs, sems, p, hbm[0].dtype)
    qs = [r[...] for r in q_refs]
    do = do_ref[...]                                                           # [bh, Da] f32
    lse = lse_ref[...]                                                         # [bh, 1]
    live = lse > -jnp.inf
    prob = jnp.where(valid & live, jnp.exp(_scores(qs, rows, scale)
                                           - jnp.where(live, lse, 0.0)), 0.0)  # [bh, bk]
    dp = _dot(do, rows[0].astype(f32), _NT)                                    # [bh, bk]
    ds = prob * (dp - delta_ref[...]) * scale                                  # d logits * scale
    ds_t = ds.T                                                                # [bk, bh]
    for part in range(n):
        dq_refs[part][...] += _dot(ds, rows[part].astype(f32))                 # [bh, D]
        dk = _dot(ds_t, qs[part].astype(f32))                                  # [bk, D]
        if part == 0:
            dk = dk + _dot(prob.T, do)
        dk_refs[part][...] = dk


# ----------------------------------------------------------------------------- pallas calls

def _common_specs(p, widths):
    """(idx SMEM row, idx VMEM row, q parts, key parts in HBM) for grid (b, t, h, j)."""
    idx_s = pl.BlockSpec((None, None, 1, p.kp), lambda b, t, h, j: (b, t, 0, 0),
                         memory_space=pltpu.SMEM)
    idx_v = pl.BlockSpec((None, None, None, 1, p.bk), lambda b, t, h, j: (b, t, j, 0, 0))
    q = [pl.BlockSpec((None, None, p.bh, d), lambda b, t, h, j: (b, t, h, 0)) for d in widths]
    hbm = [pl.BlockSpec(memory_space=pltpu.HBM) for _ in widths]
    return [idx_s, idx_v] + q + hbm


def _tiled(idx, p):
    """``[B, T, Kp]`` -> ``[B, T, Kp / bk, 1, bk]``: one ``(1, bk)`` VMEM block per slot tile."""
    return idx.reshape(*idx.shape[:2], p.kp // p.bk, 1, p.bk)


def _scratch(p, widths, dtype):
    """Per key part a double buffer ``[2, bk, D]`` of gathered rows (16-bit keys: of their
    ``uint32`` row pairs) and the DMA semaphores ``[parts, 2]``."""
    word = jnp.uint32 if packed(dtype) else dtype
    return ([pltpu.VMEM((2, p.bk, d), word) for d in widths]
            + [pltpu.SemaphoreType.DMA((len(widths), 2))])


def _check_interpret(interpret, dtype):
    if isinstance(interpret, pltpu.InterpretParams) and packed(dtype):
        raise NotImplementedError(
            "sparse_mla_attention TPU kernel: 16-bit keys are gathered through a uint32 view of "
            "the HBM ref, which JAX's TPU simulator (pltpu.InterpretParams) does not implement; "
            "use interpret=True or float32 keys")


def _hbm_parts(ks, p):
    """The key parts pinned to HBM (else XLA may copy a cache that fits into VMEM before the
    call); 16-bit parts with an odd row count first get one zero row (a copy of the parts: the
    ``uint32`` row-pair view needs ``S`` even; keep ``S`` even to avoid it)."""
    if packed(ks[0].dtype) and p.s % 2:
        ks = [jnp.pad(k, ((0, 0), (0, 1), (0, 0))) for k in ks]
    return [pltpu.with_memory_space_constraint(k, pltpu.HBM) for k in ks]


def _params():
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _out(shape, like):
    return jax.ShapeDtypeStruct(shape, f32, manual_axis_type=jax.typeof(like).mat)


def sparse_mla_fwd(qa, qb, ka, kb, idx, *, p, scale: float, interpret):
    """Padded layout in -> ``out [B, T, Hp, Da]`` f32, ``lse [B, T, Hp]`` f32."""
    b, t = qa.shape[:2]
    widths = (p.da, p.db) if p.two_parts else (p.da,)
    qs, ks = ([qa, qb], [ka, kb]) if p.two_parts else ([qa], [ka])
    check_tiles(p.bh, p.bk, p.hp, ka.dtype)
    _check_interpret(interpret, ka.dtype)
    ks = _hbm_parts(ks, p)
    row = pl.BlockSpec((None, None, p.bh, p.da), lambda b, t, h, j: (b, t, h, 0))
    col = pl.BlockSpec((None, None, p.bh, 1), lambda b, t, h, j: (b, t, h, 0))
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, p=p, scale=scale),
        out_shape=(_out((b, t, p.hp, p.da), qa), _out((b, t, p.hp, 1), qa)),
        grid=(b, t, p.hp // p.bh, p.kp // p.bk),
        in_specs=_common_specs(p, widths), out_specs=(row, col),
        scratch_shapes=_scratch(p, widths, ka.dtype) + [
            pltpu.VMEM((p.bh, _LANES), f32), pltpu.VMEM((p.bh, _LANES), f32),
            pltpu.VMEM((p.bh, p.da), f32)],
        compiler_params=_params(), interpret=interpret_params(interpret),
        name="sparse_mla_fwd_tpu",
    )(idx[:, :, None], _tiled(idx, p), *qs, *ks)
    return out, lse[..., 0]


def sparse_mla_bwd(qa, qb, ka, kb, idx, do, lse, delta, *, p, scale: float, interpret):
    """Same contract as ``kernel.sparse_mla_bwd``: ``dqa [B, T, Hp, Da]``, per-slot rows
    ``dka [B, T, Hb, Kp, Da]`` (and ``dqb``, ``dkb``), float32."""
    b, t = qa.shape[:2]
    hb = p.hp // p.bh
    widths = (p.da, p.db) if p.two_parts else (p.da,)
    qs, ks = ([qa, qb], [ka, kb]) if p.two_parts else ([qa], [ka])
    check_tiles(p.bh, p.bk, p.hp, ka.dtype)
    _check_interpret(interpret, ka.dtype)
    ks = _hbm_parts(ks, p)
    row = lambda d: pl.BlockSpec((None, None, p.bh, d),  # noqa: E731
                                 lambda b, t, h, j: (b, t, h, 0))
    col = pl.BlockSpec((None, None, p.bh, 1), lambda b, t, h, j: (b, t, h, 0))
    slots = lambda d: pl.BlockSpec((None, None, None, p.bk, d),  # noqa: E731
                                   lambda b, t, h, j: (b, t, h, j, 0))
    outs, out_specs = [], []
    for d in widths:
        outs += [_out((b, t, p.hp, d), qa), _out((b, t, hb, p.kp, d), qa)]
        out_specs += [row(d), slots(d)]
    grads = pl.pallas_call(
        functools.partial(_bwd_kernel, p=p, scale=scale),
        out_shape=tuple(outs), grid=(b, t, hb, p.kp // p.bk),
        in_specs=_common_specs(p, widths) + [row(p.da), col, col],
        out_specs=tuple(out_specs), scratch_shapes=_scratch(p, widths, ka.dtype),
        compiler_params=_params(), interpret=interpret_params(interpret),
        name="sparse_mla_bwd_tpu",
    )(idx[:, :, None], _tiled(idx, p), *qs, *ks, do, lse[..., None], delta[..., None])
    return tuple(grads)
