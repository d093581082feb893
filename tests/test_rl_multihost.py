"""Multi-host RL (``train/rl/multihost.py``): ``kdsa launch-local --processes 2
--devices-per-process 4 -- rl --mesh fsdp=2,expert=2,tensor=2 ...`` splits each step's rollouts
between the processes and runs the update on the train layout over all 8 devices (each process
holding its shards of the state), and takes the same steps as the one-device, one-process run
of the same command: one SFT step, then two RL steps on a trivially learnable environment
(tiny 2-layer model, KDA + Gated DSA with MoE; routing replay, KL to the reference and
token-level TIS on). Step by step: the same rewards (the rollouts drew the same tokens), losses
and KL within 1e-4 (sums of O(1) terms that nearly cancel: compared in absolute terms), grad
norms, entropy and the routing-replay agreement within 1e-4 relative; the training router
agrees with the replayed experts (same weights); the two-process run logs 8 ``update_devices``
and the weight-sync seconds (its samplers get their weights by resharding the sharded train
state). Adam's eps is 1e-4: early Adam steps move a parameter by ~lr * sign(g) wherever |g| >>
eps, so a gradient of 1e-9 and its float32 reduction-order twin of -1e-9 would move 2 * lr
apart; what is compared is the sharded gradient, not Adam's sign.

This one test covers the RL job on the train layout (``fsdp=2,expert=2,tensor=2``), the
multi-process split and routing replay in the loop; each of them alone would compile the same
programs again.

Both runs go through the CLI in subprocesses with the same XLA flags; the two processes share
compiled programs (``KDSA_SHARE_COMPILES``)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from launch_env import launch_env

TESTS = Path(__file__).parent
SETS = ["num_hidden_layers=2", "linear_attn_config.kda_layers=[1]",
        "linear_attn_config.full_attn_layers=[2]"]
RL_SETS = ['envs=["test_first_letter"]', "prompts_per_step=4", "group_size=4", "seq_len=64",
           "num_slots=16", 'reasoning_caps={"low": 0, "high": 0, "max": 0}',
           'token_budgets={"low": 2, "high": 2, "max": 2}', "truncation_penalty=0.0",
           "max_sampling_rounds=1", "sft_steps=1", "routing_replay=true", "heldout_tasks=1",
           "heldout_samples=2", "kl_coef=0.01", 'tis="token"']
TRAIN_SETS = ["learning_rate=0.001", 'schedule="constant"', "warmup_steps=0", "eps=1e-4"]


def _args(run_dir: Path) -> list[str]:
    return (["rl", "--preset", "tiny", "--steps", "2", "--run-dir", str(run_dir),
             "--no-progress", "--no-compile-cache"]
            + [a for s in SETS for a in ("--set", s)]
            + [a for s in RL_SETS for a in ("--rl-set", s)]
            + [a for s in TRAIN_SETS for a in ("--train-set", s)])


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_two_process_rl_splits_rollouts_and_equals_one_process(tmp_path):
    env = launch_env(KDSA_SHARE_COMPILES=str(tmp_path / "jax_cache"))
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run([sys.executable, "-m", "rl_entry", *_args(one)], env=env,
                            capture_output=True, text=True, timeout=400)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", "--processes", "2",
           "--devices-per-process", "4", "--timeout", "400", "--module", "rl_entry", "--",
           *_args(two), "--mesh", "fsdp=2,expert=2,tensor=2"]
    double = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=450)
    assert double.returncode == 0, double.stdout[-4000:] + double.stderr[-4000:]

    a, b = _lines(one / "metrics.jsonl"), _lines(two / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        print(f"step {ra['step']}: reward {ra['reward']:.4f} / {rb['reward']:.4f}, pg_loss "
              f"{ra.get('pg_loss', 0):.6f} / {rb.get('pg_loss', 0):.6f}, episodes here "
              f"{ra['rollout_episodes_here']:.0f} / {rb['rollout_episodes_here']:.0f}")
        n = ra["sampled_groups"] * 4
        assert ra["rollout_episodes_here"] == n and rb["rollout_episodes_here"] == n / 2
        assert ra["update_devices"] == 1 and rb["update_devices"] == 8
        # the same tokens sampled: the sharded update differs only by rounding
        assert rb["reward"] == ra["reward"] and rb["kept_groups"] == ra["kept_groups"]
        assert rb["sync_seconds"] > 0
        if ra.get("updated") == 1.0:
            assert ra["routing_replay_agreement"] >= 0.99, ra
            # expert parallel, dropless: every assignment fits (one device: no such metric)
            assert rb["moe_dropped"] == 0 and "moe_dropped" not in ra, (ra, rb)
            for k in ("loss", "pg_loss", "kl"):
                np.testing.assert_allclose(rb[k], ra[k], rtol=0, atol=1e-4, err_msg=k)
        for k in ("grad_norm", "entropy", "routing_replay_agreement"):
            if k in ra:
                np.testing.assert_allclose(rb[k], ra[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert sum(r.get("updated") == 1.0 for r in a) >= 1, a
    sa, sb = _lines(one / "sft" / "metrics.jsonl"), _lines(two / "sft" / "metrics.jsonl")
    np.testing.assert_allclose(sb[0]["ce"], sa[0]["ce"], rtol=1e-5)
    assert sb[0]["moe_dropped"] == 0 and "moe_dropped" not in sa[0]
    np.testing.assert_allclose(sb[0]["grad_norm"], sa[0]["grad_norm"], rtol=1e-4)
    held = [x for x in double.stdout.splitlines() if "held-out reward:" in x]
    assert held and held[-1].split("] ", 1)[-1] in single.stdout, (held, single.stdout[-500:])
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit())[-1] \
        == 3
