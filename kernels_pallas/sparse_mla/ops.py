"""Public sparse MLA attention op: choose Pallas or XLA, own the gradient.

``sparse_mla_attention(q, kv, indices, sm_scale, v_dim)`` has the signature and semantics of the
reference ``kdsa.model.dsa.sparse_mla_attention`` (absorbed MQA form; slots outside ``[0, S)``
skipped; duplicates count twice; a query with no valid slot gives out 0 and lse -inf) and takes
``kv`` either whole ``[B, S, Dk]`` or as parts ``([B, S, Dc], [B, S, Dr])``. With parts whose
first width is ``v_dim`` (the layer's latent and RoPE key) the parts go to the kernel as they are;
any other form is concatenated once and split at ``v_dim`` (values, rest of the key).

``impl="pallas"`` (default) runs the Pallas kernels (interpret mode on CPU): ``backend="triton"``
(``kernel.py``, GPU; the CPU default) or ``"mosaic"`` (``kernel_tpu.py``, TPU; rows gathered by
DMA). Both take the same padded layout (``kernel.plan`` / ``to_layout``, tiles per backend) and
return the same arrays, so one ``custom_vjp`` serves both. ``impl="xla"`` runs the reference.
The Pallas path is differentiable through ``jax.custom_vjp``:

* forward: the kernel; out and lse (``[B, T, Hp]``, tiny) are the residuals.
* backward: the backward kernel gives dQ (each program gathers its query's rows again and
  accumulates ``scale ds K``) and per-slot key/value cotangent rows, which XLA sums over head
  blocks and **scatter-adds** into dKV (``.at[b, idx].add``, slots outside ``[0, S)`` dropped,
  duplicates accumulate). Why XLA and not an in-kernel atomic add (tilelang's choice): Pallas
  Triton has ``atomic_add`` but its interpret-mode discharge is a gather/set (duplicate indices
  would lose updates, so CPU tests could not check it) and TPU has no atomics; XLA's scatter-add
  handles duplicates on every backend (float atomics on GPU, so the same traffic class and the
  same nondeterministic summation order) at the price of writing the rows ``[B, C, Hb, Kp, Dk]``
  to HBM once. Queries run in chunks of ``chunk_size`` (an XLA
  scan carrying dKV), so the rows never exceed one chunk.

Measured (f32, CPU interpret, ``tests/test_sparse_mla_kernel.py``: B 2, T 13, N 4, S 50,
Dk 40 = 32 + 8, v_dim 32, K 16 with -1 / out-of-range slots, duplicates and an all-invalid row;
slot tiles of 8, head blocks of 2, backward in 4 query chunks) against the reference: max abs
error out 7.2e-7, lse 9.5e-7, dq 1.7e-6, dlatent 2.2e-6, drope 1.4e-6 (gradients up to 4.8).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.sparse_mla import kernel, kernel_tpu
from kdsa.kernels_pallas.sparse_mla.ref import check_inputs, sparse_mla_attention_ref

IMPLS = ("pallas", "xla")
f32 = jnp.float32


def split_values(parts: tuple[jax.Array, ...], v_dim: int):
    """Key parts -> ``(ka [B, S, v_dim], kb [B, S, Dk - v_dim] | None)`` (values first)."""
    if parts[0].shape[-1] == v_dim and len(parts) <= 2:
        return parts[0], (parts[1] if len(parts) == 2 else None)
    whole = parts[0] if len(parts) == 1 else jnp.concatenate(
        [p.astype(jnp.result_type(*parts)) for p in parts], axis=-1)         # copy of kv
    rest = whole[..., v_dim:]
    return whole[..., :v_dim], (rest if rest.shape[-1] else None)


# ----------------------------------------------------------------------------- gradient

def _kernels(p: kernel.Plan):
    """(forward, backward) pallas calls of the plan's backend; same layout and outputs."""
    if p.backend == "mosaic":
        return kernel_tpu.sparse_mla_fwd, kernel_tpu.sparse_mla_bwd
    return kernel.sparse_mla_fwd, kernel.sparse_mla_bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attend(qa, qb, ka, kb, idx, p, scale, interpret, chunk):
    return _kernels(p)[0](qa, qb, ka, kb, idx, p=p, scale=scale, interpret=interpret)


def _attend_fwd(qa, qb, ka, kb, idx, p, scale, interpret, chunk):
    out, lse = _attend(qa, qb, ka, kb, idx, p, scale, interpret, chunk)
    return (out, lse), (qa, qb, ka, kb, idx, out, lse)


def _scatter_rows(acc: jax.Array, idx: jax.Array, rows: jax.Array, s: int) -> jax.Array:
    """``acc [B, S, D] += rows [B, C, Hb, Kp, D]`` summed over head blocks, at ``idx [B, C, Kp]``
    (slots outside ``[0, S)`` dropped; duplicate indices accumulate)."""
    b = acc.shape[0]
    target = jnp.where((idx >= 0) & (idx < s), idx, s)
    batch = jnp.broadcast_to(jnp.arange(b)[:, None, None], idx.shape)
    return acc.at[batch, target].add(jnp.sum(rows, axis=2), mode="drop")


