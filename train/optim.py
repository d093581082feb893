"""Optimizers: AdamW, or Muon on matrices with AdamW on the rest; global-norm clipping; schedule.

Learning rate (``schedule="cosine"``): linear warm-up from 0 to the peak over ``warmup_steps``,
then cosine decay to ``min_lr_ratio * peak`` at ``decay_steps`` (``optax.warmup_cosine_decay_
schedule``); ``"constant"`` keeps the warm-up then holds the peak.

Chain: ``clip_by_global_norm(clip_norm)`` (on the gradients of the trainable set, before any
moment) -> AdamW or Muon.

Muon (Jordan 2024; Liu et al. 2025 "Muon is Scalable for LLM Training" / Moonlight,
arXiv 2502.16982): momentum, then the update of every weight matrix is orthogonalised by five
Newton-Schulz iterations; ``consistent_rms=0.2`` rescales by ``0.2 * sqrt(max(fan_in, fan_out))``
so its RMS matches AdamW (Moonlight section 2.2) and AdamW's learning rate and weight decay carry
over. We use ``optax.contrib.muon``. Which parameters are matrices is read from the logical axis
names (``layers.py`` glossary): the stacked-layer axis ``layers`` and the expert axis ``experts``
are batch axes, and a parameter whose remaining dims are exactly two is a matrix (kernels are
``[in, out]``: reduction over ``in``). The token embedding and the LM head stay on AdamW, as in
Moonlight; so do norms, biases and other vectors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, muon

from kdsa.train.config import TrainConfig

BATCH_AXES = ("layers", "experts")
ADAMW_ONLY = ("embed_tokens", "lm_head")  # Moonlight: embedding and head on AdamW


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Step -> learning rate (warm-up, then cosine or constant)."""
    peak = tc.learning_rate
    if tc.schedule == "constant":
        if tc.warmup == 0:
            return optax.constant_schedule(peak)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, tc.warmup), optax.constant_schedule(peak)],
            [tc.warmup])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=tc.warmup,
        decay_steps=tc.total_decay_steps, end_value=peak * tc.min_lr_ratio)


def matrix_dims(path: tuple, axes: tuple | None, ndim: int) -> MuonDimensionNumbers | None:
    """Muon dimension numbers for one parameter, or None for AdamW.

    ``axes`` are the parameter's logical names; leading ``layers``/``experts`` axes are batch.
    """
    if any(str(k) in ADAMW_ONLY for k in path):
        return None
    axes = tuple(axes) if axes is not None else (None,) * ndim
    if len(axes) < ndim:  # the stack adds leading layer axes without naming them
        axes = ("layers",) * (ndim - len(axes)) + axes
    core = [i for i, a in enumerate(axes) if a not in BATCH_AXES]
    if len(core) != 2:
        return None
    return MuonDimensionNumbers(reduction_axis=core[0], output_axis=core[1])


def muon_dims_tree(params: nnx.State) -> nnx.State:
    """Same structure as ``nnx.as_pure(params)``: per leaf its dims (None = AdamW)."""
    def one(path, var):
        axes = var.get_metadata().get("axes") if isinstance(var, nnx.Variable) else None
        ndim = len(var.get_value().shape) if isinstance(var, nnx.Variable) else jnp.ndim(var)
        return matrix_dims(tuple(getattr(k, "key", k) for k in path), axes, ndim)

    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def decay_mask(params) -> object:
    """AdamW weight decay on matrices and embeddings (ndim >= 2), not on norms and biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(tc: TrainConfig, params: nnx.State | None = None
                   ) -> optax.GradientTransformation:
    """The optax chain for ``tc``. ``params`` (with ``axes`` metadata) is needed for Muon.

    Cached per (config, dims) so repeated runs in one process reuse the compiled train step.
    """
    dims = None
    if tc.optimizer == "muon":
        if params is None:
            raise ValueError("optimizer='muon' needs the parameter tree (axes metadata)")
        dims = _Hashable(muon_dims_tree(params))
    return _make(tc, dims)


class _Hashable:
    """A dims tree compared by its flattened content (for the cache key)."""

    def __init__(self, tree):
        self.tree = tree
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None or isinstance(
            x, MuonDimensionNumbers))
        self._key = (str(treedef), tuple(None if d is None else tuple(d) for d in leaves))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self._key == other._key


@functools.lru_cache(maxsize=16)
def _make(tc: TrainConfig, dims: _Hashable | None) -> optax.GradientTransformation:
    lr = learning_rate_schedule(tc)
    if tc.optimizer == "adamw":
        opt = optax.adamw(lr, b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay,
                          mask=decay_mask)
    else:
        dims_tree = dims.tree
        opt = muon(lr, ns_steps=tc.muon_ns_steps, beta=tc.muon_beta, eps=tc.eps,
                   weight_decay=tc.weight_decay, adam_b1=tc.b1, adam_b2=tc.b2,
                   adam_weight_decay=0.0, muon_weight_dimension_numbers=lambda _: dims_tree,
                   consistent_rms=tc.muon_consistent_rms)
    clip = optax.clip_by_global_norm(tc.clip_norm) if tc.clip_norm > 0 else optax.identity()
    return optax.chain(clip, opt)
