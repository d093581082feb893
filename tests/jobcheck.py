"""One multi-process job, several steps: ``kdsa`` commands and the cross-process reshard check.

    kdsa launch-local --processes 2 --devices-per-process 2 --module jobcheck -- \
        train --preset tiny --mesh expert=2,sequence=2 --run-dir RUN + \
        reshard-check --preset tiny --run-dir RUN --train-mesh expert=2,sequence=2 \
            --mesh data=2,tensor=2 --out reshard.json + \
        generate --preset tiny --mesh data=2,tensor=2 --prompts in.jsonl --out out.jsonl

Every process runs the steps (separated by ``+``) in order, in one Python process: the job is
joined once (``distributed.initialize``) and start-up is paid once, which is what lets the
test suite check multi-process training, resharding and generation in a single launch
(``tests/test_sharded_train.py``). A step is a ``kdsa`` command (the same code as the CLI) or:

``reshard-check`` (RL weight sync across processes, ``sharding/reshard.py``): restores the
newest checkpoint of a ``kdsa train`` run (same model and ``--train-set`` arguments) onto its
train mesh, moves the model's variables to the ``generate`` layout on ``--mesh`` built over the
devices in *reverse* order (so shards change process), and back to the ``train`` layout. Checks:
the generate-layout arrays equal the originals bit for bit (both gathered by one compiled
program per layout), the round trip lands on
the original shardings with every local shard bit-identical, and the rules' shardings on the
generate mesh; it counts the arrays whose moved shards were not all held by their new
process before (the cross-process transfers). Process 0 writes the result as JSON (``--out``);
a failed check exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SEPARATOR = "+"


def split_steps(argv: list[str]) -> list[list[str]]:
    """``a b + c d`` -> ``[[a, b], [c, d]]``; an empty step is an error."""
    steps, cur = [], []
    for a in argv:
        if a == SEPARATOR:
            steps.append(cur)
            cur = []
        else:
            cur.append(a)
    steps.append(cur)
    if any(not s for s in steps):
        raise ValueError(f"empty step in {' '.join(argv)!r}: steps are separated by "
                         f"{SEPARATOR!r}")
    return steps


def main(argv: list[str] | None = None) -> int:
    from kdsa.cli.main import main as kdsa_main
    from kdsa.sharding.distributed import JoinError, initialize

    try:
        steps = split_steps(list(sys.argv[1:] if argv is None else argv))
        initialize()
    except (ValueError, JoinError) as e:
        print(f"jobcheck: error: {e}", file=sys.stderr)
        return 2
    for step in steps:
        t0 = time.perf_counter()
        if step[0] == "reshard-check":
            try:
                rc = reshard_check(step[1:])
            except ValueError as e:  # a bad argument or no checkpoint: one clear line
                print(f"jobcheck: reshard-check: error: {e}", file=sys.stderr)
                rc = 2
        else:
            rc = kdsa_main(step)
        print(f"jobcheck: {step[0]} exited {rc} after {time.perf_counter() - t0:.1f}s",
              flush=True)
        if rc:
            return rc
    return 0


def reshard_check(argv: list[str]) -> int:
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from kdsa.model.config import get_preset
    from kdsa.model.overrides import apply_overrides
    from kdsa.sharding.mesh import layout_sizes, make_mesh
    from kdsa.sharding.reshard import reshard_state
    from kdsa.sharding.rules import state_shardings
    from kdsa.sharding.train_state import sharded_template, train_state_shardings
    from kdsa.train.checkpointing import Checkpointer
    from kdsa.train.config import TrainConfig, apply_train_overrides
    from kdsa.train.trainer import prepare

    p = argparse.ArgumentParser(prog="reshard-check", description=__doc__.split("\n\n")[2])
    p.add_argument("--preset", default="tiny", help="the kdsa train run's --preset")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="the kdsa train run's --set arguments")
    p.add_argument("--train-set", dest="train_overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="the kdsa train run's --train-set arguments")
    p.add_argument("--run-dir", type=Path, required=True, help="the kdsa train run")
    p.add_argument("--train-mesh", required=True, help="the train run's --mesh")
    p.add_argument("--mesh", required=True, help="generate layout mesh (devices reversed)")
    p.add_argument("--out", type=Path, default=None, help="JSON result (process 0)")
    args = p.parse_args(argv)
    config = apply_overrides(get_preset(args.preset), args.overrides)
    tc = apply_train_overrides(TrainConfig(), args.train_overrides)

    _, graphdef, _, build = prepare(config, tc)
    train_mesh = make_mesh(layout_sizes(None, "train", args.train_mesh))
    template = jax.eval_shape(build)
    template = sharded_template(template, train_state_shardings(graphdef, template, train_mesh))
    ckpt = Checkpointer(args.run_dir / "checkpoints", every=tc.checkpoint_every,
                        keep=tc.keep_checkpoints)
    restored = ckpt.restore_latest(template)
    ckpt.close()
    if restored is None:
        raise ValueError(f"reshard-check: no readable checkpoint in {ckpt.directory}")
    step, state, _ = restored
    source = nnx.state(nnx.merge(graphdef, state.params, state.rest))

    gen_mesh = make_mesh(layout_sizes(None, "generate", args.mesh), devices=jax.devices()[::-1])
    moved, to_gen = reshard_state(source, gen_mesh, "generate")
    back, to_train = reshard_state(moved, train_mesh, "train")

    flat = lambda s: [v[...] for _, v in nnx.to_flat_state(s)]  # noqa: E731
    src, gen, bck = flat(source), flat(moved), flat(back)
    want_gen = jax.tree.leaves(state_shardings(source, gen_mesh, "generate"))
    src_bits, gen_bits = _all_bits(src, train_mesh), _all_bits(gen, gen_mesh)
    result = {
        "checkpoint_step": step, "arrays": len(src), "elements": int(src_bits.size),
        "cross_process_arrays": sum(_crosses_processes(a.sharding, b.sharding, a.shape)
                                    for a, b in zip(src, gen)),
        "generate_bits_differing": int(np.sum(src_bits != gen_bits)),
        "generate_shardings_by_rules": all(b.sharding == w for b, w in zip(gen, want_gen)),
        "round_trip_shardings_equal": all(a.sharding == c.sharding for a, c in zip(src, bck)),
        "round_trip_bit_exact": all(_local_shards_identical(a, c) for a, c in zip(src, bck)),
        "to_generate": to_gen.to_json(), "to_train": to_train.to_json(),
    }
    ok = bool(multihost_utils.process_allgather(np.int32(
        result["generate_bits_differing"] == 0 and result["generate_shardings_by_rules"]
        and result["round_trip_shardings_equal"] and result["round_trip_bit_exact"])).min())
    result["ok"] = ok
    print(f"reshard-check: process {jax.process_index()}: {result['arrays']} arrays of step "
          f"{step}, {result['cross_process_arrays']} moved across processes, train -> generate "
          f"{to_gen.seconds:.3f}s, back {to_train.seconds:.3f}s, ok={ok}", flush=True)
    if args.out is not None and jax.process_index() == 0:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


def _all_bits(arrays, mesh):
    """Every element of ``arrays`` (one mesh) as its bit pattern, concatenated, on every
    process: one compiled gather for the whole tree (a check for small models)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    def bits(x):
        if x.dtype == jnp.bool_:
            return x.astype(jnp.uint32).reshape(-1)
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)

    fn = jax.jit(lambda xs: jnp.concatenate([bits(x) for x in xs]),
                 out_shardings=NamedSharding(mesh, P()))
    return np.asarray(fn(list(arrays)))


