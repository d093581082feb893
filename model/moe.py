"""Mixture of experts: sigmoid router with selection bias, dropless routed experts, latent MoE.

One MoE layer (Kimi K3 / Kimi Linear ``block_sparse_moe``; ``docs/reference/kimi_k3.md``
sections 1-3, DeepSeek-V3 report section 2.1.2 for the routing)::

    scores  = sigmoid(x @ gate.weight)                  [N, E]  float32, full hidden x
    chosen  = top_k(scores + e_score_correction_bias)   [N, k]  bias only chooses ("noaux_tc")
    weights = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor
    z       = routed_expert_down_proj(x)                [N, De] (latent MoE; else z = x)
    r       = sum_j weights_j * w2_e(act(w1_e z, w3_e z)),  e = chosen_j
    r       = routed_expert_up_proj(routed_expert_norm(r))     (latent MoE)
    y       = r + shared_experts(x)

The latent norm acts on the combined top-k output, after the weighted sum and before the
up-projection: sglang-jax ``kimi_k3.py`` ``KimiK3DecoderLayer._ffn`` runs the expert layer (which
combines with the routing weights) on ``routed_expert_down_proj(x)``, then
``routed_expert_norm``, then ``routed_expert_up_proj``, then adds the shared experts computed on
the full hidden (vLLM's ``KimiRoutedOutputTransform`` is the same order). The router and the
shared experts read the full hidden state, only the routed experts run in the latent.

Checkpoint shapes (K3): ``gate.weight [896, 7168]``, ``gate.e_score_correction_bias [896]`` f32,
``routed_expert_down_proj [3584, 7168]``, ``routed_expert_norm [3584]``,
``routed_expert_up_proj [7168, 3584]``, ``experts.{e}.w1/w3 [3072, 3584]``, ``w2 [3584, 3072]``
(w1 = gate, w3 = up, w2 = down). We store ``[in, out]`` and stack the experts on axis 0.

Dispatch is dropless (every assignment is computed, no capacity factor): the ``N*k``
assignments are sorted by expert and run through ``jax.lax.ragged_dot`` grouped matmuls
(:func:`experts_ragged`) on GPU/TPU, and through ``kdsa.model.experts_cpu`` on CPU, where
XLA's ``ragged_dot`` is a masked dense product (:func:`experts_routed` picks by the platform the
step is compiled for). :func:`experts_one_hot` is the dense reference (every token through
every expert, combined with a ``[N, E]`` weight matrix); tests compare the two, values and
gradients. The router, its selection bias and the load statistics of the bias update are in
``kdsa.model.routing``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdsa.model.activations import gated_activation
from kdsa.model.config import ModelConfig
from kdsa.model.ffn import DenseFFN
from kdsa.model.layers import Linear, RMSNorm, dtype_of, inverse_permutation, param
from kdsa.model.expert_parallel import expert_parallel_experts, token_axes, token_order
from kdsa.model.experts_cpu import experts_cpu
from kdsa.model.partitioning import compile_platform, constrain, current as current_sharding
from kdsa.model.stacked_experts import PackedMatrix, StackedWeight, own, ragged_dot
from kdsa.model.moe_mxfp4 import (PackedExpertWeight, expert_matrix_shapes, pack_expert_weight,
                                  qat_expert_weights, unpack_expert_weight)
from kdsa.model.routing import (Router, expert_load, max_load_ratio, replay_agreement,
                                replayed_rows, router_topk)

ExpertsFn = Callable[..., jax.Array]


# ---------------------------------------------------------------------------------------------
# Routed experts: dropless ragged dispatch and the one-hot reference
# ---------------------------------------------------------------------------------------------

def experts_ragged(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array,
                   w3: jax.Array, w2: jax.Array, config: ModelConfig) -> jax.Array:
    """Dropless sorted dispatch: ``sum_j weight_j * w2_e(act(w1_e z, w3_e z))`` per token.

    Args:
      z: ``[N, De]``; topk_idx, topk_weight: ``[N, k]``; w1, w3: ``[E, De, I]``; w2: ``[E, I, De]``
        (or ``stacked_experts.StackedWeight``s: the layer's in its scan's stacks; or
        ``PackedMatrix``s: MXFP4 bytes through the grouped MXFP4 kernel with ``impl="pallas"``,
        float32 accumulation, or their exact dequantisation with ``"xla"``).
    Returns ``[N, De]`` in ``z.dtype``; the weighted combine is float32.

    The ``M = N*k`` assignments are stably sorted by expert, so each expert's rows are
    contiguous and ``ragged_dot`` multiplies group g's rows by ``w[g]``. On CPU XLA lowers
    ``ragged_dot`` to a masked dense matmul (E times the work, see ``bench/bench_moe.py``);
    on GPU/TPU it is a grouped matmul.

    Measured against :func:`experts_one_hot` inside the full layer (``tests/test_moe.py``,
    float32 CPU, tiny configs): max relative error 1.3e-7 forward, 2.9e-7 on the gradients of
    x and every weight; 4e-7 against a float64 NumPy per-token loop; 8e-3 in bfloat16.
    """
    n, k = topk_idx.shape
    e, de, _ = w1.shape
    dt = z.dtype
    flat = topk_idx.reshape(-1)  # [M]
    order = jnp.argsort(flat, stable=True)  # [M] assignment ids sorted by expert
    rows = jnp.take(z, order // k, axis=0)  # [M, De]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E]
    gate = ragged_dot(rows, w1, group_sizes, dt)  # [M, I]
    up = ragged_dot(rows, w3, group_sizes, dt)  # [M, I]
    h = gated_activation(gate, up, config)  # [M, I]
    out_sorted = ragged_dot(h, w2, group_sizes, dt)  # [M, De]
    inverse = inverse_permutation(order)  # [M]
    out = jnp.take(out_sorted, inverse, axis=0).reshape(n, k, de)  # [N, k, De]
    y = jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), topk_weight.astype(jnp.float32))
    return y.astype(dt)


def experts_routed(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array,
                   w3: jax.Array, w2: jax.Array, config: ModelConfig) -> jax.Array:
    """The layer's routed experts: :func:`experts_ragged` when the step is compiled for GPU or
    TPU (the active mesh's devices, else ``kernels_pallas.common.backend()``, which follows
    ``compile_target``), ``kdsa.model.experts_cpu.experts_cpu`` for CPU."""
    if compile_platform() == "cpu":
        return experts_cpu(z, topk_idx, topk_weight, own(w1), own(w3), own(w2), config)
    return experts_ragged(z, topk_idx, topk_weight, w1, w3, w2, config)


def experts_per_device(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1, w3, w2,
                       config: ModelConfig) -> jax.Array:
    """:func:`experts_ragged` on each device's own token rows, the weights whole on every
    device, inside an explicit ``shard_map`` when a layout's rules are active: MXFP4 experts
    multiplied by the Pallas kernel (:class:`PackedMatrix`, ``moe_impl="pallas"``) without
    expert parallelism (e.g. ``data=4`` or ``fsdp=2``), since XLA cannot partition a Pallas
    call itself ("Mosaic kernels cannot be automatically partitioned"). Tokens are
    independent, so each device's rows give the rows of the whole."""
    ctx = current_sharding()
    if ctx is None:
        return experts_ragged(z, topk_idx, topk_weight, w1, w3, w2, config)
    axes = token_axes(ctx, z.shape[0])
    rows = P((axes[0] if len(axes) == 1 else axes) if axes else None, None)

    def body(z, topk_idx, topk_weight, w1, w3, w2):
        return experts_ragged(z, topk_idx, topk_weight, w1, w3, w2, config)

    # check_vma off, as for the sparse attention kernel: interpret mode carries refs invariant
    return jax.shard_map(body, mesh=ctx.mesh, in_specs=(rows,) * 3 + (P(),) * 3,
                         out_specs=rows, check_vma=False)(z, topk_idx, topk_weight, w1, w3, w2)


