"""The MoonViT-style vision tower: patch embedding + interpolated position grid, pre-norm
transformer blocks with 2-D RoPE, final norm (``kimi_k3.md`` 5; vLLM ``kimi_k25_vit.py``
``MoonViT3dPretrainedModel`` for ``t = 1`` images).

Parameter names mirror the checkpoint under ``vision_tower.``: ``patch_embed.proj`` (conv
``[D, 3, p, p]`` stored here as ``kernel [3, p, p, D]`` + ``bias``), ``patch_embed.pos_emb.weight
[Hg, Wg, D]``, ``encoder.blocks.{i}.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}``,
``encoder.final_layernorm``. Per block (pre-norm)::

    x = x + wo(attn(rope2d(q), rope2d(k), v))      q, k, v = split(wqkv(norm0(x)))  [P, 3, H, d]
    x = x + fc1(gelu_tanh(fc0(norm1(x))))

Images are packed, not padded to a square: the input is ``[B, P]`` patches per row (several
images per row, each a run of patches with its own ``segment`` id, 0 = padding); attention is
masked to the patches of the same image (vLLM uses ``cu_seqlens`` for the same effect), scale
``d^-0.5``, in tiles beyond 512 patches (``attention.py``: a 65K-patch image's scores do not fit
whole). Logical axes: ``vision_embed`` (tower width), ``vision_heads`` (attention width),
``vision_mlp`` (block MLP and projector hidden).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.model.layers import LayerNorm, Linear, RMSNorm, dtype_of, param
from kdsa.model.vision.attention import vision_attention
from kdsa.model.vision.position import apply_rope_2d, interpolate_pos_emb, rope_2d_angles


def _norm(vc, dim: int):
    if vc.norm_type == "layernorm":
        return LayerNorm(dim, eps=vc.norm_eps)
    return RMSNorm(dim, eps=vc.norm_eps)


class PatchProj(nnx.Module):
    """The patch conv as a matmul over flattened ``(channel, row, col)`` patches."""

    def __init__(self, vc, *, rngs: nnx.Rngs, param_dtype, compute_dtype):
        p, d = vc.patch_size, vc.hidden_size
        self.compute_dtype = compute_dtype
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                 in_axis=(0, 1, 2), out_axis=3)
        self.kernel = param(rngs, init, (3, p, p, d), (None, None, None, "vision_embed"),
                            param_dtype)
        self.bias = (nnx.Param(jnp.zeros((d,), param_dtype), axes=("vision_embed",))
                     if vc.patch_embed_proj_bias else None)

    def __call__(self, patches: jax.Array) -> jax.Array:               # [..., 3 p p] -> [..., D]
        w = self.kernel[...].astype(self.compute_dtype).reshape(-1, self.kernel.shape[-1])
        y = patches.astype(self.compute_dtype) @ w
        return y if self.bias is None else y + self.bias[...].astype(self.compute_dtype)


class PosEmb(nnx.Module):
    def __init__(self, vc, *, rngs: nnx.Rngs, param_dtype):
        shape = (vc.init_pos_emb_height, vc.init_pos_emb_width, vc.hidden_size)
        self.weight = param(rngs, nnx.initializers.normal(0.02), shape,
                            (None, None, "vision_embed"), param_dtype)

    def __call__(self, pos: jax.Array, grid: jax.Array) -> jax.Array:
        return interpolate_pos_emb(self.weight[...], pos, grid)


class PatchEmbed(nnx.Module):
    def __init__(self, vc, *, rngs: nnx.Rngs, param_dtype, compute_dtype):
        self.proj = PatchProj(vc, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.pos_emb = PosEmb(vc, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, patches, pos, grid):
        x = self.proj(patches)
        return x + self.pos_emb(pos, grid).astype(x.dtype)


class VisionMLP(nnx.Module):
    def __init__(self, vc, *, rngs: nnx.Rngs, **dt):
        d, f = vc.hidden_size, vc.intermediate_size
        self.fc0 = Linear(d, f, axes=("vision_embed", "vision_mlp"), rngs=rngs,
                          use_bias=vc.linear_bias, **dt)
        self.fc1 = Linear(f, d, axes=("vision_mlp", "vision_embed"), rngs=rngs,
                          use_bias=vc.linear_bias, **dt)

    def __call__(self, x):
        return self.fc1(jax.nn.gelu(self.fc0(x), approximate=True))  # gelu_pytorch_tanh


class VisionBlock(nnx.Module):
    def __init__(self, vc, *, rngs: nnx.Rngs, **dt):
        self.num_heads, self.head_dim, self.theta = vc.num_attention_heads, vc.head_dim, \
            vc.rope_theta
        self.norm0 = _norm(vc, vc.hidden_size)
        self.wqkv = Linear(vc.hidden_size, 3 * vc.attn_width, axes=("vision_embed", "vision_heads"),
                           rngs=rngs, use_bias=vc.attn_bias, **dt)
        self.wo = Linear(vc.attn_width, vc.hidden_size, axes=("vision_heads", "vision_embed"),
                         rngs=rngs, use_bias=vc.attn_bias, **dt)
        self.norm1 = _norm(vc, vc.hidden_size)
        self.mlp = VisionMLP(vc, rngs=rngs, **dt)

    def __call__(self, x, angles, segment):                  # x [B, P, D], angles [B, P, d/2]
        b, p, _ = x.shape
        qkv = self.wqkv(self.norm0(x)).reshape(b, p, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                  # [B, P, H, d]
        o = vision_attention(apply_rope_2d(q, angles), apply_rope_2d(k, angles), v, segment)
        x = x + self.wo(o.reshape(b, p, -1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nnx.Module):
    def __init__(self, vc, *, rngs: nnx.Rngs, **dt):
        self.blocks = nnx.List([VisionBlock(vc, rngs=rngs, **dt)
                                for _ in range(vc.num_hidden_layers)])
        self.final_layernorm = _norm(vc, vc.hidden_size)

    def __call__(self, x, angles, segment):
        for block in self.blocks:
            x = block(x, angles, segment)
        return self.final_layernorm(x)


class VisionTower(nnx.Module):
    """``(patches [B, P, 3 p p], pos [B, P, 2], grid [B, P, 2], segment [B, P]) -> [B, P, D]``."""

    def __init__(self, vc, *, rngs: nnx.Rngs, param_dtype: str = "float32",
                 compute_dtype: str = "float32"):
        self.config = vc
        dt = {"param_dtype": dtype_of(param_dtype), "compute_dtype": dtype_of(compute_dtype)}
        self.patch_embed = PatchEmbed(vc, rngs=rngs, **dt)
        self.encoder = VisionEncoder(vc, rngs=rngs, **dt)

    def __call__(self, patches, pos, grid, segment):
        x = self.patch_embed(patches, pos, grid)
        angles = rope_2d_angles(pos, self.config.head_dim, self.config.rope_theta)
        return self.encoder(x, angles, segment)
