"""``kdsa forward``: build a model on local devices and run one forward pass (smoke run)."""

from __future__ import annotations

import time


def register(sub) -> None:
    from kdsa.cli.config_args import add_config_args, positive_int

    p = sub.add_parser("forward", help="run a forward pass of a preset with random weights",
                       description="Build the model with random weights on the local devices, "
                                   "run a jitted forward pass on random tokens and report the "
                                   "parameter table, compile and step time, and loss.")
    add_config_args(p, default_preset="small")
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--seq", type=positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args) -> int:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from kdsa.cli.config_args import config_from_args
    from kdsa.model.count import count_params, format_report
    from kdsa.model.transformer import Transformer

    name, config = config_from_args(args)
    if config.context_limit is not None and args.seq > config.context_limit:
        raise ValueError(f"--seq {args.seq} exceeds max_position_embeddings "
                         f"{config.context_limit} (this model encodes positions with RoPE)")
    print(f"preset: {name}  devices: {jax.devices()}")
    print(format_report(count_params(config, preset=name)))
    t0 = time.perf_counter()
    model = Transformer(config, rngs=nnx.Rngs(args.seed))
    print(f"init: {time.perf_counter() - t0:.1f}s")
    ids = jax.random.randint(jax.random.key(args.seed), (args.batch, args.seq + 1), 0,
                             config.vocab_size)

    @nnx.jit
    def loss_fn(model, ids):
        logits = model(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    t0 = time.perf_counter()
    loss = jax.block_until_ready(loss_fn(model, ids))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = jax.block_until_ready(loss_fn(model, ids))
    step_s = time.perf_counter() - t0
    tokens = args.batch * args.seq
    print(f"forward: batch={args.batch} seq={args.seq} compile+run {compile_s:.1f}s, "
          f"run {step_s * 1e3:.0f} ms ({tokens / step_s:,.0f} tokens/s)")
    print(f"loss {float(loss):.4f} (uniform would be {float(jnp.log(config.vocab_size)):.4f}); "
          f"finite={bool(jnp.isfinite(loss))}")
    return 0 if bool(jnp.isfinite(loss)) else 1