def experts_one_hot(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array,
                    w3: jax.Array, w2: jax.Array, config: ModelConfig) -> jax.Array:
    """Dense reference for :func:`experts_ragged`: every token through every expert.

    ``combine[n, e]`` is the routing weight of expert e for token n (zero when not chosen).
    Costs ``E / k`` times the routed FLOPs; for tests and small runs only.
    """
    e, dt = w1.shape[0], z.dtype
    w1, w3, w2 = own(w1), own(w3), own(w2)
    combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(topk_idx, e, dtype=jnp.float32),
                         topk_weight.astype(jnp.float32))  # [N, E]
    gate = jnp.einsum("nd,edi->nei", z, w1.astype(dt))
    up = jnp.einsum("nd,edi->nei", z, w3.astype(dt))
    h = gated_activation(gate, up, config)  # [N, E, I]
    out = jnp.einsum("nei,eid->ned", h, w2.astype(dt))
    y = jnp.einsum("ned,ne->nd", out.astype(jnp.float32), combine)
    return y.astype(dt)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

class RoutedExperts(nnx.Module):
    """``experts``: ``w1`` (gate), ``w3`` (up) ``[E, De, I]`` and ``w2`` (down) ``[E, I, De]``.

    ``expert_weight_format="mxfp4"``: instead ``w{1,3,2}_packed`` / ``w{1,3,2}_scale``
    (:class:`PackedExpertWeight`, HF orientation ``[E, N, K/2]`` / ``[E, N, K/32]``), initialised
    by quantising the same float initialiser's draw. With ``moe_impl="pallas"`` and the default
    ``experts_fn`` (:func:`experts_routed`) the bytes go through the grouped MXFP4 kernel
    (:func:`experts_per_device`); otherwise any ``experts_fn`` gets the exactly dequantised
    float weights, so ``"xla"`` computes what the dequantised float-expert model computes.
    ``expert_qat``: the float weights pass through :func:`qat_expert_weights` before any
    ``experts_fn``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        e, de, i = config.num_experts, config.expert_hidden_size, config.moe_intermediate_size
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                                 out_axis=-1, batch_axis=(0,))
        pdt = dtype_of(config.param_dtype)
        up_axes = ("experts", "expert_embed", "expert_mlp")
        down_axes = ("experts", "expert_mlp", "expert_embed")
        self.packed = config.expert_weight_format == "mxfp4"
        if not self.packed:
            self.w1 = param(rngs, init, (e, de, i), up_axes, pdt)
            self.w3 = param(rngs, init, (e, de, i), up_axes, pdt)
            self.w2 = param(rngs, init, (e, i, de), down_axes, pdt)
            return
        for name, (n, k) in expert_matrix_shapes(config).items():
            axes = (up_axes[0], up_axes[2], up_axes[1]) if name != "w2" else (
                down_axes[0], down_axes[2], down_axes[1])                       # [E, N, K]
            packed, scale = pack_expert_weight(init(rngs.params(), (e, k, n), jnp.float32))
            setattr(self, f"{name}_packed", PackedExpertWeight(packed, axes=axes,
                                                               param_count=e * n * k))
            setattr(self, f"{name}_scale", PackedExpertWeight(scale, axes=axes, param_count=0))

    def float_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(w1, w3, w2)`` of float experts as the ``[E, in, out]`` weights the layer multiplies
        by: fake-quantised (QAT) or as stored (MXFP4 experts: :meth:`packed_matrices`)."""
        ws = (self.w1[...], self.w3[...], self.w2[...])
        return qat_expert_weights(*map(own, ws)) if self.config.expert_qat else ws

    def packed_matrices(self) -> tuple[PackedMatrix, PackedMatrix, PackedMatrix]:
        """``(w1, w3, w2)`` of MXFP4 experts as their bytes (:class:`PackedMatrix`): the
        expert-parallel path multiplies them inside its ``shard_map``, each device its own
        experts' bytes, never a dequantised copy of the layer."""
        return tuple(PackedMatrix(getattr(self, f"{n}_packed")[...],
                                  getattr(self, f"{n}_scale")[...], self.config.moe_impl)
                     for n in ("w1", "w3", "w2"))

    def __call__(self, z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, *,
                 experts_fn: ExpertsFn = experts_routed) -> jax.Array:
        """All experts on every device: the path without expert parallelism (and
        ``MoE.reference``'s one-hot experts under any rules). Under a layout's rules their FSDP
        shards are gathered first, as for any weight. Left sharded, XLA's partitioner carried
        the weights' split model dim into the gathered token rows and could then only
        replicate them ("involuntary full rematerialization", ``fsdp=2,sequence=4``)."""
        if not self.packed:
            return experts_fn(z, topk_idx, topk_weight, *map(_whole, self.float_weights()),
                              self.config)
        # the bytes gathered whole, not their 4x wider dequantisation
        mats = [PackedMatrix(_whole(m.packed), _whole(m.scale), m.impl)
                for m in self.packed_matrices()]
        if experts_fn is experts_routed and self.config.moe_impl == "pallas":
            return experts_per_device(z, topk_idx, topk_weight, *mats, self.config)
        dt = dtype_of(self.config.compute_dtype)
        return experts_fn(z, topk_idx, topk_weight,
                          *(unpack_expert_weight(m.packed, m.scale, dt) for m in mats),
                          self.config)


