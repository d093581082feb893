"""One optimizer step: loss over micro-batches, exact gradient accumulation, update, bias update.

Loss (per optimizer step, over all ``M = accum_steps`` micro-batches together)::

    CE   = sum_{b,t} mask[b,t] * -log softmax(logits[b,t])[target[b,t]]  /  N,
           N = sum_{b,t} mask[b,t]                         (valid tokens of the whole batch)
    KL   = 1/M sum_i sum_l indexer_kl_i[l]                 (DSA indexer, per micro-batch mean)
    loss = CE + indexer_loss_weight * KL

Gradients are accumulated as sums, the denominator ``N`` applied once at the end: micro-batch
``i`` contributes ``grad(ce_sum_i + w * N / M * kl_i)``, and the step uses ``sum_i(...) / N``.
This is the gradient of the large-batch loss whatever the split of valid tokens between
micro-batches (tested: 4 micro-batches holding 16/3/9/12 valid tokens vs one batch: loss within
rtol 2e-6, grad norm 1e-5, parameters after one AdamW step within 2e-5 at lr 1e-2, routing
biases equal; CPU, float32).

Mixed precision: ``compute_dtype=bfloat16`` with ``param_dtype=float32`` keeps float32 master
weights and optimizer moments; measured on the 2-layer tiny model (with ``remat_policy=full``):
loss -6.6e-4 and grad norm x1.002 against float32 compute.

MoE (DeepSeek-V3 aux-loss-free balancing, report section 2.1.2): ``expert_load [L_moe, E]`` is
summed over the micro-batches and every ``e_score_correction_bias`` moves by
``update_routing_bias(bias, load, bias_update_rate)`` after the step; the bias is not a
``nnx.Param``, so the optimizer never sees it. The dense warm-up stage trains the indexer only
and leaves the biases alone.

The state is pure (``nnx.as_pure`` arrays): ``params`` (the trainable set of the indexer stage)
and ``rest`` (every other variable, incl. routing biases), so the step is a plain ``jax.jit``
function and the checkpoint a plain pytree.

Sharded (``docs/sharding.md``): called inside ``use_sharding(mesh, "train")`` with the state
placed by ``sharding.train_state.train_state_shardings`` and the batch by ``place_batch``, the
step pins micro-batch rows to the batch axes, the gradient sums and the new state to the
state's layout (so the next step reuses the compiled function) and the metrics to every device;
the model's own activation constraints and expert/sequence-parallel paths switch on by the
same context. Without the context nothing changes (one device).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from kdsa.model.dsa_layer import indexer_stage_params
from kdsa.model.routing import max_load_ratio, update_routing_bias
from kdsa.model.outputs import Collect
from kdsa.model.vision.assemble import batch_image_inputs
from kdsa.model.partitioning import constrain, current
from kdsa.sharding.train_state import BATCH_AXES, train_state_shardings
from kdsa.train.config import TrainConfig

Batch = dict[str, jax.Array]  # inputs, targets [B, T] int32; loss_mask [B, T]; segment_ids opt.
# image rows (docs/vision.md): image_patches [B, P, F], image_pos / image_grid [B, P, 2],
# image_segment [B, P] -- the tower runs on them and the features take the placeholders
BIAS_NAME = "e_score_correction_bias"


@struct.dataclass
class TrainState:
    params: Any  # pure State: the trainable parameters
    rest: Any  # pure State: everything else (frozen params, routing biases)
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 key data, split once per step (for stochastic parts of a step)


def trainable_filter(tc: TrainConfig):
    """``nnx`` filter of what the optimizer moves (the indexer stage's ``wrt``)."""
    return nnx.Param if tc.indexer_stage == "none" else indexer_stage_params(tc.indexer_stage)


def split_model(model: nnx.Module, tc: TrainConfig):
    """``(graphdef, params, rest)`` with pure states; ``params`` keeps Variables for metadata."""
    graphdef, params, rest = nnx.split(model, trainable_filter(tc), ...)
    return graphdef, params, rest


def init_state(model: nnx.Module, tc: TrainConfig, tx: optax.GradientTransformation):
    """``(graphdef, TrainState)`` at step 0."""
    graphdef, params, rest = split_model(model, tc)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    rng = jax.random.key_data(jax.random.key(tc.seed))
    return graphdef, TrainState(params=params, rest=rest, opt_state=tx.init(params),
                                step=jnp.zeros((), jnp.int32), rng=rng)


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """``(sum of masked per-token CE, number of valid tokens)``, float32.

    logits [B, T, V], targets [B, T] int, mask [B, T] (bool or 0/1).
    """
    if logits.shape[:2] != targets.shape or targets.shape != mask.shape:
        raise ValueError(f"logits {logits.shape[:2]}, targets {targets.shape} and mask "
                         f"{mask.shape} must share [B, T]")
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    m = mask.astype(jnp.float32)
    return jnp.sum(ce * m), jnp.sum(m)


def update_routing_biases(rest, expert_load: jax.Array, layout: tuple, rate: float):
    """Apply ``update_routing_bias`` to every ``e_score_correction_bias`` in the pure ``rest``.

    ``expert_load [L_moe, E]``: the MoE layers in layer order (``Stats.expert_load``);
    ``layout`` = the model's ``segment_layout`` (start, period, repeats). The bias at
    ``segments/s/layers/j`` is stacked ``[repeats, E]`` and belongs to layers
    ``start + j + period * r``; the layers that have a bias are the MoE layers.
    """
    def layers(path) -> np.ndarray:
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        s, j = int(keys[keys.index("segments") + 1]), int(keys[keys.index("layers") + 1])
        start, period, repeats = layout[s]
        return start + j + period * np.arange(repeats)

    def is_bias(path) -> bool:
        return BIAS_NAME in [getattr(k, "key", getattr(k, "idx", k)) for k in path]

    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0] if is_bias(p)]
    moe_layers = np.sort(np.concatenate([layers(p) for p in paths])) if paths else []
    row = {int(layer): i for i, layer in enumerate(moe_layers)}

    def one(path, leaf):
        if not is_bias(path):
            return leaf
        load = expert_load[np.asarray([row[int(i)] for i in layers(path)])]  # [R, E]
        return jax.vmap(update_routing_bias, in_axes=(0, 0, None))(leaf, load, rate)

    return jax.tree_util.tree_map_with_path(one, rest)


