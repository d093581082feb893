"""Dense gated FFN: the dense first layers' MLP and the MoE shared experts.

``y = down_proj(act(gate_proj(x), up_proj(x)))`` with ``act`` from
:func:`kdsa.model.activations.gated_activation` (SiLU or SiTU per ``config.hidden_act``).

Checkpoint names (Kimi K3, ``docs/reference/kimi_k3.md`` section 2): layer 0 ``mlp.gate_proj`` /
``mlp.up_proj`` ``[33792, 7168]``, ``mlp.down_proj`` ``[7168, 33792]``; MoE layers
``block_sparse_moe.shared_experts.{gate,up}_proj`` ``[6144, 7168]`` (``moe_intermediate_size *
num_shared_experts = 3072 * 2``) and ``down_proj`` ``[7168, 6144]``. Our kernels are the
transposes (``[in, out]``).
"""

from __future__ import annotations

import jax
from flax import nnx

from kdsa.model.activations import gated_activation
from kdsa.model.config import ModelConfig
from kdsa.model.layers import Linear, dtype_of


class DenseFFN(nnx.Module):
    """Gated MLP ``D -> I -> D``; ``hidden_size`` defaults to ``config.hidden_size``."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs: nnx.Rngs,
                 hidden_size: int | None = None):
        d = config.hidden_size if hidden_size is None else hidden_size
        for name, v in (("intermediate_size", intermediate_size), ("hidden_size", d)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DenseFFN {name} must be a positive integer, got {v!r}")
        self.config = config
        self.hidden_size, self.intermediate_size = d, intermediate_size
        kw = dict(rngs=rngs, param_dtype=dtype_of(config.param_dtype),
                  compute_dtype=dtype_of(config.compute_dtype))
        self.gate_proj = Linear(d, intermediate_size, axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(d, intermediate_size, axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(intermediate_size, d, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"DenseFFN expects [..., {self.hidden_size}], got {x.shape}")
        h = gated_activation(self.gate_proj(x), self.up_proj(x), self.config)  # [..., I]
        return self.down_proj(h)  # [..., D]