def _whole(w):
    """``w`` (an array or a :class:`StackedWeight`'s stack) replicated on every device under a
    layout's rules; as it is without rules."""
    if isinstance(w, StackedWeight):
        return StackedWeight(_whole(w.stack), w.layer)
    return constrain(w, (None,) * w.ndim)


class MoE(nnx.Module):
    """Routed (optionally latent) experts plus shared experts; see the module docstring.

    ``__call__(x [B, T, D], *, token_mask [B, T] | None) -> (y [B, T, D], metrics)`` with
    ``metrics["expert_load"]`` float32 ``[E]`` (assignments of valid tokens) and
    ``metrics["max_load_ratio"]`` (max / mean load). Masked tokens are still computed (their
    outputs are meaningful, just excluded from the load statistics).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.num_experts < 1:
            raise ValueError(f"MoE needs num_experts >= 1, got {config.num_experts}")
        self.config = config
        d, de = config.hidden_size, config.expert_hidden_size
        kw = dict(rngs=rngs, param_dtype=dtype_of(config.param_dtype),
                  compute_dtype=dtype_of(config.compute_dtype))
        self.gate = Router(config, rngs=rngs)
        self.experts = RoutedExperts(config, rngs=rngs)
        latent = config.routed_expert_hidden_size is not None
        self.routed_expert_down_proj = (Linear(d, de, axes=("embed", "expert_embed"), **kw)
                                        if latent else None)
        self.routed_expert_norm = (RMSNorm(de, eps=config.rms_norm_eps,
                                           param_dtype=dtype_of(config.param_dtype))
                                   if latent and config.latent_moe_use_norm else None)
        self.routed_expert_up_proj = (Linear(de, d, axes=("expert_embed", "embed"), **kw)
                                      if latent else None)
        self.shared_experts = (
            DenseFFN(config, config.moe_intermediate_size * config.num_shared_experts, rngs=rngs)
            if config.num_shared_experts > 0 else None)

    def __call__(self, x: jax.Array, *, token_mask: jax.Array | None = None,
                 expert_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """``expert_ids [B, T, k]``: use these experts instead of the router's top-k (routing
        replay); the gate weights still come from the current router."""
        return self._forward(x, token_mask, experts_routed, expert_ids)

    def reference(self, x: jax.Array, *, token_mask: jax.Array | None = None,
                  expert_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Same layer with the one-hot dense expert computation (tests, debugging)."""
        return self._forward(x, token_mask, experts_one_hot, expert_ids)

    def _routed(self, z, topk_idx, topk_weight, experts_fn: ExpertsFn,
                token_mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """The routed experts ``[N, De]`` and, under expert parallelism (the active rules shard
        the experts), ``{"moe_dropped": [] int32}``; ``{}`` on one device. Under a capacity
        factor, tokens outside ``token_mask [N]`` (padding) are not dispatched (routed output
        0): they would take capacity from real tokens."""
        sharded = expert_parallel_experts() if experts_fn is experts_routed else None
        if sharded is None:
            return self.experts(z, topk_idx, topk_weight, experts_fn=experts_fn), {}
        if token_mask is not None and current_sharding().moe_capacity_factor is not None:
            topk_idx = jnp.where(token_mask[:, None], topk_idx, self.config.num_experts)
        weights = (self.experts.packed_matrices() if self.experts.packed
                   else self.experts.float_weights())
        return sharded(z, topk_idx, topk_weight, *weights, self.config)

    def _forward(self, x: jax.Array, token_mask: jax.Array | None, experts_fn: ExpertsFn,
                 expert_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
        c = self.config
        if x.ndim != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"MoE expects x [B, T, D={c.hidden_size}], got {x.shape}")
        b, t, d = x.shape
        if token_mask is not None and token_mask.shape != (b, t):
            raise ValueError(f"token_mask must be [B={b}, T={t}], got {token_mask.shape}")
        cdt = dtype_of(c.compute_dtype)
        flatten, unflatten = token_order(b, t)  # [B, T, ...] <-> [N, ...]
        xf = flatten(x).astype(cdt)  # [N, D]
        if expert_ids is not None:
            if expert_ids.shape != (b, t, c.num_experts_per_token):
                raise ValueError(f"expert_ids must be [B={b}, T={t}, k="
                                 f"{c.num_experts_per_token}], got {expert_ids.shape}")
            expert_ids = flatten(expert_ids).astype(jnp.int32)
        topk_idx, topk_weight, scores = self.gate(xf, expert_ids)  # [N, k], [N, k], [N, E]
        z = self.routed_expert_down_proj(xf) if self.routed_expert_down_proj is not None else xf
        mask = None if token_mask is None else flatten(token_mask)
        r, ep_metrics = self._routed(z, topk_idx, topk_weight, experts_fn, mask)  # [N, De]
        if self.routed_expert_norm is not None:
            r = self.routed_expert_norm(r)
        if self.routed_expert_up_proj is not None:
            r = self.routed_expert_up_proj(r)  # [N, D]
        if self.shared_experts is not None:
            r = r + self.shared_experts(xf)
        load = expert_load(topk_idx, c.num_experts, mask)  # [E]
        metrics = {"expert_load": load, "max_load_ratio": max_load_ratio(load), **ep_metrics,
                   "expert_ids": unflatten(topk_idx)}  # [B, T, k] the experts used
        if expert_ids is not None:  # routing replay: how often the router agrees with the record
            own = router_topk(scores, self.gate.e_score_correction_bias[...], c)
            agree = replay_agreement(topk_idx, own)  # [N]
            w = (jnp.ones_like(agree) if mask is None else mask.astype(jnp.float32)) * (
                replayed_rows(expert_ids))
            metrics["replay_agreement"] = jnp.stack([jnp.sum(agree * w), jnp.sum(w)])  # [2]
        return unflatten(r.astype(cdt)), metrics
