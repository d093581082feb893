"""Gated DSA layer: MLA + lightning indexer + top-k sparse attention + sigmoid output gate.

``GatedDSA`` holds the parameters (named as in the Hugging Face checkpoint, ``kimi_k3.md`` 2 and
``dsa.md`` 1.3) and calls the pure maths in ``kdsa.model.dsa`` and ``kdsa.model.rope``:

* query: ``c_q = q_a_layernorm(q_a_proj(x))``, ``q = q_b_proj(c_q)`` (or ``q_proj(x)`` without
  ``q_lora_rank``), per head ``[nope ; rope]``; KV: ``kv_a_proj_with_mqa(x) = [c_kv ; k_pe]``,
  ``c_kv`` RMS-normed, ``kv_b_proj(c_kv)`` per head ``[k_nope ; v]``. Interleaved RoPE on
  ``q_pe`` / ``k_pe`` unless ``mla_use_nope``. Softmax scale :func:`mla_softmax_scale`.
* indexer (``index_topk`` set): :class:`LightningIndexer`; top-k over visible keys; attention over
  the selected keys only (:func:`sparse_mla_attention`, absorbed form; with
  ``attention_impl="pallas"`` the Pallas kernel ``kdsa.kernels_pallas.sparse_mla``, forward and
  backward, in training and decode).
* gate: ``o_h *= sigmoid(g_proj(x))_h`` (float32, elementwise per head, Gated Attention G1,
  arXiv 2505.06708), then ``o_proj``. ``x`` is the already-normed layer input.

Paths. Without a cache (training, full forward) keys are visible in token order within a row and
within a segment (``segment_ids``, 0 = padding). Dense attention (no indexer, or the dense
warm-up) uses MLA's MHA form (``kv_b_proj`` expanded, cheaper in training); sparse attention uses
the absorbed form (``W_UK`` folded into the query, one 576-d key shared by all heads, ``W_UV``
after attention). With a cache (prefill and decode) new tokens are written at their
``positions`` and every query reads slots ``<= its position``, always in absorbed form
(``kdsa.model.dsa_cache_attention``). Long prefills take causal key windows (both paths) and,
over a cache, attend densely while a query sees at most top-k keys: the same outputs.

Measured (f32, CPU, ``tiny`` dims, B 2, T 24 > topk 8): max abs error of the full forward
against a float64 NumPy MHA-form reference 4.7e-7 (NoPE), 6.1e-7 (RoPE + YaRN), 8.9e-7 (no
q-LoRA), 3.9e-7 (dense MLA), outputs up to 2.9 in size (``tests/test_dsa_layer.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.dsa_cache import DSACache, index_dim, rope_lanes_pad
from kdsa.model.dsa_cache_attention import attend_cache
from kdsa.model.indexer import LightningIndexer
from kdsa.model.layers import Linear, RMSNorm, dtype_of
from kdsa.model.outputs import INDEXER_LOSSES
from kdsa.model.paged_attention import attend_pool
from kdsa.model.paged_cache import PagedDSACache
from kdsa.model.query_chunks import causal_windows
from kdsa.model.rope import mla_softmax_scale, rope_interleaved, rope_inv_freq
from kdsa.model import sequence_parallel as cp

f32 = jnp.float32
# q_a_layernorm / kv_a_layernorm eps: fixed 1e-6 whatever rms_norm_eps says (1e-5 for Kimi):
# DeepSeek-V3's reference MLA (RMSNorm default eps) and transformers 5.18 DeepseekV32Attention /
# KimiLinearAttention (their RMSNorm default). With rms_norm_eps here the golden Kimi Linear
# logits (tests/test_convert.py) were off by 1.1e-5 abs; with 1e-6, 2.7e-7.
MLA_LATENT_NORM_EPS = 1e-6


def _rope_dim(config: ModelConfig) -> int:
    return 0 if config.mla_use_nope else config.qk_rope_head_dim


class GatedDSA(nnx.Module):
    """Gated (sparse) MLA mixer; see the module docstring. ``indexer`` is None for dense MLA."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        d, n, r = c.hidden_size, c.num_attention_heads, c.qk_rope_head_dim
        lin = functools.partial(Linear, rngs=rngs, param_dtype=dtype_of(c.param_dtype),
                                compute_dtype=dtype_of(c.compute_dtype))
        norm = functools.partial(RMSNorm, eps=MLA_LATENT_NORM_EPS,
                                 param_dtype=dtype_of(c.param_dtype))
        if c.q_lora_rank is not None:
            self.q_a_proj = lin(d, c.q_lora_rank, axes=("embed", "q_lora"))
            self.q_a_layernorm = norm(c.q_lora_rank)
            self.q_b_proj = lin(c.q_lora_rank, n * c.qk_head_dim, axes=("q_lora", "heads"))
        else:
            self.q_proj = lin(d, n * c.qk_head_dim, axes=("embed", "heads"))
        self.kv_a_proj_with_mqa = lin(d, c.kv_lora_rank + r, axes=("embed", None))
        self.kv_a_layernorm = norm(c.kv_lora_rank)
        self.kv_b_proj = lin(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim),
                             axes=("kv_lora", "heads"))
        self.g_proj = (lin(d, n * c.v_head_dim, axes=("embed", "heads"))
                       if c.mla_use_output_gate else None)
        self.o_proj = lin(n * c.v_head_dim, d, axes=("heads", "embed"))
        self.indexer = LightningIndexer(c, rngs=rngs) if c.use_indexer else None

    # ---- the call ----
    def __call__(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: DSACache | PagedDSACache | None = None, indexer_loss: str = "none",
                 block_table: jax.Array | None = None):
        """x ``[B, T, D]``, positions ``[B, T]`` int -> (y ``[B, T, D]``, cache, aux).

        ``aux = {"indexer_kl": f32 scalar}``, the mean over valid queries of the indexer KL of
        ``indexer_loss`` ("dense": full visible set, dense attention; "sparse": the selected set,
        top-k attention); 0 for "none" or without an indexer. Both losses read the indexer on
        stop-gradient inputs and a stop-gradient target, so their gradient reaches only indexer
        parameters; the output never depends differentiably on the indexer.

        With a cache each row is one sequence and ``segment_ids`` only marks padding (0):
        padding tokens are not written to the cache (earlier slots stay intact) and their
        outputs are 0. Writes at ``positions >= max_len`` are dropped. A
        :class:`~kdsa.model.paged_cache.PagedDSACache` pool takes the ``block_table``
        ``[B, max_pages]`` that maps each row's positions to its pages (``model/paged_cache.py``).
        """
        self._check(x, positions, segment_ids, cache, indexer_loss)
        q_nope, q_pe, q_latent = self._queries(x, positions)
        c_kv, k_pe = self._latent_kv(x, positions)
        if cache is None:
            o, kl = self._attend_sequence(x, q_latent, q_nope, q_pe, c_kv, k_pe, positions,
                                          segment_ids, indexer_loss)
        elif isinstance(cache, PagedDSACache):
            if block_table is None:
                raise ValueError("a paged DSA cache needs the block_table")
            o, cache = self._attend_pages(x, q_latent, q_nope, q_pe, c_kv, k_pe, positions,
                                          segment_ids, cache, block_table)
            kl = jnp.zeros((), f32)
        else:
            o, cache = self._attend_cache(x, q_latent, q_nope, q_pe, c_kv, k_pe, positions,
                                          segment_ids, cache)
            kl = jnp.zeros((), f32)
        return self._gate_and_project(x, o), cache, {"indexer_kl": kl}

    # ---- projections ----
    def _queries(self, x, positions):
        """q_nope ``[B, T, N, nope]``, q_pe ``[B, T, N, rope]``, q_latent (c_q, or x)."""
        c = self.config
        b, t, _ = x.shape
        if c.q_lora_rank is not None:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q_latent, q = x, self.q_proj(x)
        q = q.reshape(b, t, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        if _rope_dim(c):
            q_pe = rope_interleaved(q_pe, positions, self._inv_freq())
        return q_nope, q_pe, q_latent

    def _latent_kv(self, x, positions):
        """c_kv ``[B, T, kv_lora]`` (normed), k_pe ``[B, T, rope]`` (RoPE'd unless NoPE)."""
        c = self.config
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = self.kv_a_layernorm(kv[..., :c.kv_lora_rank]), kv[..., c.kv_lora_rank:]
        if _rope_dim(c):
            k_pe = rope_interleaved(k_pe, positions, self._inv_freq())
        return c_kv, k_pe

    def _inv_freq(self):
        c = self.config
        return rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)

    def _kv_b(self):
        """``W_UK [kv_lora, N, nope]``, ``W_UV [kv_lora, N, v]`` from ``kv_b_proj``."""
        c = self.config
        w = self.kv_b_proj.kernel[...].astype(dtype_of(c.compute_dtype))
        w = w.reshape(c.kv_lora_rank, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def _absorb(self, q_nope, q_pe):
        """Absorbed queries ``[B, T, N, kv_lora + rope]``: ``[q_nope @ W_UK^T ; q_pe]``."""
        w_uk, _ = self._kv_b()
        q_lat = jnp.einsum("btnh,cnh->btnc", q_nope, w_uk)
        return jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)

    def _unabsorb(self, o_lat):
        """``[B, T, N, kv_lora]`` latent outputs -> ``[B, T, N, v]`` through ``W_UV``."""
        _, w_uv = self._kv_b()
        return jnp.einsum("btnc,cnd->btnd", o_lat.astype(w_uv.dtype), w_uv)

    def _gate_and_project(self, x, o):
        """``o_proj(o * sigmoid(g_proj(x)))``; o ``[B, T, N, v]``."""
        b, t, n, v = o.shape
        o = o.astype(f32)
        if self.g_proj is not None:
            o = o * jax.nn.sigmoid(self.g_proj(x).astype(f32)).reshape(b, t, n, v)
        return self.o_proj(o.reshape(b, t, n * v).astype(dtype_of(self.config.compute_dtype)))

    # ---- attention without a cache ----
    def _attend_sequence(self, x, q_latent, q_nope, q_pe, c_kv, k_pe, positions, segment_ids,
                         indexer_loss):
        c = self.config
        b, t, n, _ = q_nope.shape
        scale, chunk = mla_softmax_scale(c), c.dsa_query_chunk_size
        order = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
        vis = dict(q_pos=order, kv_pos=order, q_seg=seg, kv_seg=seg, chunk_size=chunk)
        win = dict(windows=causal_windows(t, chunk))  # keys at their positions: key_slack 0
        kl_t = None
        if self.indexer is None or indexer_loss == "dense":  # dense causal, MHA form
            kv = self.kv_b_proj(c_kv).reshape(b, t, n, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
            k_pe_h = jnp.broadcast_to(k_pe[:, :, None, :], (b, t, n, k_pe.shape[-1]))
            q = jnp.concatenate([q_nope, q_pe], axis=-1)  # [B, T, N, nope + rope]
            k = jnp.concatenate([k_nope, k_pe_h.astype(k_nope.dtype)], axis=-1)
            o, _ = cp.dense_attention(q, k, v, scale, **vis, **win)  # (seq-parallel)
            if self.indexer is not None:  # dense warm-up loss
                iq, ik, iw = self.indexer(*_detached(x, q_latent), positions)
                kl_t = cp.indexer_kl_dense(q, k, scale, iq, ik, iw, **vis)
        else:  # top-k sparse, absorbed form
            detach = indexer_loss == "sparse"
            iq, ik, iw = self.indexer(*(_detached(x, q_latent) if detach else (x, q_latent)),
                                      positions)
            idx = cp.indexer_topk(iq, ik, iw, c.index_topk, **vis, **win)  # [B, T, K] (SP)
            q_abs = self._absorb(q_nope, q_pe)  # [B, T, N, kv_lora + rope]
            kv = (c_kv, k_pe)  # [B, T, kv_lora] and [B, T, rope]: the key parts, kept apart
            o_lat, _ = cp.sparse_mla_attention(q_abs, kv, idx, scale, c.kv_lora_rank,
                                               chunk_size=chunk, impl=c.attention_impl)
            o = self._unabsorb(o_lat)
            if detach:
                kl_t = cp.indexer_kl_sparse(q_abs, kv, idx, scale, iq, ik, iw,
                                            chunk_size=chunk)
        if kl_t is None:
            return o, jnp.zeros((), f32)
        valid = (seg != 0).astype(f32)
        return o, jnp.sum(kl_t * valid) / jnp.maximum(jnp.sum(valid), 1.0)

    # ---- attention over a cache ----
    def _attend_cache(self, x, q_latent, q_nope, q_pe, c_kv, k_pe, positions, segment_ids, cache):
        c = self.config
        b, t = positions.shape
        big = cache.max_len
        # padding tokens (segment 0) are not written; positions >= max_len are dropped too
        if segment_ids is None:
            write, q_seg = positions, jnp.ones((b, t), jnp.int32)
        else:
            write, q_seg = jnp.where(segment_ids != 0, positions, big), (segment_ids != 0)
            q_seg = q_seg.astype(jnp.int32)
        written, q_abs, index = self._cache_inputs(x, q_latent, q_nope, q_pe, c_kv, k_pe,
                                                   positions, cache)
        cache = cache.replace(**{name: cache.write(name, write, v)
                                 for name, v in written.items()}).settled()
        kv_latent, k_rope = cache.view("kv_latent"), cache.view("k_rope")
        vis = dict(q_pos=positions, kv_pos=jnp.broadcast_to(jnp.arange(big, dtype=jnp.int32),
                                                             (b, big)),
                   q_seg=q_seg, kv_seg=jnp.ones((b, big), jnp.int32),
                   chunk_size=c.dsa_query_chunk_size)
        scale = mla_softmax_scale(c)
        kv = (kv_latent, k_rope)  # key parts [B, L, kv_lora], [B, L, rope]; never concatenated
        if cache.layer is not None:  # the sparse attention reads the stacks [R, B, L, D] in place
            kv = (cache.kv_latent, cache.k_rope)
        if index is not None:  # the indexer's queries and weights, the keys as written
            index = (index[0], cache.view("index_keys"), index[1], None)
        o_lat = attend_cache(
            q_abs, index, keys=lambda w: (kv_latent[:, :w], k_rope[:, :w]),
            sparse=lambda q, idx: cp.sparse_mla_attention(
                q, kv, idx, scale, c.kv_lora_rank, chunk_size=c.dsa_query_chunk_size,
                impl=c.attention_impl, layer=cache.layer, rows_major=cache.rows_major)[0],
            topk=c.index_topk, scale=scale, num_keys=big, **vis)
        return self._unabsorb(o_lat), cache

    def _cache_inputs(self, x, q_latent, q_nope, q_pe, c_kv, k_pe, positions, cache):
        """The rows a step writes to ``cache`` (``kv_latent``, ``k_rope`` and with an indexer
        ``index_keys``), its absorbed queries ``[B, T, N, kv_lora + width]`` and the indexer's
        ``(queries, weights)`` (None without one). The RoPE key and the queries' RoPE part
        take the cache's ``width`` columns (:func:`rope_cache_width`), the extra ones zero."""
        width = cache.k_rope.shape[-1]
        written = dict(kv_latent=c_kv, k_rope=rope_lanes_pad(k_pe, width))
        index = None
        if self.indexer is not None:
            iq, written["index_keys"], iw = self.indexer(x, q_latent, positions)
            index = (iq, iw)
        q_abs = rope_lanes_pad(self._absorb(q_nope, q_pe), self.config.kv_lora_rank + width)
        return written, q_abs, index

    # ---- attention over a paged pool ----
    def _attend_pages(self, x, q_latent, q_nope, q_pe, c_kv, k_pe, positions, segment_ids,
                      cache: PagedDSACache, block_table):
        """``_attend_cache`` with the rows in a shared pool (``model/paged_attention.py``: on
        one device, or split over a mesh's batch device groups)."""
        c = self.config
        written, q_abs, index = self._cache_inputs(x, q_latent, q_nope, q_pe, c_kv, k_pe,
                                                   positions, cache)
        o_lat, cache = attend_pool(q_abs, index, written, positions,
                                   segment_ids, cache, block_table, scale=mla_softmax_scale(c),
                                   topk=c.index_topk, v_dim=c.kv_lora_rank,
                                   chunk_size=c.dsa_query_chunk_size, impl=c.attention_impl)
        return self._unabsorb(o_lat), cache

    # ---- input checks ----
    def _check(self, x, positions, segment_ids, cache, indexer_loss):
        c = self.config
        if indexer_loss not in INDEXER_LOSSES:
            raise ValueError(f"indexer_loss must be one of {INDEXER_LOSSES}, got {indexer_loss!r}")
        if x.ndim != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be [B, T, hidden_size={c.hidden_size}], got {x.shape}")
        if positions.shape != x.shape[:2] or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"positions must be integer [B, T] = {x.shape[:2]}, got "
                             f"{positions.dtype}{list(positions.shape)}")
        if segment_ids is not None and segment_ids.shape != x.shape[:2]:
            raise ValueError(f"segment_ids must be [B, T] = {x.shape[:2]}, got {segment_ids.shape}")
        if cache is None:
            return
        if indexer_loss != "none":
            raise ValueError(f"indexer_loss={indexer_loss!r} is for training without a cache")
        paged = isinstance(cache, PagedDSACache)
        want = (cache.num_rows,) if paged else (x.shape[0], cache.max_len)
        if cache.layer is not None:  # the stack's buffers, [repeats, ...]
            want = cache.kv_latent.shape[:1] + want
        rope = max(cache.k_rope.shape[-1], c.qk_rope_head_dim)  # rope_cache_width: or wider
        for name, d in (("kv_latent", c.kv_lora_rank), ("k_rope", rope),
                        ("index_keys", index_dim(c))):
            if getattr(cache, name).shape != want + (d,):
                raise ValueError(f"cache.{name} has shape {getattr(cache, name).shape}, expected "
                                 f"{want + (d,)} " + ("(pool rows)" if paged else
                                                      f"(batch {x.shape[0]})"))


def _detached(x, q_latent):
    return jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)


# Trainable-parameter filters for the two indexer stages (DeepSeek-V3.2-Exp paper section 2.1):
# the dense warm-up trains the indexer only (attention dense, every other weight frozen); the
# sparse stage trains every parameter (the indexer from its KL loss only, since its inputs are
# detached in ``indexer_loss="sparse"``). Use as ``nnx.Optimizer(model, tx, wrt=...)`` and
# ``nnx.grad(loss, argnums=nnx.DiffState(0, ...))``.
INDEXER_PARAMS = nnx.All(nnx.Param, nnx.PathContains("indexer"))


def indexer_stage_params(stage: str):
    """The parameter filter to train in ``stage``: ``"dense_warmup"`` or ``"sparse"``."""
    if stage == "dense_warmup":
        return INDEXER_PARAMS
    if stage == "sparse":
        return nnx.Param
    raise ValueError(f"indexer stage must be 'dense_warmup' or 'sparse', got {stage!r}")
