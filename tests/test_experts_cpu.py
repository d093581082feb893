"""CPU routed-expert paths (``kdsa.model.experts_cpu``) against the one-hot dense reference.

The reference (:func:`kdsa.model.moe.experts_one_hot`) sends every token through every expert
and combines with a ``[N, E]`` weight matrix: no sort, no padding, no scan, no custom VJP. The
blocked path is checked with balanced and skewed routing (every assignment on one expert, an
expert with no rows), block sizes that leave many blocks unused, values and the gradients of
z, the routing weights and every expert weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdsa.kernels_pallas.common import compile_target
from kdsa.model import experts_cpu, moe as moe_lib
from kdsa.model.config import get_preset

TINY = get_preset("tiny")  # 8 experts top-2, latent 32, intermediate 32, SiTU


def _case(n: int, routing: str, seed: int = 0, e: int = 8, k: int = 2):
    c = TINY.replace(num_experts=e, num_experts_per_token=k)
    de, i = c.expert_hidden_size, c.moe_intermediate_size
    ks = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(ks[0], (n, de), jnp.float32)
    if routing == "random":
        idx = jnp.argsort(jax.random.uniform(ks[1], (n, e)), axis=-1)[:, :k]
    elif routing == "one_expert":  # expert 3 gets every token; the rest of each top-k spread
        rest = (jnp.arange(n)[:, None] + jnp.arange(1, k)[None]) % (e - 1)
        idx = jnp.concatenate([jnp.full((n, 1), 3), jnp.where(rest >= 3, rest + 1, rest)], 1)
    else:  # "skip_expert": expert 0 gets nothing
        idx = 1 + jnp.argsort(jax.random.uniform(ks[1], (n, e - 1)), axis=-1)[:, :k]
    wt = jax.random.uniform(ks[2], (n, k), jnp.float32, 0.1, 1.0)
    w1 = jax.random.normal(ks[3], (e, de, i), jnp.float32) * de ** -0.5
    w3 = jax.random.normal(ks[4], (e, de, i), jnp.float32) * de ** -0.5
    w2 = jax.random.normal(ks[5], (e, i, de), jnp.float32) * i ** -0.5
    return c, (z, idx.astype(jnp.int32), wt, w1, w3, w2)


def _loss(fn, c):
    def loss(z, wt, w1, w3, w2, idx):
        y = fn(z, idx, wt, w1, w3, w2, c)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _compare(fn, c, args, rtol=2e-6):
    z, idx, wt, w1, w3, w2 = args
    (val, grads) = _loss(fn, c)(z, wt, w1, w3, w2, idx)
    (ref_val, ref_grads) = _loss(moe_lib.experts_one_hot, c)(z, wt, w1, w3, w2, idx)
    y = jax.jit(lambda *a: fn(*a, c))(*args)
    y_ref = jax.jit(lambda *a: moe_lib.experts_one_hot(*a, c))(*args)
    np.testing.assert_allclose(y, y_ref, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(y_ref))))
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for name, g, r in zip(("z", "weights", "w1", "w3", "w2"), grads, ref_grads):
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0, name
        np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * scale, err_msg=name)


@pytest.mark.parametrize("routing", ["random", "one_expert", "skip_expert"])
@pytest.mark.parametrize("block", [8, 32])
def test_blocked_matches_one_hot(routing, block):
    c, args = _case(40, routing)
    _compare(lambda *a: experts_cpu.experts_blocked(*a, block=block), c, args)


def test_blocked_default_block_and_top1():
    c, args = _case(97, "random", seed=1, e=4, k=1)
    assert experts_cpu.block_rows(97, 4) == 8
    _compare(experts_cpu.experts_blocked, c, args)


def test_batched_matches_one_hot():
    c, args = _case(8, "random", seed=2)
    _compare(experts_cpu.experts_batched, c, args)


def test_bfloat16_close_to_float32():
    c, args = _case(40, "random", seed=3)
    args16 = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args)
    y32 = moe_lib.experts_one_hot(*args, c)
    for fn in (experts_cpu.experts_blocked, experts_cpu.experts_batched):
        y16 = jax.jit(lambda *a, fn=fn: fn(*a, c))(*args16)
        assert y16.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(y16.astype(jnp.float32) - y32)) / jnp.max(jnp.abs(y32)))
        assert err < 2e-2, (fn.__name__, err)


def test_block_rows():
    assert experts_cpu.block_rows(2048, 4) == 256
    assert experts_cpu.block_rows(512, 4) == 64
    assert experts_cpu.block_rows(100_000, 4) == experts_cpu.MAX_BLOCK_ROWS
    assert experts_cpu.block_rows(16, 896) == 8


def _primitives(fn, c, args) -> set[str]:
    return {str(eq.primitive) for eq in jax.make_jaxpr(lambda *a: fn(*a, c))(*args).eqns}


def test_cpu_picks_batched_for_few_tokens_and_blocked_otherwise():
    c, few = _case(8, "random")
    _, many = _case(300, "random")
    assert "custom_vjp_call" not in _primitives(experts_cpu.experts_cpu, c, few)
    assert "custom_vjp_call" in _primitives(experts_cpu.experts_cpu, c, many)
    # Many experts, one token: reading every expert would cost more than two blocks
    many_e, one = _case(1, "random", e=64, k=2)
    assert "custom_vjp_call" in _primitives(experts_cpu.experts_cpu, many_e, one)


def test_routed_follows_the_compile_target():
    c, args = _case(16, "random")
    assert moe_lib.compile_platform() == "cpu"
    assert "ragged_dot_general" not in _primitives(moe_lib.experts_routed, c, args)
    with compile_target("tpu"):
        assert moe_lib.compile_platform() == "tpu"
        assert "ragged_dot_general" in _primitives(moe_lib.experts_routed, c, args)


def test_bf16_weight_gradients_are_summed_in_float32():
    """Every one of 16,384 tokens on one expert: 64 blocks of rows, whose weight gradients
    were summed in the compute dtype. In bfloat16 that running sum cost a relative 1.9-2.2e-2
    against the float32 reference; summed in float32 it is 5.1-5.4e-3, bf16's own rounding
    (measured 2026-12-06)."""
    c, (z, idx, wt, w1, w3, w2) = _case(16384, "one_expert")
    bf16 = c.replace(compute_dtype="bfloat16")
    _, grads = _loss(experts_cpu.experts_cpu, bf16)(z.astype(jnp.bfloat16), wt, w1, w3, w2, idx)
    _, ref = _loss(moe_lib.experts_one_hot, c)(z, wt, w1, w3, w2, idx)
    for name, g, r in list(zip(("w1", "w3", "w2"), grads[2:], ref[2:])):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.abs(g - r).max() / np.abs(r).max() < 1e-2, name
