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

Weight decay (AdamW, and Muon's matrices) applies to matrices and embeddings: parameters with
two or more dimensions besides the ``layers`` / ``experts`` batch axes, read from the same
logical axis names. Norm weights, biases and per-head vectors (KDA's ``A_log`` and ``dt_bias``)
are not decayed. (Until 2026-12-07 the rule was ``ndim >= 2``, and a scanned stack's leading
``layers`` axis made every stacked norm, bias and per-head vector two-dimensional: all decayed.)
With Muon, the parameters on its AdamW side (embedding, head, vectors) get no weight decay:
``optax.contrib.muon`` takes one unmasked ``adam_weight_decay`` for all of them.
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


def core_dims(axes: tuple | None, ndim: int) -> list[int]:
    """The dimensions of a parameter other than its batch axes (``layers``, ``experts``):
    ``axes`` are its logical names; a stack's leading layer axes may be unnamed."""
    axes = tuple(axes) if axes is not None else (None,) * ndim
    if len(axes) < ndim:  # the stack adds leading layer axes without naming them
        axes = ("layers",) * (ndim - len(axes)) + axes
    return [i for i, a in enumerate(axes) if a not in BATCH_AXES]


def matrix_dims(path: tuple, axes: tuple | None, ndim: int) -> MuonDimensionNumbers | None:
    """Muon dimension numbers for one parameter, or None for AdamW.

    ``axes`` are the parameter's logical names; leading ``layers``/``experts`` axes are batch.
    """
    if any(str(k) in ADAMW_ONLY for k in path):
        return None
    core = core_dims(axes, ndim)
    if len(core) != 2:
        return None
    return MuonDimensionNumbers(reduction_axis=core[0], output_axis=core[1])


def _per_leaf(params: nnx.State, fn) -> nnx.State:
    """Same structure as ``nnx.as_pure(params)``: ``fn(path, axes, ndim)`` per parameter."""
    def one(path, var):
        axes = var.get_metadata().get("axes") if isinstance(var, nnx.Variable) else None
        ndim = len(var.get_value().shape) if isinstance(var, nnx.Variable) else jnp.ndim(var)
        return fn(tuple(getattr(k, "key", k) for k in path), axes, ndim)

    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def muon_dims_tree(params: nnx.State) -> nnx.State:
    """Per parameter its Muon dims (None = AdamW)."""
    return _per_leaf(params, matrix_dims)


def decay_tree(params: nnx.State) -> nnx.State:
    """Per parameter whether weight decay applies: two or more dims besides the batch axes
    (matrices, embeddings, expert weights); not norms, biases, per-head vectors."""
    return _per_leaf(params, lambda path, axes, ndim: len(core_dims(axes, ndim)) >= 2)


def make_optimizer(tc: TrainConfig, params: nnx.State | None = None
                   ) -> optax.GradientTransformation:
    """The optax chain for ``tc``. ``params`` (with ``axes`` metadata) says which parameters
    are matrices (Muon) and which are decayed.

    Cached per (config, dims, decay) so repeated runs in one process reuse the compiled step.
    """
    if params is None:
        raise ValueError("make_optimizer needs the parameter tree (axes metadata)")
    dims = _Hashable(muon_dims_tree(params)) if tc.optimizer == "muon" else None
    return _make(tc, dims, _Hashable(decay_tree(params)))


class _Hashable:
    """A dims tree compared by its flattened content (for the cache key)."""

    def __init__(self, tree):
        self.tree = tree
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None or isinstance(
            x, MuonDimensionNumbers))
        self._key = (str(treedef), tuple(
            d if d is None or isinstance(d, bool) else tuple(d) for d in leaves))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self._key == other._key


@functools.lru_cache(maxsize=16)
def _make(tc: TrainConfig, dims: _Hashable | None, decay: _Hashable
          ) -> optax.GradientTransformation:
    lr = learning_rate_schedule(tc)
    if tc.optimizer == "adamw":
        opt = optax.adamw(lr, b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay,
                          mask=lambda _: decay.tree)
    else:
        dims_tree = dims.tree
        opt = muon(lr, ns_steps=tc.muon_ns_steps, beta=tc.muon_beta, eps=tc.eps,
                   weight_decay=tc.weight_decay, adam_b1=tc.b1, adam_b2=tc.b2,
                   adam_weight_decay=0.0, muon_weight_dimension_numbers=lambda _: dims_tree,
                   consistent_rms=tc.muon_consistent_rms)
    clip = optax.clip_by_global_norm(tc.clip_norm) if tc.clip_norm > 0 else optax.identity()
    return optax.chain(clip, opt)
