"""Routed experts read through their scan's whole stack (``model/stacked_experts.py``): the
grouped matmul over the flat stack equals the one over the layer's slice, on one device, under
expert parallelism, and for a whole model's prefill and decode."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may load it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.model import moe as moe_lib  # noqa: E402
from kdsa.model import stacked_experts as se  # noqa: E402
from kdsa.model import transformer as transformer_lib  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.expert_parallel import experts_sharded  # noqa: E402
from kdsa.model.overrides import apply_overrides  # noqa: E402
from kdsa.sharding.constrain import use_sharding  # noqa: E402
from kdsa.sharding.mesh import make_mesh  # noqa: E402

TINY = get_preset("tiny")


def _stacks(r=3, seed=0):
    e, de, i = TINY.num_experts, TINY.expert_hidden_size, TINY.moe_intermediate_size
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (r,) + s) * 0.2
            for k, s in zip(ks, ((e, de, i), (e, de, i), (e, i, de)))]


def test_ragged_dot_through_the_stack_equals_the_layers_slice():
    """Every layer of a 3-deep stack, with rows past the groups' total (left out of every
    group)."""
    stack = _stacks()[0]                                                      # [3, E, De, I]
    e = stack.shape[1]
    x = jax.random.normal(jax.random.key(1), (13, stack.shape[2]))
    sizes = jnp.asarray([3, 0, 4, 1] + [0] * (e - 5) + [2], jnp.int32)  # 10 of 13 rows
    for layer in range(3):
        w = se.StackedWeight(stack, jnp.int32(layer))
        assert w.shape == stack.shape[1:] and w[...] is w
        got = jax.jit(se.ragged_dot, static_argnums=3)(x, w, sizes, jnp.float32)
        want = jax.lax.ragged_dot(x, stack[layer], sizes)
        # two programs: equal under JAX 0.12.0, within 5e-7 under 0.12.1 (a layer off by one
        # would differ by O(1))
        np.testing.assert_allclose(np.asarray(got)[:10], np.asarray(want)[:10], rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_array_equal(np.asarray(se.own(w)), np.asarray(stack[layer]))
    with pytest.raises(TypeError, match="read whole"):
        se.StackedWeight(stack, 0)[0]


@pytest.mark.parametrize("mesh_spec,layout", [("expert=4,data=2", "generate"),
                                              ("expert=4,tensor=2", "train")])
def test_expert_parallel_reads_the_stack(mesh_spec, layout):
    """``experts_sharded`` with the stacks split behind their repeat axis (the replicated
    tokens of the generate layout, the padded exchange of train) equals ``experts_ragged`` on
    the layer's own weights."""
    n, k = 32, TINY.num_experts_per_token
    stacks = _stacks()
    ks = jax.random.split(jax.random.key(2), 3)
    z = jax.random.normal(ks[0], (n, TINY.expert_hidden_size))
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, TINY.num_experts)[:k])(
        jax.random.split(ks[1], n)).astype(jnp.int32)
    w = jax.random.uniform(ks[2], (n, k))
    want = moe_lib.experts_ragged(z, idx, w, *(s[1] for s in stacks), TINY)
    with use_sharding(make_mesh(mesh_spec), layout, collectives="padded") as ctx:
        got, _ = jax.jit(lambda z, idx, w, layer, *st: experts_sharded(
            z, idx, w, *(se.StackedWeight(s, layer) for s in st), TINY, ctx=ctx))(
            z, idx, w, jnp.int32(1), *stacks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_stacks_are_kept_on_tpu_unless_the_layout_splits_expert_embed():
    """On TPU devices (abstract ones: libtpu), not on CPU's, and not where the layout's FSDP
    splits ``expert_embed``."""
    pytest.importorskip("libtpu")
    from kdsa.sharding.aot import topology_devices

    tpu = topology_devices("v5e:2x4")
    with use_sharding(make_mesh("expert=2,tensor=4", devices=tpu), "generate"):
        assert se.keep_stacked()
    with use_sharding(make_mesh("expert=2,fsdp=4", devices=tpu), "train"):
        assert not se.keep_stacked()  # the shard_map would gather each whole stack
    with use_sharding(make_mesh("expert=2,tensor=4"), "generate"):
        assert not se.keep_stacked()  # CPU devices
    assert not se.keep_stacked()


def test_the_cached_scan_hands_moe_layers_their_stacks(monkeypatch):
    """Prefill and decode of a model whose 4 MoE layers are 2 repeats of a 2-layer period: with
    the stacks kept whole (as compiled for TPU; here forced on CPU, with the TPU's grouped
    matmul) the logits equal those from the layers' slices, and the grouped matmuls did get
    the stacks."""
    cfg = apply_overrides(TINY, ["num_hidden_layers=5", "linear_attn_config.kda_layers=[1, 3, 5]",
                                 "linear_attn_config.full_attn_layers=[2, 4]"])
    model = transformer_lib.Transformer(cfg, rngs=nnx.Rngs(0))
    assert model.segment_layout == ((0, 1, 1), (1, 2, 2))
    monkeypatch.setattr(moe_lib, "compile_platform", lambda: "tpu")  # experts_ragged
    seen = []

    def spy(x, w, *a):
        seen.append(isinstance(w, se.StackedWeight))
        return se.ragged_dot(x, w, *a)

    monkeypatch.setattr(moe_lib, "ragged_dot", spy)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))

    def run(keep):
        monkeypatch.setattr(transformer_lib, "keep_stacked", lambda: keep)
        seen.clear()
        out = model.forward(ids, pos, model.init_cache(2, 64))
        nxt = model.forward(ids[:, :1], jnp.full((2, 1), 20, jnp.int32), out.cache)
        return np.concatenate([np.asarray(out.logits).ravel(), np.asarray(nxt.logits).ravel()])

    want = run(False)
    assert seen and not any(seen)
    got = run(True)
    assert seen and all(seen)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
