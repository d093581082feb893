"""Small models and random weights shared by the conversion and checkpoint tests."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import LinearAttnConfig, get_preset
from kdsa.model.moe_mxfp4 import pack_expert_weight

# K3 features in two layers: KDA + dense FFN, then gated DSA (indexer) + latent MoE, AttnRes.
MICRO = get_preset("tiny").replace(
    num_hidden_layers=2, attn_res_block_size=1,
    linear_attn_config=LinearAttnConfig(kda_layers=(1,), full_attn_layers=(2,), num_heads=2,
                                        head_dim=16, use_full_rank_gate=True,
                                        gate_lower_bound=-5.0))

def random_params(config, seed: int):
    """``(key, producer)`` for every variable, values in sensible ranges (no model init)."""
    rng = np.random.default_rng(seed)
    for key, v in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config))).items():
        shape, dt = tuple(v.shape), np.dtype(v.dtype)
        if key.endswith("_packed") or key.endswith("_scale"):
            continue
        if "norm" in key.rsplit(".", 2)[-2] or key.endswith((".norm", "norm.weight")):
            a = 1 + 0.2 * rng.standard_normal(shape)
        elif key.endswith("A_log"):
            a = np.log(rng.uniform(1, 16, shape))
        elif key.endswith(("bias", "res.proj", "attn_res.proj")):
            a = 0.1 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 4)
        yield key, (lambda a=a, dt=dt: jnp.asarray(a, dt))
    if config.expert_weight_format == "mxfp4":
        for key, v in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config))).items():
            if key.endswith("_packed"):
                r, e, n, k2 = v.shape
                w = rng.standard_normal((r * e, k2 * 2, n)) / np.sqrt(k2 * 2)
                packed, scale = pack_expert_weight(jnp.asarray(w, jnp.float32))
                yield key, (lambda p=packed, s=(r, e, n, k2): p.reshape(s))
                yield key[:-7] + "_scale", (lambda q=scale, s=(r, e, n, k2 // 16): q.reshape(s))
