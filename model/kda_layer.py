"""The Kimi Delta Attention layer (Flax NNX) and its decode cache.

Forward (Kimi Linear paper arXiv 2510.26692; fla ``fla/layers/kda.py``; vLLM ``kimi_k3/kda.py``;
``docs/reference/kda.md`` §2, ``docs/reference/kimi_k3.md`` §3)::

    q, k, v = SiLU(causal depthwise conv_W(x W_q | x W_k | x W_v))     [B, T, H, K]
    q, k    = q / sqrt(sum q^2 + 1e-6), k / sqrt(sum k^2 + 1e-6)     (eps inside the sqrt)
    raw     = f_b(f_a(x)) + dt_bias                                    [B, T, H, K]
    g       = -exp(A_log[h]) softplus(raw)              Kimi Linear (gate_lower_bound None)
            = lb sigmoid(exp(A_log[h]) raw)             K3 "safe gate" (lb = gate_lower_bound)
    beta    = sigmoid(b_proj(x))                                       [B, T, H]
    o       = KDA(q, k, v, g, beta)                                    ``kdsa.model.kda``
    y       = o_proj(RMSNorm_V(o) * sigmoid(g_proj(x)  or  g_b(g_a(x))))

Parameter names and shapes mirror the Hugging Face checkpoint (kernels stored ``[in, out]``;
``q/k/v_conv1d`` are HF ``[H*K, 1, W]`` squeezed to ``[H*K, W]``; ``A_log`` is ``[H]``: K3 stores
128 values for 96 heads and vLLM/fla read the first H). The conv weights, ``A_log``, ``dt_bias``
and ``o_norm`` stay float32 as in the checkpoint (``kimi_k3.md`` §1); the rest uses
``config.param_dtype``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kdsa.model.config import ModelConfig
from kdsa.model.kda import kda_step, segment_starts
from kdsa.model.layers import Linear, RMSNorm, dtype_of, param, rms_norm
from kdsa.model import sequence_parallel as cp


@struct.dataclass
class KDACache:
    """Decode state of one KDA layer: constant size, whatever the context length.

    ``conv_state [B, W-1, 3, H*K]``: the last W-1 pre-conv q, k and v projections (oldest first),
    in the compute dtype; q, k and v on their own axis, so that splitting the heads (the last
    axis) gives each device its heads' channels of all three. ``recurrent_state [B, H, K, V]``:
    the KDA state, float32.
    """

    conv_state: jax.Array
    recurrent_state: jax.Array


def _sizes(config: ModelConfig) -> tuple[int, int, int]:
    lac = config.linear_attn_config
    return lac.num_heads, lac.head_dim, lac.short_conv_kernel_size


def init_kda_cache(config: ModelConfig, batch_size: int) -> KDACache:
    """A zero cache for ``batch_size`` sequences (the state before any token)."""
    h, dk, w = _sizes(config)
    return KDACache(
        conv_state=jnp.zeros((batch_size, w - 1, 3, h * dk), dtype_of(config.compute_dtype)),
        recurrent_state=jnp.zeros((batch_size, h, dk, dk), jnp.float32))


def kda_cache_bytes_per_sequence(config: ModelConfig) -> int:
    """Bytes of one sequence's ``KDACache`` (one layer): (W-1)*3*H*K*itemsize + H*K*V*4."""
    h, dk, w = _sizes(config)
    return (w - 1) * 3 * h * dk * jnp.dtype(dtype_of(config.compute_dtype)).itemsize \
        + h * dk * dk * 4


# ----------------------------------------------------------------------------------------------
# Pure pieces
# ----------------------------------------------------------------------------------------------

def causal_depthwise_conv(x, weight, *, history=None, seg=None):
    """``out[t, c] = sum_j weight[c, j] * xx[t + j, c]`` with ``xx = concat(history, x)``.

    x [B, T, *C] (any channel axes: the layer's [3, H*K]); weight [*C, W] (tap W-1 multiplies
    the current token, as PyTorch ``conv1d`` with left padding W-1); history [B, W-1, *C] (the
    previous inputs, zeros if None). With ``seg`` [B, T] (document numbers, packed training) a
    tap reading another document contributes 0 (so ``seg`` and ``history`` do not combine: a
    cache continues one document). Computed in float32; returns float32 [B, T, *C].
    """
    if history is not None and seg is not None:
        raise ValueError("causal_depthwise_conv takes history (a cache) or seg (packed "
                         "documents), not both: the history would read as another document")
    b, t, *c = x.shape
    w = weight.shape[-1]
    if history is None:
        history = jnp.zeros((b, w - 1, *c), x.dtype)
    xx = jnp.concatenate([history, x], axis=1).astype(jnp.float32)   # [B, W-1+T, *C]
    wf = weight.astype(jnp.float32)
    out = jnp.zeros((b, t, *c), jnp.float32)
    for j in range(w):
        tap = xx[:, j:j + t] * wf[..., j]
        lag = w - 1 - j
        if seg is not None and lag:
            prev = jnp.concatenate([jnp.full((b, lag), -1, seg.dtype), seg], axis=1)[:, :t]
            same = (prev == seg).reshape(b, t, *(1,) * len(c))
            tap = jnp.where(same, tap, 0.0)
        out = out + tap
    return out