def _attend_bwd(p, scale, interpret, chunk, res, cot):
    qa, qb, ka, kb, idx, out, lse = res
    dout, dlse = cot
    delta = jnp.sum(dout * out, axis=-1) - dlse                              # [B, T, Hp]
    b, t = qa.shape[:2]
    c = min(chunk, t)
    n = -(-t // c)

    def split(a):  # [B, T, ...] -> [n, B, c, ...] (padded queries: idx -1, dout 0)
        fill = -1 if a.dtype == jnp.int32 else 0
        a = jnp.pad(a, [(0, 0), (0, n * c - t)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 1, 0)

    per_query = (qa, qb, idx, dout, lse, delta)
    xs = tuple(None if a is None else split(a) for a in per_query)

    def chunk_grads(x, acc=None):
        """One query chunk: its dq parts and dKV with its rows scatter-added (into ``acc``)."""
        qa_c, qb_c, idx_c, do_c, lse_c, delta_c = x
        grads = _kernels(p)[1](qa_c, qb_c, ka, kb, idx_c, do_c, lse_c, delta_c, p=p,
                                      scale=scale, interpret=interpret)
        dka, dkb = acc or (jnp.zeros(ka.shape, f32), None if kb is None else
                           jnp.zeros(kb.shape, f32))
        dka = _scatter_rows(dka, idx_c, grads[1], p.s)
        if not p.two_parts:
            return (dka, None), (grads[0], None)
        return (dka, _scatter_rows(dkb, idx_c, grads[3], p.s)), (grads[0], grads[2])

    # the first chunk outside the scan: its dKV starts the carry with the right varying mesh
    # axes inside shard_map (a fresh zeros carry would not vary like the outputs)
    (dka, dkb), first = chunk_grads(tuple(None if a is None else a[0] for a in xs))
    if n == 1:
        dqa, dqb = (None if a is None else a[None] for a in first)
    else:
        rest = tuple(None if a is None else a[1:] for a in xs)
        (dka, dkb), (dqa, dqb) = jax.lax.scan(lambda acc, x: chunk_grads(x, acc), (dka, dkb),
                                              rest)
        dqa = jnp.concatenate([first[0][None], dqa])
        dqb = None if dqb is None else jnp.concatenate([first[1][None], dqb])

    def join(a, like):  # [n, B, c, ...] -> [B, T, ...] in the primal dtype
        if a is None:
            return None
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape((b, n * c) + a.shape[3:])[:, :t].astype(like.dtype)

    cast = lambda g, like: None if g is None else g.astype(like.dtype)  # noqa: E731
    return join(dqa, qa), join(dqb, qb), cast(dka, ka), cast(dkb, kb), None


_attend.defvjp(_attend_fwd, _attend_bwd)


# ----------------------------------------------------------------------------- public op

def default_backend() -> str:
    """Kernel family for the current JAX backend: "mosaic" on TPU, "triton" elsewhere (GPU; CPU
    runs either in interpret mode, Triton by default)."""
    return "mosaic" if common.backend() == "tpu" else "triton"


def sparse_mla_attention(q: jax.Array, kv, indices: jax.Array, sm_scale: float, v_dim: int, *,
                         chunk_size: int = 256, impl: str = "pallas",
                         interpret: bool | None = None, block_h: int | None = None,
                         block_k: int | None = None, num_warps: int = 8,
                         num_stages: int = 2,
                         backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Sparse top-k MLA attention: out ``[B, T, N, v_dim]`` float32, lse ``[B, T, N]``.

    q ``[B, T, N, Dk]`` absorbed queries, kv ``[B, S, Dk]`` or parts ``([B, S, Dc], [B, S, Dr])``
    (``kv[..., :v_dim]`` are the values), indices ``[B, T, K]`` int (slots outside ``[0, S)``
    unused). ``chunk_size``: queries per step of the backward pass (Pallas) or of the reference.
    ``backend``: "triton" (``kernel.py``; GPU, the CPU default) or "mosaic" (``kernel_tpu.py``;
    the TPU default). ``block_h`` / ``block_k``: heads per program and slots per step. Triton:
    powers of two, defaults ``min(64, next_pow2(N))`` and ``min(64, next_pow2(K))``, at least
    16. Mosaic: multiples of 8 (f32) / 16 (bf16), defaults ``min(128, N)`` and ``min(128, K)``
    rounded up to that. ``num_warps`` / ``num_stages``: Triton launch parameters (GPU only).
    ``interpret``: None (interpret on CPU only), a bool, or for "mosaic" a
    ``pltpu.InterpretParams()`` (the TPU simulator, see ``kernel_tpu.interpret_params``).
    """
    if impl == "xla":
        return sparse_mla_attention_ref(q, kv, indices, sm_scale, v_dim, chunk_size=chunk_size)
    if impl != "pallas":
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    parts = check_inputs(q, kv, indices, v_dim)
    b, t, h, dk = q.shape
    s, k = parts[0].shape[1], indices.shape[2]
    if t == 0 or h == 0 or s == 0:  # nothing to attend to: out 0, lse -inf (as the reference)
        return jnp.zeros((b, t, h, v_dim), f32), jnp.full((b, t, h), -jnp.inf, f32)
    ka, kb = split_values(parts, v_dim)
    dtype = jnp.result_type(q, *parts)
    backend = backend or default_backend()
    if isinstance(interpret, pltpu.InterpretParams) and backend != "mosaic":
        raise ValueError("interpret=pltpu.InterpretParams() (the TPU simulator) needs "
                         "backend='mosaic'")
    p = kernel.plan(s, h, k, v_dim, dk - v_dim, block_h=block_h, block_k=block_k,
                    num_warps=num_warps, num_stages=num_stages, backend=backend, dtype=dtype)
    qa, qb, ka, kb, idx = kernel.to_layout(q.astype(dtype), ka.astype(dtype),
                                           None if kb is None else kb.astype(dtype), indices, p)
    if not isinstance(interpret, pltpu.InterpretParams):
        interpret = common.resolve_interpret(interpret)
    out, lse = _attend(qa, qb, ka, kb, idx, p, float(sm_scale), interpret, int(chunk_size))
    return out[:, :, :h, :v_dim], lse[:, :, :h]
