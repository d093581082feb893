"""Multi-host self-check: one sharded forward (and gradient) over every process's devices.

    kdsa launch-local --processes 2 --devices-per-process 2 --module selfcheck \
        -- --preset tiny --mesh expert=2,tensor=2 --out /tmp/check.npz

Every process runs the same command: it joins the job (``distributed.initialize``), builds the
model from the same seed, places it on the mesh over all processes' devices by the layout's
rules (each process fills only its own shards), runs the jitted loss and gradients under
``use_sharding`` and process 0 writes the gathered logits, loss and gradients to ``--out``
(``.npz``), which tests compare with a single-device run. ``--fail-process N`` makes process N
exit with status 3 right after joining (tests of ``launch-local``'s failure handling).
The cross-process reshard check and the multi-process train / generate runs are in
``jobcheck.py``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from kdsa.cli.config_args import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="python -m selfcheck", description=__doc__)
    add_config_args(p, default_preset="tiny")
    p.add_argument("--mesh", default=None, help="axis sizes over all processes' devices")
    p.add_argument("--layout", default="train", choices=("train", "generate"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad", action="store_true", help="also compute and save gradients")
    p.add_argument("--out", default=None, help="where process 0 writes the results (.npz)")
    p.add_argument("--fail-process", type=int, default=None)
    p.add_argument("--timeout", type=int, default=60, help="seconds to wait for the peers")
    args = p.parse_args(argv)

    import jax

    from kdsa.sharding.distributed import JoinError, initialize

    try:
        initialize(timeout_s=args.timeout)
    except (ValueError, JoinError) as e:
        print(f"selfcheck: error: {e}", file=sys.stderr)
        return 2
    if args.fail_process == jax.process_index():  # a crash: no clean distributed shutdown
        print(f"selfcheck: process {jax.process_index()} failing on purpose", file=sys.stderr,
              flush=True)
        os._exit(3)
    name, config = config_from_args(args)
    return _run(args, config)


def _run(args, config) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kdsa.model.transformer import Transformer
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.mesh import layout_sizes, make_mesh
    from kdsa.sharding.rules import place, shard_model

    mesh = make_mesh(layout_sizes(None, args.layout, args.mesh))
    graphdef, state = nnx.split(shard_model(Transformer(config, rngs=nnx.Rngs(args.seed)),
                                            mesh, args.layout))
    ids = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.seq + 1), 0,
                             config.vocab_size)
    ids = place(ids, NamedSharding(mesh, P()))

    def loss_fn(st, ids):
        out = nnx.merge(graphdef, st).forward(ids[:, :-1])
        logp = jax.nn.log_softmax(out.logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), out.logits

    fn = jax.value_and_grad(loss_fn, has_aux=True) if args.grad else loss_fn
    with use_sharding(mesh, args.layout):
        compiled = jax.jit(fn).lower(state, ids).compile(
            compiler_options={"xla_backend_optimization_level": 0})
        result = compiled(state, ids)
    (loss, logits), grads = result if args.grad else (result, None)
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa
    out = {"loss": gather(loss), "logits": gather(logits)}
    if grads is not None:
        for path, g in nnx.to_flat_state(grads):
            out["grad/" + "/".join(map(str, path))] = gather(g[...])
    print(f"selfcheck: process {jax.process_index()} of {jax.process_count()}, "
          f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}: loss {float(out['loss']):.6f}")
    if args.out and jax.process_index() == 0:
        np.savez(args.out, **out)
    multihost_utils.sync_global_devices("selfcheck done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