def _micro_batches(batch: Batch, m: int) -> Batch:
    def split(x):
        if x.shape[0] % m:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {m} micro-batches")
        return x.reshape((m, x.shape[0] // m) + x.shape[1:])  # [M, B/M, T]

    return {k: split(v) for k, v in batch.items()}


def optimizer_step(graphdef, state: TrainState, batch: Batch, objective, *, tc: TrainConfig,
                   tx: optax.GradientTransformation, layout: tuple, grad_divisor=1.0,
                   update_scale=1.0):
    """The step core every training loop shares (pretraining/SFT here, RL in
    ``train/rl/step.py``): micro-batches, exact gradient accumulation, the optimizer update,
    the routing-bias update, the RNG and the state's shardings.

    ``objective(model, micro_batch) -> (loss, (stats, expert_load [L_moe, E] | None))``: the
    loss of one
    micro-batch, already divided by any whole-batch denominator the caller took from ``batch``
    (or left as a sum and divided through ``grad_divisor``, applied once to the gradient sums);
    ``stats`` is a dict of per-micro-batch sums, returned summed. ``update_scale`` multiplies
    the optimizer's update. Returns ``(new_state, grads, stats, expert_load, learning_rate)``.
    Under ``use_sharding`` (``docs/sharding.md``) the micro-batch rows sit on the batch axes,
    the gradient sums and the new state in the state's layout (one compile for every step).
    """
    m = tc.accum_steps
    ctx = current()  # sharding rules (``use_sharding``), or None on one device
    mbs = _micro_batches(batch, m)
    if ctx is not None:  # micro-batch rows over the batch axes (a no-op when m == 1)
        mbs = {k: constrain(v, (None,) + BATCH_AXES[:v.ndim - 1]
                            + (None,) * max(0, v.ndim - 1 - len(BATCH_AXES)))
               for k, v in mbs.items()}

    def loss_of(params, mb):
        return objective(nnx.merge(graphdef, params, state.rest), mb)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def body(acc, mb):
        (_, aux), g = grad_fn(state.params, mb)
        return jax.tree.map(jnp.add, acc, g), aux

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    if ctx is not None:  # the gradient sums live like the parameters (reduce-scattered)
        zeros = jax.lax.with_sharding_constraint(
            zeros, train_state_shardings(graphdef, state, ctx.mesh, ctx.layout).params)
    g_sum, (stats, loads) = jax.lax.scan(body, zeros, mbs)
    grads = jax.tree.map(lambda g: g / grad_divisor, g_sum)  # a denominator applied last
    stats = jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)  # over micro-batches

    lr = _schedule_of(tc)(state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    # stored in the dtypes it came in: AdamW's first moment takes the gradient's dtype (optax
    # casts only the second back), so the float32 quotient above turned a bfloat16 model's
    # first moments float32 after step 1, and step 2 (its input state changed) compiled again
    opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state.opt_state)
    updates = jax.tree.map(lambda u: u * jnp.asarray(update_scale, u.dtype), updates)
    params = optax.apply_updates(state.params, updates)
    load = None if loads is None else jnp.sum(loads, axis=0)  # [L_moe, E]
    rest = state.rest
    if load is not None and tc.indexer_stage != "dense_warmup" and tc.bias_update_rate > 0:
        rest = update_routing_biases(rest, load, layout, tc.bias_update_rate)
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    new_state = TrainState(params=params, rest=rest, opt_state=opt_state, step=state.step + 1,
                           rng=rng)
    if ctx is not None:  # the same layout every step (no re-compile)
        new_state = jax.lax.with_sharding_constraint(
            new_state, train_state_shardings(graphdef, new_state, ctx.mesh, ctx.layout))
    return new_state, grads, stats, load, lr


def replicated(metrics: dict) -> dict:
    """Metrics pinned to every device under ``use_sharding`` (each host reads them whole)."""
    ctx = current()
    if ctx is None:
        return metrics
    return jax.lax.with_sharding_constraint(metrics, NamedSharding(ctx.mesh, P()))


def load_balance_metric(load: jax.Array | None) -> jax.Array:
    """The largest expert load over the mean load, over the MoE layers ``load [L_moe, E]``
    (0 for a layer that routed nothing, and for a model without MoE layers)."""
    if load is None or load.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    return jnp.max(jax.vmap(max_load_ratio)(load))


def _train_step(graphdef, state: TrainState, batch: Batch, *, tc: TrainConfig,
                tx: optax.GradientTransformation, layout: tuple) -> tuple[TrainState, dict]:
    n_tok = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    kl_scale = tc.indexer_loss_weight * jnp.maximum(n_tok, 1.0) / tc.accum_steps

    def objective(model, mb):
        out = model.forward(mb["inputs"], mb.get("positions"),
                            segment_ids=mb.get("segment_ids"), images=batch_image_inputs(model, mb),
                            collect=Collect(indexer_kl=tc.indexer_loss, expert_load=True))
        ce_sum, _ = token_cross_entropy(out.logits, mb["targets"], mb["loss_mask"])
        # the indexer's KL summed over DSA layers; no term when the stage trains no indexer
        kl = jnp.zeros((), jnp.float32) if out.stats.indexer_kl is None else jnp.sum(
            out.stats.indexer_kl)
        # expert parallel: assignments past the dispatch capacity (moe_capacity_factor)
        dropped = {} if out.stats.moe_dropped is None else {
            "moe_dropped": jnp.sum(out.stats.moe_dropped).astype(jnp.float32)}
        return ce_sum + kl_scale * kl, ({"ce_sum": ce_sum, "kl": kl, **dropped},
                                        out.stats.expert_load)

    new_state, grads, stats, load, lr = optimizer_step(
        graphdef, state, batch, objective, tc=tc, tx=tx, layout=layout,
        grad_divisor=jnp.maximum(n_tok, 1.0))
    metrics = {
        "loss": stats["ce_sum"] / jnp.maximum(n_tok, 1.0),
        "indexer_kl": stats["kl"] / tc.accum_steps,  # per micro-batch mean, DSA layers summed
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": lr,
        "tokens": n_tok,
        "expert_load_max_over_mean": load_balance_metric(load),
        **{k: stats[k] for k in ("moe_dropped",) if k in stats},
    }
    return new_state, replicated(metrics)


@functools.lru_cache(maxsize=16)
def _schedule_of(tc: TrainConfig):
    from kdsa.train.optim import learning_rate_schedule

    return learning_rate_schedule(tc)


train_step = jax.jit(_train_step, static_argnames=("graphdef", "tc", "tx", "layout"))
train_step.__doc__ = """``(state, metrics) = train_step(graphdef, state, batch, tc=, tx=, layout=)``.

Jitted once per (graphdef, config, optimizer, layout) and batch shape; ``batch`` holds the whole
optimizer step's ``batch_size`` rows, split here into ``accum_steps`` micro-batches.
"""


@functools.lru_cache(maxsize=8)
def train_step_with_options(compiler_options: tuple[tuple[str, Any], ...] | None = None,
                            donate: bool = False):
    """``train_step`` compiled with XLA ``compiler_options`` (sorted ``(name, value)`` pairs),
    e.g. ``(("xla_backend_optimization_level", 0),)``: the same numerics here, about half the
    CPU compile time (tests); one jitted function per option set, cached like ``train_step``.

    ``donate``: the input state is donated, so XLA writes the new state into its buffers and a
    step holds one train state, not two (``kdsa train``, and ``kdsa plan --compile``'s train
    step). The caller must not touch the old state after the call."""
    if not compiler_options and not donate:
        return train_step
    return jax.jit(_train_step, static_argnames=("graphdef", "tc", "tx", "layout"),
                   donate_argnums=(1,) if donate else (),
                   compiler_options=dict(compiler_options or ()) or None)


def update_model(model: nnx.Module, state: TrainState) -> nnx.Module:
    """Write the state's parameters and biases into ``model`` (keeps its metadata); returns it."""
    nnx.update(model, state.params, state.rest)
    return model
