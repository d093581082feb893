"""Does XLA's SPMD partitioner replicate a tensor in the train step? Mesh by mesh.

When the partitioner finds no collective that takes a tensor from one layout to the next it
replicates the whole tensor on every device and slices it, and says so on stderr
("Involuntary full rematerialization"; docs/sharding.md section 3). For each mesh of 8 CPU
devices this compiles (does not run) the train step of a preset in a fresh process, so
nothing comes from a compile cache, and counts those warnings. With ``--tpu TOPOLOGY`` it also
compiles the same step for abstract TPU devices through ``kdsa plan --compile`` (libtpu, no TPU
needed) and records XLA:TPU's warnings, peak memory and collectives per mesh.

    python bench/bench_partitioning.py                      # -> results/partitioning.json
    python bench/bench_partitioning.py --tpu v5p:2x2x2 --tpu-meshes fsdp=2,sequence=4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MESHES = ("fsdp=8", "expert=8", "tensor=8", "sequence=8", "data=2,fsdp=2,expert=2",
          "expert=2,sequence=2,tensor=2", "fsdp=2,sequence=4", "expert=4,tensor=2",
          "fsdp=4,sequence=2", "data=2,sequence=4", "expert=2,sequence=4",
          "fsdp=2,expert=2,sequence=2", "tensor=2,sequence=4", "fsdp=2,tensor=2,sequence=2",
          "data=2,fsdp=2,tensor=2", "fsdp=2,expert=2,tensor=2", "fsdp=4,tensor=2")
WARNING = "Involuntary full rematerialization"
ROOT = Path(__file__).resolve().parent.parent


def compile_one(preset: str, mesh_spec: str, batch: int, seq: int) -> None:
    """(In the child process.) Compile the train step on ``mesh_spec`` over 8 CPU devices."""
    from kdsa.model.config import get_preset
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.mesh import make_mesh
    from kdsa.train.aot import abstract_train_step_args
    from kdsa.train.config import TrainConfig
    from kdsa.train.step import train_step_with_options

    mesh = make_mesh(mesh_spec)
    args, static = abstract_train_step_args(
        get_preset(preset), TrainConfig(batch_size=batch, seq_len=seq), mesh)
    with use_sharding(mesh, "train"):
        train_step_with_options((("xla_backend_optimization_level", 0),)).lower(
            *args, **static).compile()


def run_cpu(preset: str, mesh_spec: str, batch: int, seq: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    p = subprocess.run([sys.executable, __file__, "--one", mesh_spec, "--preset", preset,
                        "--batch", str(batch), "--seq", str(seq)],
                       env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{mesh_spec}: the compile failed\n{p.stderr[-3000:]}")
    return {"warnings": p.stderr.count(WARNING)}


def run_tpu(preset: str, mesh_spec: str, topology: str, batch: int, seq: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    p = subprocess.run([sys.executable, "-m", "kdsa.cli.main", "plan", "--preset", preset,
                        "--mesh", mesh_spec, "--batch", str(batch), "--seq", str(seq),
                        "--compile", "--topology", topology, "--json"],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode not in (0, 3):  # 3: compiled, over the device memory
        raise SystemExit(f"{mesh_spec} on {topology}: kdsa plan failed\n{p.stderr[-3000:]}")
    step = json.loads(p.stdout)["compiled"]["train step"]
    return {"warnings": p.stderr.count(WARNING), "peak_bytes": step["peak"],
            "temporaries_bytes": step["temporaries"], "collectives": step["collectives"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--meshes", nargs="+", default=list(MESHES))
    ap.add_argument("--tpu", metavar="TOPOLOGY", help="also compile for this TPU topology")
    ap.add_argument("--tpu-meshes", nargs="+", default=["fsdp=2,sequence=4",
                                                        "tensor=2,sequence=4",
                                                        "fsdp=2,expert=2,tensor=2"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/partitioning.json"))
    ap.add_argument("--one", metavar="MESH", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one:
        return compile_one(args.preset, args.one, args.batch, args.seq)

    sys.path.insert(0, str(Path(__file__).parent))
    from timing import write_results

    result = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "cpu": {}}
    for mesh_spec in args.meshes:
        result["cpu"][mesh_spec] = run_cpu(args.preset, mesh_spec, args.batch, args.seq)
        print(f"cpu {mesh_spec}: {result['cpu'][mesh_spec]['warnings']} warnings", flush=True)
    if args.tpu:
        result["tpu"] = {"topology": args.tpu, "meshes": {}}
        for mesh_spec in args.tpu_meshes:
            r = run_tpu(args.preset, mesh_spec, args.tpu, args.batch, args.seq)
            result["tpu"]["meshes"][mesh_spec] = r
            print(f"{args.tpu} {mesh_spec}: {r}", flush=True)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
