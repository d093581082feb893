"""Indexer training stages: the dense warm-up's parameter filter moves only indexer weights."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from kdsa.model.config import get_preset
from kdsa.model.dsa_layer import INDEXER_PARAMS, GatedDSA, indexer_stage_params


def test_dense_warmup_step_updates_only_the_indexer():
    cfg = get_preset("tiny")
    layer = GatedDSA(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 20, cfg.hidden_size))
    pos = jax.numpy.broadcast_to(jax.numpy.arange(20), (2, 20))
    snapshot = lambda: {"/".join(map(str, p)): np.array(v[...])  # copies, not live views
                        for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    before = snapshot()
    opt = nnx.Optimizer(layer, optax.sgd(1.0), wrt=indexer_stage_params("dense_warmup"))

    @nnx.jit
    def step(layer, opt, x):
        def loss(layer):
            return layer(x, positions=pos, indexer_loss="dense")[2]["indexer_kl"]

        kl, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, INDEXER_PARAMS))(layer)
        opt.update(layer, grads)
        return kl

    kls = [float(step(layer, opt, x)) for _ in range(3)]
    assert kls[0] > 0 and kls[-1] < kls[0], kls  # the indexer learns the attention
    after = snapshot()
    moved = {name for name in before if not np.array_equal(before[name], after[name])}
    assert moved and all("indexer" in name for name in moved), moved
    assert len(moved) == len(nnx.to_flat_state(nnx.state(layer, INDEXER_PARAMS)))


def test_stage_names():
    assert indexer_stage_params("sparse") is nnx.Param
    with pytest.raises(ValueError, match="dense_warmup"):
        indexer_stage_params("warm")