def _blocks(sharding, shape) -> dict:
    """``{device: ((start, stop), ...)}`` of every device's shard, global."""
    return {d: tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
            for d, idx in sharding.devices_indices_map(tuple(shape)).items()}


def _crosses_processes(src, dst, shape) -> bool:
    """Whether some device's ``dst`` shard is not inside a ``src`` shard of its own process."""
    held: dict[int, list] = {}
    for d, block in _blocks(src, shape).items():
        held.setdefault(d.process_index, []).append(block)
    inside = lambda b, h: all(lo >= hl and hi <= hh for (lo, hi), (hl, hh) in zip(b, h))  # noqa
    return any(not any(inside(b, h) for h in held.get(d.process_index, ()))
               for d, b in _blocks(dst, shape).items())


def _local_shards_identical(a, b) -> bool:
    """Same local devices and indices, and every local shard bit-identical (no gather)."""
    import numpy as np

    sa = {(s.device, str(s.index)): s.data for s in a.addressable_shards}
    sb = {(s.device, str(s.index)): s.data for s in b.addressable_shards}
    return sa.keys() == sb.keys() and all(
        np.asarray(sa[k]).tobytes() == np.asarray(sb[k]).tobytes() for k in sa)


if __name__ == "__main__":
    sys.exit(main())
