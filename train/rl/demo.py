"""The main demo: SFT warm-up, then RL on a mix of easy reasoning-gym families, on local CPUs.

``kdsa rl --demo`` = :func:`demo_configs` + :func:`run_demo`: a fresh random ``tiny`` model
(KDA + Gated DSA + MoE, byte tokenizer, K2 chat format), ``sft_steps`` steps of SFT on the
families' reference answers, the held-out reward, ``steps`` RL steps (GRPO, groups of 8, TIS,
dynamic sampling, thinking budgets, KL to the post-SFT policy, updates scaled by the share of
varied groups), the held-out reward again, a reward-curve PNG, the final
checkpoint and a few answers from the final policy. The last line printed is
``held-out reward: before X.XXX -> after Y.YYY``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kdsa.train.config import TrainConfig
from kdsa.train.rl.config import RLConfig

DEMO_ENVS = (
    # 28 bit strings of length 2-4 -> -1 / 0 / 1 swaps (a lookup table the tiny model can learn;
    # one-digit basic_arithmetic, 242 questions / 31 answers, stayed at 0: docs/rl.md)
    {"name": "rg:binary_alternation", "options": {
        "min_n": 2, "max_n": 4, "p_solvable": 0.5,
        "rewrite": ["(?s)^.*alternating: ([01]+)\\s*$", "Swaps to alternate \\1?"]}},
    {"name": "rg:count_bits", "options": {
        "max_n": 15,
        "rewrite": ["^How many 1 bits are there in the binary representation of the number "
                    "(\\d+)\\?$", "Count the 1 bits of \\1."]}},
    {"name": "rg:letter_counting", "options": {
        "min_words": 1, "max_words": 1,
        "rewrite": ["^How many times does the letter (\"\\w\") appear in the text: (\".*\")\\?$",
                    "Count \\1 in \\2."]}},
)


def demo_configs(steps: int | None = None, seed: int | None = None):
    """``(preset name, TrainConfig, RLConfig)`` of the demo."""
    # A short SFT warm-up (15 steps) leaves RL most of the tables to learn; two PPO mini-batch
    # updates per rollout batch learn them, and a KL of 0.1 to the post-SFT policy plus updates
    # in proportion to the groups whose rewards varied keep any family from collapsing onto one
    # answer: +0.27 to +0.43 on seeds 0-4 (docs/rl.md, bench/results/rl_demo_seeds.json)
    rc = RLConfig(envs=DEMO_ENVS, steps=steps if steps is not None else 100, sft_steps=15,
                  prompts_per_step=8, group_size=8, seq_len=80, num_slots=64,
                  temperature=1.0, heldout_tasks=16, heldout_samples=4,
                  max_sampling_rounds=2, kl_coef=0.1, scale_update_by_kept=True,
                  minibatches_per_step=2,
                  length_penalty={"low": 0.1, "high": 0.02, "max": 0.0})
    tc = TrainConfig(steps=rc.optimizer_steps, learning_rate=3e-3, schedule="constant",
                     warmup_steps=10, weight_decay=0.0, checkpoint_every=50,
                     seed=seed if seed is not None else 0)
    return "tiny", tc, rc


def enable_compilation_cache(path: str | Path) -> None:
    """Persist compiled XLA programs (reruns of the demo skip the compiles)."""
    import jax

    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def run_demo(config, tc: TrainConfig, rc: RLConfig, run_dir: str | Path, *,
             resume: bool = False, progress: bool = True, mesh=None, out=print) -> int:
    import jax

    from kdsa.train.rl import rollout as ro
    from kdsa.train.rl.loop import run_rl
    from kdsa.train.metrics import read_metrics
    from kdsa.train.rl.plot import reward_curve

    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    result = run_rl(config, tc, rc, run_dir, resume=resume, progress=progress, mesh=mesh)
    if result.stopped:
        return 143
    # every RL step of the run, the steps before a --resume included (from its metrics file)
    rows = read_metrics(run_dir / "metrics.jsonl") or [dict(result.metrics[s], step=s)
                                                       for s in sorted(result.metrics)]
    png = run_dir / "reward_curve.png"
    levels = [k for k, w in rc.effort_weights.items() if w > 0]
    if jax.process_index() == 0:  # multi-host: every process ran the same job
        reward_curve(png, [r["step"] for r in rows], rows, envs=list(result.envs),
                     efforts=levels, heldout_before=result.heldout_before,
                     heldout_after=result.heldout_after)
    out(f"reward curve: {png}  (rollout score per environment and per effort level over the "
        f"RL steps; held-out reward before/after RL)")
    out(f"final checkpoint: {run_dir / 'checkpoints' / str(result.final_step)}")
    sampler = result.sampler
    tasks = [(env.task(i, "heldout"), levels[i % len(levels)])
             for env in result.envs.values() for i in range(2)]
    eps = ro.run_episodes(sampler.engine, sampler.fmt, result.envs, tasks, group_size=1,
                          rc=rc.replace(temperature=rc.temperature), seed=tc.seed + 99)
    out("answers of the final policy (held-out tasks):")
    for e in eps:
        q = e.task.messages[-1].content
        a = e.texts[-1] if e.texts else "(truncated)"
        demo = result.envs[e.task.env].demonstration(e.task)
        ref = f"  (reference {demo[-1].content!r})" if demo else ""
        out(f"  [{e.task.env}, effort {e.effort}] {q!r} -> {a!r}  reward "
            f"{max(e.score, 0):.2f}{ref}")
    if result.heldout_before_by_domain and result.heldout_after_by_domain:
        out("held-out reward per environment: " + ", ".join(
            f"{d} {result.heldout_before_by_domain[d]:.3f} -> {v:.3f}"
            for d, v in result.heldout_after_by_domain.items()))
    out(f"wall time {time.perf_counter() - t0:.0f} s, {rc.sft_steps} SFT + {rc.steps} RL steps")
    out(f"held-out reward: before {result.heldout_before:.3f} -> after "
        f"{result.heldout_after:.3f}")
    return 0


def default_cache_dir() -> Path:
    return Path(os.environ.get("KDSA_CACHE", Path.home() / ".cache" / "kdsa")) / "jax"


if __name__ == "__main__":  # python -m kdsa.train.rl.demo RUN_DIR [SFT_STEPS RL_STEPS]
    from kdsa.model.config import get_preset

    enable_compilation_cache(default_cache_dir())
    name, tc, rc = demo_configs()
    if len(sys.argv) > 3:
        rc = rc.replace(sft_steps=int(sys.argv[2]), steps=int(sys.argv[3]))
    sys.exit(run_demo(get_preset(name), tc, rc, sys.argv[1]))
