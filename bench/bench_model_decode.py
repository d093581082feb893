"""The model level (issue #21 section 5): the hybrid stack against the same stack with every
attention layer a dense MLA layer, decode step and prefill at depth, at K3's widths.

Two models of ``--preset`` (default ``k3-slice``: KDA, KDA, KDA, Gated DSA), built one after
the other with the same seed:

* ``hybrid``: the preset as it is;
* ``all_dense``: every layer a dense MLA layer (no KDA, no indexer), the rest unchanged.

For each, the engine's own compiled steps (``ModelRunner``, dense-slot cache, ``--batch``
slots (default 8) all decoding at the same depth, a runner per depth: the dense-slot step reads its whole ``max_len`` cache) with the cache
filled with random values (what a decode or prefill step costs does not depend on
what the cache holds; the KDA states are constant-size): the decode step at each
``--contexts`` depth, and a prefill chunk of ``--chunk`` tokens at depth 32K (the marginal
prefill rate there; a whole 32K prefill of the all-dense stack would take most of an hour on
this machine). Medians of ``--reps`` calls; prints the ratios and writes
bench/results/model_decode.json.

    .venv/bin/python bench/bench_model_decode.py [--preset k3-slice] [--batch 8]
        [--contexts 32768 131072]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from timing import seconds, write_results  # noqa: E402

from kdsa.infer.runner import ModelRunner  # noqa: E402
from kdsa.model.config import LinearAttnConfig, get_preset  # noqa: E402
from kdsa.model.transformer import Transformer  # noqa: E402


def all_dense(config):
    """``config`` with every layer a dense MLA layer (no KDA layers, no indexer)."""
    n = config.num_hidden_layers
    lac = LinearAttnConfig(**{**config.linear_attn_config.__dict__, "kda_layers": (),
                              "full_attn_layers": tuple(range(1, n + 1))})
    return config.replace(linear_attn_config=lac, index_n_heads=None, index_head_dim=None,
                          index_topk=None)


def _runner(model, slots: int, max_len: int, chunk: int) -> ModelRunner:
    """A runner of ``slots`` x ``max_len`` (a dense-slot decode step reads its whole cache, so
    each depth gets its own runner) with the cache filled with random values."""
    runner = ModelRunner(model, num_slots=slots, max_len=max_len, prefill_chunk=chunk,
                         min_bucket=chunk)
    runner.cache = jax.jit(_randomized, donate_argnums=(0,), out_shardings=runner.cache_shardings(
        runner.cache))(runner.cache)  # (None: the default placement; else the runner's layouts)
    return runner


def _randomized(cache):
    """``cache`` with every leaf a fixed pseudo-random pattern in ``[-0.1, 0.1]``, computed
    elementwise over the donated zeros: an all-dense 128K batch-8 cache is 9.7 GB, so neither
    a second copy nor ``jax.random.normal``'s intermediates (24 GiB for its 6 GiB leaf) fit
    beside it."""
    def fill(a, seed):
        phase = sum(jax.lax.broadcasted_iota(jnp.float32, a.shape, d) * (0.37 + 0.61 * d)
                    for d in range(a.ndim))
        return (0.1 * jnp.sin(phase + seed)).astype(a.dtype)

    leaves, treedef = jax.tree.flatten(cache)
    return treedef.unflatten([fill(a, float(i)) for i, a in enumerate(leaves)])


def measure(config, batch: int, contexts: list[int], chunk: int, prefill_depth: int,
            reps: int) -> dict:
    model = Transformer(config, rngs=nnx.Rngs(0))
    out = {"decode_step_s": {}, "decode_tokens_per_s": {}}
    tok, active = np.ones(batch, np.int32), np.ones(batch, bool)
    for ctx in contexts:
        runner = _runner(model, batch, ctx, chunk)
        pos = np.full(batch, ctx - 1, np.int32)
        step = seconds(lambda: runner.decode(tok, pos, active), reps=reps)
        out["decode_step_s"][str(ctx)] = step
        out["decode_tokens_per_s"][str(ctx)] = batch / step
        del runner
        gc.collect()
    runner = _runner(model, 1, prefill_depth, chunk)
    ids = [1] * chunk
    out["prefill_chunk_s"] = seconds(
        lambda: runner.prefill(0, ids, start=prefill_depth - chunk), reps=max(2, reps // 3))
    out["prefill_tokens_per_s_at_depth"] = chunk / out["prefill_chunk_s"]
    del runner, model
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-slice")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batch", type=int, default=8, help="decoding slots (tokens per step)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    p.add_argument("--prefill-depth", type=int, default=32768)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "model_decode.json"))
    a = p.parse_args()
    hybrid = get_preset(a.preset)
    result = {"args": vars(a), "load_before": os.getloadavg()}
    for name, cfg in (("hybrid", hybrid), ("all_dense", all_dense(hybrid))):
        print(f"{name}: {' '.join(cfg.mixer_kinds)} ...", flush=True)
        result[name] = r = measure(cfg, a.batch, a.contexts, a.chunk, a.prefill_depth, a.reps)
        print(f"  decode step (batch {a.batch}) " + ", ".join(f"{float(v) * 1e3:.1f} ms at {k}"
                                          for k, v in r["decode_step_s"].items())
              + f"; prefill at {a.prefill_depth}: {r['prefill_tokens_per_s_at_depth']:.0f} "
                "tokens/s", flush=True)
    h, d = result["hybrid"], result["all_dense"]
    result["decode_speedup"] = {k: d["decode_step_s"][k] / h["decode_step_s"][k]
                                for k in h["decode_step_s"]}
    result["prefill_speedup_at_depth"] = d["prefill_chunk_s"] / h["prefill_chunk_s"]
    result["load_after"] = os.getloadavg()
    print("hybrid / all-dense decode tokens/s: " + ", ".join(
        f"{v:.2f}x at {k}" for k, v in result["decode_speedup"].items())
        + f" (target >= 3); prefill at {a.prefill_depth}: "
        f"{result['prefill_speedup_at_depth']:.2f}x (target >= 2)")
    write_results(a.out, result)


if __name__ == "__main__":
    main()