def l2_normalize(x, eps: float = 1e-6):
    """``x / sqrt(sum x^2 + eps)`` over the last axis, float32 (fla ``l2norm``, eps inside)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_gate(raw, a_log, lower_bound: float | None):
    """Log-decay from the raw gate ``raw [..., H, K]`` (dt_bias added) and ``a_log [H]``.

    Kimi Linear (fla ``naive_kda_gate``): -exp(A_log) softplus(raw), unbounded below.
    K3 (fla ``naive_kda_lowerbound_gate``): lb sigmoid(exp(A_log) raw), in (lb, 0).
    """
    a = jnp.exp(a_log.astype(jnp.float32))[:, None]                 # [H, 1]
    raw = raw.astype(jnp.float32)
    if lower_bound is None:
        return -a * jax.nn.softplus(raw)
    return lower_bound * jax.nn.sigmoid(a * raw)


def _last_valid_window(history, x, lengths, width):
    """The last ``width`` rows of ``concat(history, x[:lengths])`` per row: [B, width, *C]."""
    xx = jnp.concatenate([history, x.astype(history.dtype)], axis=1)
    idx = lengths[:, None] + jnp.arange(width)[None, :]               # [B, W-1]
    idx = idx.reshape(idx.shape + (1,) * (xx.ndim - 2))
    return jnp.take_along_axis(xx, idx, axis=1)


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------

def _uniform(bound: float):
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype):
    """inverse-softplus(dt), dt log-uniform in [1e-3, 0.1], clamped >= 1e-4 (fla)."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(0.1)))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


