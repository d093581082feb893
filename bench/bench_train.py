"""Training and RL throughput of a small preset, against this machine's matmul roofline.

Measured side by side in one run (each a median of ``reps`` timed calls after a warm-up,
``bench/timing.py``), printed as ratios and written to bench/results/train.json:

* **roofline**: FLOP/s of a large plain float32 matmul (``2 n^3`` FLOPs, ``n = --matmul``) on
  one device: what this machine reaches on the operation training is made of; measured before
  and right after the training step, the better of the two;
* **training**: tokens/s of the jitted optimizer step (``train/step.py``, AdamW, on one device,
  where the RL loop trains; ``kdsa train`` on a one-device machine), and its FLOP/s two ways,
  each as a fraction of the roofline: *model* FLOPs ``6 * matmul_params * tokens`` (the
  convention of ``train/metrics.py``'s MFU: attention scores not counted) and *executed*
  FLOPs (XLA's cost analysis of the compiled step: attention, routing, optimizer, recompute
  included);
* **rollouts**: tokens/s of ``Engine.generate`` on the same model through the RL loop's own
  ``Sampler`` (``train/rl/sampler.py``: runner + engine on the ``generate`` mesh of
  ``--generate-devices`` devices), ``--slots`` sequences of ``--new`` sampled tokens;
* **weight sync**: seconds per ``Sampler.sync`` (the RL loop's per-step reshard: the train
  state on the ``train`` layout over ``--train-devices`` devices -> the ``generate`` layout,
  ``sharding/reshard.py``, array by array), and the bytes it moves per second.

    python bench/bench_train.py [--quick] [--preset tiny]
    python bench/bench_train.py --preset k3-slice --train-only --batch 2 --seq 512 \
        --out bench/results/train_k3-slice.json   # K3's widths: roofline and training only

The default is the ``tiny`` preset (4 layers: KDA, Gated DSA, latent MoE; 8 x 256 tokens per
step): on 2 shared CPU cores the XLA compile of its train step alone took 9 minutes of wall
time at load 18 (2 minutes of CPU); ``--preset small`` is the next size up.

CPU devices are threads of one host sharing its cores (the process forces 8 host devices so
the train and generate meshes exist); on a shared, loaded machine the absolute numbers are
upper-bound noisy, the ratios less so. The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from timing import matmul_flops, seconds, write_results  # noqa: E402

from kdsa.infer.engine import Request  # noqa: E402
from kdsa.infer.sampling import SamplingParams  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.count import count_params  # noqa: E402
from kdsa.sharding.aot import compiled_memory  # noqa: E402
from kdsa.sharding.mesh import fit_layout  # noqa: E402
from kdsa.sharding.plan import make_plan  # noqa: E402
from kdsa.sharding.train_state import train_state_shardings  # noqa: E402
from kdsa.train.config import TrainConfig  # noqa: E402
from kdsa.progress import Progress  # noqa: E402
from kdsa.train.rl.config import RLConfig  # noqa: E402
from kdsa.train.rl.sampler import Sampler  # noqa: E402
from kdsa.train.step import train_step, train_step_with_options  # noqa: E402
from kdsa.train.trainer import prepare  # noqa: E402


def random_batch(config, tc: TrainConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, (tc.batch_size, tc.seq_len + 1), dtype=np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:],
            "loss_mask": np.ones((tc.batch_size, tc.seq_len), np.float32)}


def train_rate(config, tc: TrainConfig, reps: int, donate: bool = False):
    """``(tokens/s, executed FLOPs per step, step seconds, graphdef, state, CompiledMemory)``
    of the one-device step.
    ``donate``: the state is donated and each call runs on the previous call's output (one
    state in memory, not two: a K3-wide model's AdamW state does not fit twice here)."""
    abstract, graphdef, tx, build = prepare(config, tc)
    state = jax.device_put(build(), jax.devices()[0])
    batch = random_batch(config, tc)
    kw = {"tc": tc, "tx": tx, "layout": abstract.segment_layout}
    step = train_step_with_options(donate=True) if donate else train_step
    t0 = time.perf_counter()
    compiled = step.lower(graphdef, state, batch, **kw).compile()
    memory = compiled_memory(compiled, time.perf_counter() - t0)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    executed = float(cost.get("flops", 0.0)) if cost else 0.0
    if donate:
        holder = [state]

        def call():
            holder[0], metrics = compiled(holder[0], batch)
            return metrics["loss"]

        dt = seconds(call, reps=reps)
        return tc.batch_size * tc.seq_len / dt, executed, dt, graphdef, holder[0], memory
    # the step returns a new state; timing the same input state keeps every call alike
    dt = seconds(lambda: compiled(state, batch)[1]["loss"], reps=reps)
    return tc.batch_size * tc.seq_len / dt, executed, dt, graphdef, state, memory


