"""The lightning indexer of a Gated DSA layer (DeepSeek-V3.2-Exp paper section 2.1;
``docs/reference/dsa.md``): per token, J small query heads and one key that score every visible
key cheaply, so the layer attends to the top-k scored keys only (``kdsa.model.dsa``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.layers import LayerNorm, Linear, dtype_of
from kdsa.model.rope import rope_half_split, rope_inv_freq

f32 = jnp.float32


def _rope_dim(config: ModelConfig) -> int:
    return 0 if config.mla_use_nope else config.qk_rope_head_dim


class LightningIndexer(nnx.Module):
    """DeepSeek-V3.2 lightning indexer (``docs/reference/dsa.md`` 1.3), without the FP8/Hadamard deployment.

    ``wq_b``: ``c_q`` (or x when ``q_lora_rank is None``) -> J x Di queries; ``wk``: x -> one Di
    key per token, then ``k_norm`` (LayerNorm, eps 1e-6); half-split RoPE on the first
    ``qk_rope_head_dim`` dims (none with NoPE); ``weights_proj`` in float32, times
    ``J**-0.5 * Di**-0.5``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, j, di = config.hidden_size, config.index_n_heads, config.index_head_dim
        q_in, q_axis = ((config.q_lora_rank, "q_lora") if config.q_lora_rank is not None
                        else (d, "embed"))
        pd, cd = dtype_of(config.param_dtype), dtype_of(config.compute_dtype)
        self.wq_b = Linear(q_in, j * di, axes=(q_axis, "index_heads"), rngs=rngs,
                           param_dtype=pd, compute_dtype=cd)
        self.wk = Linear(d, di, axes=("embed", None), rngs=rngs, param_dtype=pd, compute_dtype=cd)
        self.k_norm = LayerNorm(di, eps=1e-6, param_dtype=pd)
        self.weights_proj = Linear(d, j, axes=("embed", None), rngs=rngs, param_dtype=pd,
                                   compute_dtype=f32)

    def __call__(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array):
        """x ``[B, T, D]``, q_latent ``[B, T, q_lora | D]`` -> q ``[B, T, J, Di]``,
        k ``[B, T, Di]`` (``index_dtype``), weights ``[B, T, J]`` (float32)."""
        c = self.config
        b, t, _ = x.shape
        j, di, r = c.index_n_heads, c.index_head_dim, _rope_dim(c)
        q = self.wq_b(q_latent).reshape(b, t, j, di)
        k = self.k_norm(self.wk(x))
        if r:
            inv_freq = rope_inv_freq(r, c.rope_theta, c.rope_scaling)
            q = jnp.concatenate([rope_half_split(q[..., :r], positions, inv_freq), q[..., r:]], -1)
            k = jnp.concatenate([rope_half_split(k[..., :r], positions, inv_freq), k[..., r:]], -1)
        w = self.weights_proj(x) * (j ** -0.5 * di ** -0.5)
        dt = dtype_of(c.index_compute_dtype)
        return q.astype(dt), k.astype(dt), w