class KDA(nnx.Module):
    """Kimi Delta Attention mixer: ``__call__(x, *, segment_ids, cache)`` -> ``(y, cache)``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        lac = config.linear_attn_config
        h, dk, w = _sizes(config)
        d = config.hidden_size
        self.config = config
        self.num_heads, self.head_dim, self.conv_size = h, dk, w
        self.lower_bound = lac.gate_lower_bound
        pd, cd = dtype_of(config.param_dtype), dtype_of(config.compute_dtype)
        self.compute_dtype = cd
        lin = lambda i, o, axes: Linear(i, o, axes=axes, rngs=rngs, param_dtype=pd,  # noqa: E731
                                        compute_dtype=cd)
        self.q_proj = lin(d, h * dk, ("embed", "heads"))
        self.k_proj = lin(d, h * dk, ("embed", "heads"))
        self.v_proj = lin(d, h * dk, ("embed", "heads"))
        conv_init = _uniform(1.0 / math.sqrt(w))                       # PyTorch Conv1d default
        self.q_conv1d = param(rngs, conv_init, (h * dk, w), ("heads", None), jnp.float32)
        self.k_conv1d = param(rngs, conv_init, (h * dk, w), ("heads", None), jnp.float32)
        self.v_conv1d = param(rngs, conv_init, (h * dk, w), ("heads", None), jnp.float32)
        self.f_a_proj = lin(d, dk, ("embed", None))
        self.f_b_proj = lin(dk, h * dk, (None, "heads"))
        a_init = _a_log_init if self.lower_bound is None else nnx.initializers.zeros
        self.A_log = param(rngs, a_init, (h,), ("heads",), jnp.float32)
        self.dt_bias = param(rngs, _dt_bias_init, (h * dk,), ("heads",), jnp.float32)
        self.b_proj = lin(d, h, ("embed", "heads"))
        if lac.use_full_rank_gate:
            self.g_proj = lin(d, h * dk, ("embed", "heads"))
        else:
            self.g_a_proj = lin(d, dk, ("embed", None))
            self.g_b_proj = lin(dk, h * dk, (None, "heads"))
        self.o_norm = RMSNorm(dk, eps=config.rms_norm_eps, param_dtype=jnp.float32)
        self.o_proj = lin(h * dk, d, ("heads", "embed"))

    def _check(self, x, segment_ids, cache):
        h, dk, w = self.num_heads, self.head_dim, self.conv_size
        if x.ndim != 3 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"x must be [B, T, hidden_size={self.config.hidden_size}], got "
                             f"{x.shape}")
        b, t = x.shape[:2]
        if t < 1:
            raise ValueError(f"x has no tokens: shape {x.shape}")
        if segment_ids is not None and (segment_ids.shape != (b, t)
                                        or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
            raise ValueError(f"segment_ids must be integer [B, T] = {(b, t)}, got "
                             f"{segment_ids.dtype}{list(segment_ids.shape)}")
        if cache is not None:
            want = ((b, w - 1, 3, h * dk), (b, h, dk, dk))
            got = (cache.conv_state.shape, cache.recurrent_state.shape)
            if got != want:
                raise ValueError(f"KDACache shapes (conv_state, recurrent_state) must be {want} "
                                 f"for this layer and batch, got {got}")

    def __call__(self, x, *, segment_ids=None, cache: KDACache | None = None):
        """x [B, T, D] -> (y [B, T, D] in the compute dtype, updated cache or None).

        Without a cache: a full forward (training); ``segment_ids`` pack documents (state and conv
        window reset at each document start; 0 = padding, a no-op with output 0). With a cache:
        continue from it, via ``kda_step`` when T == 1 and ``kda_chunked`` otherwise;
        ``segment_ids`` then only mark right padding (0), and the returned conv window holds each
        row's last W-1 valid inputs.
        """
        self._check(x, segment_ids, cache)
        b, t, _ = x.shape
        h, dk, w = self.num_heads, self.head_dim, self.conv_size
        valid = None if segment_ids is None else segment_ids != 0           # [B, T]
        qkv = jnp.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=2)
        if valid is not None:
            qkv = jnp.where(valid[..., None, None], qkv, 0).astype(qkv.dtype)  # [B, T, 3, HK]
        weight = jnp.stack([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]])
        if cache is None:
            seg = None if segment_ids is None else segment_starts(segment_ids)[1]
            conv = causal_depthwise_conv(qkv, weight, seg=seg)
        else:
            conv = causal_depthwise_conv(qkv, weight, history=cache.conv_state)
            lengths = (jnp.full((b,), t, jnp.int32) if valid is None
                       else jnp.sum(valid, axis=1, dtype=jnp.int32))
            conv_state = _last_valid_window(cache.conv_state, qkv, lengths, w - 1)
        conv = jax.nn.silu(conv).reshape(b, t, 3, h, dk)
        q, k = l2_normalize(conv[:, :, 0]), l2_normalize(conv[:, :, 1])     # [B, T, H, K]
        v = conv[:, :, 2].astype(self.compute_dtype)
        raw = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32) + self.dt_bias[...]
        g = kda_gate(raw.reshape(b, t, h, dk), self.A_log[...], self.lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))           # [B, T, H]
        if cache is None:
            o, _ = cp.kda_chunked(q, k, v, g, beta, chunk_size=self.config.kda_chunk_size,
                                  segment_ids=segment_ids,  # sequence-parallel under rules
                                  gate_lower_bound=self.lower_bound)  # K3 gate: g >= lb
            new_cache = None
        elif t == 1:
            if valid is not None:                                           # finished rows
                beta = jnp.where(valid[..., None], beta, 0.0)
                g = jnp.where(valid[..., None, None], g, 0.0)
            o, state = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                cache.recurrent_state)
            o = o[:, None] if valid is None else jnp.where(valid[..., None, None], o[:, None], 0)
            new_cache = KDACache(conv_state=conv_state, recurrent_state=state)
        else:
            ids = None if valid is None else valid.astype(jnp.int32)         # pads only
            o, state = cp.kda_chunked(q, k, v, g, beta, initial_state=cache.recurrent_state,
                                      chunk_size=self.config.kda_chunk_size, segment_ids=ids,
                                      gate_lower_bound=self.lower_bound)
            new_cache = KDACache(conv_state=conv_state, recurrent_state=state)
        if self.config.linear_attn_config.use_full_rank_gate:
            gate = self.g_proj(x)
        else:
            gate = self.g_b_proj(self.g_a_proj(x))
        gate = jax.nn.sigmoid(gate.astype(jnp.float32)).reshape(b, t, h, dk)
        o = rms_norm(o.astype(jnp.float32), self.o_norm.weight[...], self.o_norm.eps) * gate
        y = self.o_proj(o.reshape(b, t, h * dk).astype(self.compute_dtype))
        return y, new_cache