def memory_report(config, tc: TrainConfig, compiled) -> dict:
    """XLA's per-device bytes of the compiled step beside ``kdsa plan``'s estimate for the
    same shape on one device (``sharding/plan.py``), and this process's peak RSS."""
    import resource

    plan = make_plan(config, "train", {}, device_memory=1 << 40, batch=tc.batch_size,
                     seq=tc.seq_len, accum_steps=tc.accum_steps)
    return {"compiled": compiled.to_dict(), "plan": plan.memory, "plan_total": plan.total,
            "compiled_peak_over_plan": compiled.peak / plan.total,
            "process_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def rollout_rate(sampler: Sampler, slots: int, prompt: int, new: int) -> float:
    """Generated tokens/s of ``slots`` rollouts of ``new`` tokens (after one compile run)."""
    def reqs():
        return [Request([1 + (i % 200)] * prompt, SamplingParams(
            temperature=1.0, max_tokens=new, ignore_eos=True, seed=i)) for i in range(slots)]

    sampler.engine.generate(reqs()[:1])  # compile prefill and decode
    t0 = time.perf_counter()
    out = sampler.engine.generate(reqs())
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


def sync_time(sampler: Sampler, graphdef, state, config, train_devices: int, reps: int):
    """Seconds per ``Sampler.sync`` from the train layout on ``train_devices`` devices, and the
    bytes of the tree it moves."""
    mesh = fit_layout(config, "train", devices=jax.devices()[:train_devices])
    placed = jax.device_put(state, train_state_shardings(graphdef, state, mesh, "train"))
    times = [sampler.sync(graphdef, placed) for _ in range(reps + 1)][1:]  # first: warm-up
    tree_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        (placed.params, placed.rest)))
    return float(np.median(times)), tree_bytes, dict(mesh.shape)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="64-token sequences, 32-token rollouts, 3 reps")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (256; 64 quick)")
    ap.add_argument("--matmul", type=int, default=2048, help="roofline matmul size n")
    ap.add_argument("--slots", type=int, default=16, help="rollouts decoded together")
    ap.add_argument("--new", type=int, default=None, help="tokens per rollout (96; 32 quick)")
    ap.add_argument("--train-devices", type=int, default=8)
    ap.add_argument("--generate-devices", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per measurement")
    ap.add_argument("--train-only", action="store_true",
                    help="the roofline and the training step only (no rollouts, no weight "
                         "sync: a model whose train state and generate copy do not both fit)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train.json"))
    args = ap.parse_args()
    preset = args.preset
    seq = args.seq or (64 if args.quick else 256)
    new = args.new or (32 if args.quick else 96)
    reps = args.reps or (3 if args.quick else 5)
    prompt = 32
    config = get_preset(preset)
    config = config.replace(max_position_embeddings=max(config.max_position_embeddings,
                                                        seq, prompt + new + 1))
    tc = TrainConfig(steps=1, batch_size=args.batch or 8, seq_len=seq, warmup_steps=0)
    rc = RLConfig(seq_len=prompt + new, num_slots=args.slots,
                  generate_devices=args.generate_devices)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    bar = Progress(4, unit="phase")

    roof0 = matmul_flops(args.matmul, reps)
    bar.advance_to(1, desc=f"matmul {roof0 / 1e9:.1f} GFLOP/s")
    tps, executed, step_s, graphdef, state, compiled = train_rate(config, tc, reps,
                                                                  donate=args.train_only)
    memory = memory_report(config, tc, compiled)
    roof1 = matmul_flops(args.matmul, reps)  # again right after the step: same load
    roof = max(roof0, roof1)
    bar.advance_to(2, desc=f"train {tps:.0f} tokens/s")
    counts = count_params(config, preset)
    active = counts.active_params
    # 6 N per token with N the parameters a token multiplies by: the input embedding is a
    # lookup (counting it overstated k3-slice's model FLOPs by 9.5%)
    model_flops = 6.0 * counts.matmul_params * tc.batch_size * tc.seq_len / step_s
    exec_flops = executed / step_s
    if args.train_only:
        roll = sync_s = tree_bytes = train_mesh = None
    else:
        model = nnx.merge(graphdef, state.params, state.rest)
        sampler = Sampler(model, config, rc, tc.seed)
        roll = rollout_rate(sampler, args.slots, prompt, new)
        bar.advance_to(3, desc=f"rollouts {roll:.0f} tokens/s")
        sync_s, tree_bytes, train_mesh = sync_time(sampler, graphdef, state, config,
                                                   args.train_devices, reps)
        bar.advance_to(4, desc=f"sync {sync_s * 1e3:.1f} ms")
    bar.close()
    res = {
        "preset": preset, "backend": jax.default_backend(), "devices": len(jax.devices()),
        "quick": args.quick, "load_average_before": load0, "load_average_after": os.getloadavg(),
        "roofline": {"matmul_n": args.matmul, "dtype": "float32", "flops_per_s": roof,
                     "before_train": roof0, "after_train": roof1},
        "train": {"batch": tc.batch_size, "seq_len": tc.seq_len, "step_s": step_s,
                  "tokens_per_s": tps, "active_params": active,
                  "matmul_params": counts.matmul_params,
                  "model_flops_per_s": model_flops, "model_flops_fraction": model_flops / roof,
                  "executed_flops_per_step": executed, "executed_flops_per_s": exec_flops,
                  "executed_flops_fraction": exec_flops / roof, "memory": memory},
        "rollout": None if roll is None else {
            "slots": args.slots, "prompt": prompt, "new_tokens": new,
            "generate_devices": args.generate_devices, "tokens_per_s": roll,
            "vs_train_tokens_per_s": roll / tps},
        "weight_sync": None if sync_s is None else {
            "train_mesh": train_mesh, "generate_devices": args.generate_devices,
            "seconds": sync_s, "tree_bytes": tree_bytes, "bytes_per_s": tree_bytes / sync_s,
            "vs_train_step": sync_s / step_s},
        "seconds": time.perf_counter() - t_start,
    }
    tr, ro, ws = res["train"], res["rollout"], res["weight_sync"]
    print(f"{preset} on {jax.default_backend()} (load average {load0[0]:.1f} -> "
          f"{res['load_average_after'][0]:.1f}, {res['seconds']:.0f} s)")
    print(f"  roofline: f32 matmul n={args.matmul}: {roof / 1e9:.2f} GFLOP/s (the better of "
          f"{roof0 / 1e9:.2f} before and {roof1 / 1e9:.2f} after the train step)")
    print(f"  train: {tc.batch_size} x {tc.seq_len} tokens/step, {step_s:.3f} s/step, "
          f"{tps:.0f} tokens/s")
    print(f"    model FLOPs (6 x {active / 1e6:.2f}M active x tokens): "
          f"{model_flops / 1e9:.2f} GFLOP/s = {tr['model_flops_fraction']:.3f} of the roofline")
    print(f"    executed FLOPs (XLA cost analysis, {executed / 1e9:.2f} GFLOP/step; it counts a "
          f"loop body once, so scanned layers and the MoE block scan are undercounted): "
          f"{exec_flops / 1e9:.2f} GFLOP/s = {tr['executed_flops_fraction']:.3f} of the roofline")
    gib = 2.0 ** 30
    print(f"    memory per device: compiled peak {memory['compiled']['peak'] / gib:.2f} GiB "
          f"(arguments {memory['compiled']['arguments'] / gib:.2f}, temporaries "
          f"{memory['compiled']['temporaries'] / gib:.2f}); plan {memory['plan_total'] / gib:.2f} "
          f"GiB ({memory['compiled_peak_over_plan']:.2f}x); process peak RSS "
          f"{memory['process_peak_rss'] / gib:.2f} GiB")
    if args.train_only:
        write_results(args.out, res)
        return 0
    print(f"  rollouts: {args.slots} x {new} tokens on {args.generate_devices} device(s): "
          f"{roll:.0f} tokens/s = {ro['vs_train_tokens_per_s']:.2f} x training tokens/s")
    print(f"  weight sync {train_mesh} -> generate ({args.generate_devices} devices): "
          f"{sync_s * 1e3:.1f} ms for {tree_bytes / 1e6:.1f} MB ({ws['bytes_per_s'] / 1e9:.2f} "
          f"GB/s) = {ws['vs_train_step']:.2f} x a train step")
    write_results(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
