"""Basic layers: Linear, RMSNorm, Embed; parameters carry logical axis names.

Every parameter is an ``nnx.Param`` (or another ``nnx.Variable``) whose metadata ``axes`` is a
tuple of logical axis names, one per dimension (``None`` = never sharded). Only
``kdsa.sharding`` maps logical names to mesh axes. The glossary of logical names:

| name | what |
|---|---|
| ``embed`` | model width D |
| ``vocab`` | vocabulary |
| ``mlp`` | dense / shared-expert FFN hidden |
| ``heads`` | attention or KDA heads x head dim (flattened projection outputs) |
| ``q_lora``, ``kv_lora`` | MLA low-rank latents |
| ``index_heads`` | indexer heads x index dim |
| ``experts`` | routed-expert axis E |
| ``expert_embed`` | width the routed experts run in (latent MoE) |
| ``expert_mlp`` | routed-expert FFN hidden |
| ``vision_embed`` | vision tower width (``model/vision``) |
| ``vision_heads`` | vision attention width (q, k, v heads x head dim) |
| ``vision_mlp`` | vision block MLP hidden and projector hidden |
| ``layers`` | the stacked (scanned) layer axis, added by the stack |

Kernels are stored ``[in, out]``; Hugging Face stores ``[out, in]`` (conversion transposes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from kdsa.model.partitioning import current, spec_axes, spec_entry

Axes = tuple[str | None, ...]


def dtype_of(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: Axes, dtype) -> nnx.Param:
    """A parameter initialised with ``init(key, shape, dtype)`` and tagged with logical ``axes``."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


def lecun_init(fan_in_axes: int = 1):
    """Truncated-normal variance scaling over the first ``fan_in_axes`` dims (in-features)."""
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=tuple(range(fan_in_axes)),
        out_axis=-1)


class Linear(nnx.Module):
    """``y[..., out] = x[..., in] @ kernel[in, out]`` (+ bias), computed in ``compute_dtype``."""

    def __init__(self, in_features: int, out_features: int, *, axes: Axes,
                 rngs: nnx.Rngs, param_dtype=jnp.float32, compute_dtype=jnp.float32,
                 use_bias: bool = False, init=None):
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.kernel = param(rngs, init or lecun_init(), (in_features, out_features), axes,
                            param_dtype)
        self.bias = (nnx.Param(jnp.zeros((out_features,), param_dtype), axes=(axes[1],))
                     if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x.astype(self.compute_dtype),
                       self.kernel[...].astype(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.compute_dtype)
        return y


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis, in float32, cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, axes: Axes = (None,), param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), axes=axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias, in float32 (the DSA indexer's ``k_norm``)."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), axes=(None,))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=(None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding ``[vocab, D]``; ``attend`` gives tied-head logits."""

    def __init__(self, vocab_size: int, dim: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 compute_dtype=jnp.float32, stddev: float = 1.0):
        self.compute_dtype = compute_dtype
        self.embedding = param(rngs, nnx.initializers.normal(stddev), (vocab_size, dim),
                               ("vocab", "embed"), param_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return embedding_rows(self.embedding[...], ids).astype(self.compute_dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...d,vd->...v", x.astype(self.compute_dtype),
                          self.embedding[...].astype(self.compute_dtype))


def embedding_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table [V, D]`` rows at ``ids [B, T]``: ``[B, T, D]``.

    Under a layout's rules that split the table's model dim ``D`` (FSDP: ``train``'s
    ``embed`` over ``fsdp, expert``) the gather keeps that split: every device takes the rows
    of the tokens on the other axes (the ids gathered over the width's axes, a few bytes per
    token) for its slice of ``D``, and leaves ``[B, T, D/w]`` for the caller's batch layout, an
    all-to-all of activation size. Left to itself XLA's partitioner produced the same
    width-split rows but then found no collective to the batch layout and replicated them
    ("involuntary full rematerialization", ``tests/test_sharding.py``); gathering the whole
    table instead (FSDP's weight all-gather) would move ``V x D`` per step, 2.35 GB at K3's
    163,840 x 7,168 in bfloat16 against 58.7 MB for 4,096 tokens' rows."""
    ctx = current()
    if ctx is None or ids.ndim != 2:
        return jnp.take(table, ids, axis=0)
    width = ctx.spec(("vocab", "embed"), table.shape)[1]
    tokens = ctx.spec(("act_batch", "act_seq"), ids.shape)
    spec = tuple(spec_entry(tuple(a for a in spec_axes(e) if a not in spec_axes(width)))
                 for e in tokens)  # the tokens' layout less the width's axes
    ids = jax.lax.with_sharding_constraint(ids, NamedSharding(ctx.mesh, P(*spec)))
    rows = jnp.take(table, ids, axis=0)
    return jax.lax.with_sharding_constraint(rows, NamedSharding(ctx.mesh, P(*spec, width)))


def inverse_permutation(order: jax.Array) -> jax.Array:
    """``inverse[order[i]] = i`` for a permutation ``order`` ``[M]``, as a sort rather than a
    scatter: XLA combines two such scatters into the same zeros into one variadic scatter,
    which XLA:TPU (libtpu 0.0.52) aborts on (scatter_emitter "operand_indices.size() == 1"),
    found compiling the expert-parallel generate step for v5e (``infer/aot.py``)."""
    return jnp.argsort(order, stable=True).astype(order.dtype)
