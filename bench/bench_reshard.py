"""Weight sync between layouts: array-by-array resharding vs one bulk put vs a host round trip.

Moves a preset's parameters from the ``train`` layout (``fsdp=4,expert=2`` over 8 devices) to
the ``generate`` layout on another device subset (``expert=2,tensor=2`` over devices 4-7) and
back, three ways, side by side:

* ``reshard``: ``kdsa.sharding.reshard.reshard`` (one ``device_put`` per array, each finished
  before the next; with and without donation);
* ``bulk``: one ``jax.device_put`` of the whole tree (every copy in flight at once);
* ``host``: each array fetched to the host (``np.asarray``, the whole array on one host) and
  put back, the path resharding exists to avoid.

Prints time ratios against ``reshard`` and the computed per-device peak (source + targets
live), checks that train -> generate -> train is bit-exact, and writes
bench/results/reshard.json. CPU devices share one host's memory, so times here compare code
paths, not interconnects.

    .venv/bin/python bench/bench_reshard.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.count import abstract_model  # noqa: E402
from kdsa.sharding.mesh import make_mesh  # noqa: E402
from kdsa.sharding.reshard import reshard  # noqa: E402
from kdsa.sharding.rules import place, state_shardings  # noqa: E402
from timing import write_results  # noqa: E402  (bench/timing.py; the script's folder)


def build(preset: str, mesh):
    """Random parameters of ``preset``, placed on ``mesh`` by the train rules, plus the
    train and generate shardings (plain dicts of arrays / shardings)."""
    state = nnx.state(abstract_model(get_preset(preset)))
    rng = np.random.default_rng(0)
    flat = nnx.to_flat_state(state)
    train = dict(nnx.to_flat_state(state_shardings(state, mesh, "train")))
    arrays = {p: place(rng.standard_normal(v.shape).astype(v.dtype), train[p]) for p, v in flat}
    return state, arrays, train


def timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    preset, repeats = ("tiny", 2) if args.quick else ("small", 5)
    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"needs 8 devices, found {len(devices)}")
    train_mesh = make_mesh("fsdp=4,expert=2", devices=devices)
    gen_mesh = make_mesh("expert=2,tensor=2", devices=devices[4:8])
    state, arrays, train = build(preset, train_mesh)
    gen = dict(nnx.to_flat_state(state_shardings(state, gen_mesh, "generate")))
    nbytes = sum(a.nbytes for a in arrays.values())

    t_reshard, (moved, report) = timed(lambda: reshard(arrays, gen), repeats)
    t_bulk, bulk = timed(lambda: jax.device_put(arrays, gen), repeats)
    t_host, host = timed(lambda: {p: jax.device_put(np.asarray(a), gen[p])
                                  for p, a in arrays.items()}, repeats)
    back, back_report = reshard(moved, train)
    exact = all(np.array_equal(np.asarray(arrays[p]), np.asarray(back[p])) for p in arrays)
    same = all(np.array_equal(np.asarray(moved[p]), np.asarray(x[p])) for x in (bulk, host)
               for p in arrays)
    copy = {p: jax.device_put(a, train[p], may_alias=False) for p, a in arrays.items()}
    _, donated = reshard(copy, gen, donate=True)
    bulk_peak = report.source_device_bytes + report.target_device_bytes  # all copies in flight

    result = {
        "preset": preset, "arrays": len(arrays), "tree_bytes": nbytes,
        "train_mesh": "fsdp=4,expert=2 (8 devices)", "generate_mesh":
            "expert=2,tensor=2 (devices 4-7)",
        "seconds": {"reshard": t_reshard, "bulk": t_bulk, "host": t_host},
        "ratio_host_over_reshard": t_host / t_reshard,
        "ratio_bulk_over_reshard": t_bulk / t_reshard,
        "peak_device_bytes": {"reshard": report.peak_device_bytes,
                              "reshard_donate": donated.peak_device_bytes,
                              "bulk": bulk_peak, "host_array_on_one_host": max(
                                  a.nbytes for a in arrays.values())},
        "source_device_bytes": report.source_device_bytes,
        "target_device_bytes": report.target_device_bytes,
        "measured_peak_bytes": report.measured_peak_bytes,
        "round_trip_exact": exact, "paths_agree": same, "platform": devices[0].platform,
    }
    print(f"{preset}: {len(arrays)} arrays, {nbytes / 2**20:.1f} MiB; train -> generate "
          f"(other devices)")
    print(f"  reshard {t_reshard * 1e3:8.1f} ms   bulk {t_bulk * 1e3:8.1f} ms "
          f"({t_bulk / t_reshard:.2f}x)   host {t_host * 1e3:8.1f} ms "
          f"({t_host / t_reshard:.2f}x reshard)")
    print(f"  peak per device: reshard {report.peak_device_bytes / 2**20:.2f} MiB, with donation "
          f"{donated.peak_device_bytes / 2**20:.2f} MiB, bulk {bulk_peak / 2**20:.2f} MiB "
          f"(source {report.source_device_bytes / 2**20:.2f}, target "
          f"{report.target_device_bytes / 2**20:.2f})")
    print(f"  train -> generate -> train bit-exact: {exact}; all paths agree: {same}")
    out = Path(__file__).parent / "results" / "reshard.json"
    write_results(out, result)


if __name__ == "__main__":
    main()
