"""The README's demo (``kdsa rl --demo``) over several seeds: held-out reward before and after
RL per seed, and whether each seed gains the +0.3 issue #17 asks of it.

Each seed is one ``kdsa rl --demo --seed S`` process (the same command a user runs, with any
``--rl-set`` / ``--train-set`` overrides passed through), in a temporary run dir; the demo's
last lines (per-environment and mean held-out reward, wall time) are parsed.

    python bench/bench_demo_seeds.py [--seeds 0,1,2,3,4] [--rl-set k=v ...] [--out FILE]

Writes bench/results/rl_demo_seeds.json (or ``--out``). One seed takes about 3 minutes on a
quiet 2-core machine with a warm compile cache; the load average is recorded.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_results  # noqa: E402

TARGET_GAIN = 0.3
_MEAN = re.compile(r"held-out reward: before ([0-9.]+) -> after ([0-9.]+)")
_PER_ENV = re.compile(r"(\S+) ([0-9.]+) -> ([0-9.]+)")


def run_seed(seed: int, extra: list[str], run_dir: Path) -> dict:
    kdsa = Path(sys.executable).with_name("kdsa")
    cmd = [str(kdsa), "rl", "--demo", "--seed", str(seed), "--run-dir", str(run_dir),
           "--no-progress", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: {' '.join(cmd)} exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")
    mean = _MEAN.search(proc.stdout)
    if mean is None:
        raise SystemExit(f"seed {seed}: no held-out line in the output:\n{proc.stdout[-3000:]}")
    before, after = float(mean.group(1)), float(mean.group(2))
    per_env = {}
    for line in proc.stdout.splitlines():
        if line.startswith("held-out reward per environment: "):
            for part in line.split(": ", 1)[1].split(", "):
                m = _PER_ENV.fullmatch(part.strip())
                if m:
                    per_env[m.group(1)] = [float(m.group(2)), float(m.group(3))]
    return {"seed": seed, "before": before, "after": after, "gain": round(after - before, 3),
            "reaches_target": after - before >= TARGET_GAIN, "per_env": per_env,
            "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rl_demo_seeds.json"))
    args = ap.parse_args(argv)
    extra = [a for kv in args.rl_set for a in ("--rl-set", kv)]
    extra += [a for kv in args.train_set for a in ("--train-set", kv)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in (int(x) for x in args.seeds.split(",")):
            row = run_seed(s, extra, Path(tmp) / f"seed{s}")
            print(f"seed {s}: {row['before']:.3f} -> {row['after']:.3f} "
                  f"({row['gain']:+.3f}) {row['per_env']}  {row['wall_s']:.0f} s", flush=True)
            rows.append(row)
    gains = [r["gain"] for r in rows]
    result = {"command": "kdsa rl --demo --seed S " + " ".join(extra), "target_gain": TARGET_GAIN,
              "seeds": rows, "mean_gain": round(sum(gains) / len(gains), 3),
              "min_gain": min(gains),
              "seeds_reaching_target": sum(r["reaches_target"] for r in rows),
              "load_average": os.getloadavg()}
    print(f"gains {gains}: mean {result['mean_gain']:+.3f}, min {result['min_gain']:+.3f}, "
          f"{result['seeds_reaching_target']}/{len(rows)} reach +{TARGET_GAIN}")
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
