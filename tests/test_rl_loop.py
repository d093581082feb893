"""The RL loop end to end on a trivially learnable environment (tiny model, 2 layers: KDA +
Gated DSA with MoE): the reward rises within a bounded number of steps (with a KL term to the
initial policy, logged); a run stopped after step 2 and resumed (reference policy restored)
takes step 3 exactly as the uninterrupted run; a greedy episode cut by the per-step token cap
and continued equals the one generated in one go. One shared generation side (compiled once),
the update step at XLA opt level 0."""

import json

import numpy as np
import pytest

import rl_entry  # noqa: F401  registers test_first_letter (reward: a lowercase first letter)
from kdsa.model.overrides import apply_overrides
from kdsa.model.config import get_preset
from kdsa.train.config import TrainConfig
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.loop import run_rl

FAST = {"xla_backend_optimization_level": 0}

CONFIG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                              "linear_attn_config.kda_layers=[1]",
                                              "linear_attn_config.full_attn_layers=[2]"])
ZERO = {"low": 0, "high": 0, "max": 0}
RC = RLConfig(envs=("test_first_letter",), steps=10, prompts_per_step=4, group_size=8,
              seq_len=64, num_slots=32, reasoning_caps=ZERO,  # think closed at once (forced)
              token_budgets={"low": 2, "high": 2, "max": 2},  # forced close + one answer token
              truncation_penalty=0.0, max_sampling_rounds=1, tis="token", kl_coef=0.01,
              temperature=0.7)  # the trained policy is the tempered one the engine samples
TC = TrainConfig(steps=10, learning_rate=1e-2, schedule="constant", warmup_steps=0,
                 weight_decay=0.0, checkpoint_every=100, seed=0)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_rl(CONFIG, TC, RC, tmp_path_factory.mktemp("rl_full"), progress=False,
                  evaluate_heldout=False, compiler_options=FAST)


def test_reward_rises_on_a_trivial_environment(full_run):
    r = [full_run.rewards[s] for s in sorted(full_run.rewards)]
    assert len(r) == 10
    assert np.mean(r[-3:]) > np.mean(r[:3]) + 0.25, r
    m = full_run.metrics[1]
    assert m["updated"] == 1.0
    for k in ("reward/test_first_letter", "pg_loss", "mismatch_abs", "sync_seconds",
              "rollout_tokens_per_s", "kept_groups", "gen_tokens/low"):
        assert k in m
    print(f"mismatch_abs per step: {[full_run.metrics[s].get('mismatch_abs') for s in range(1, 11)]}")
    assert m["mismatch_abs"] < 1e-3  # sampler and trainer: the same (tempered) policy
    # KL to the reference (the weights before RL: no SFT here): 0 before the first update
    assert abs(m["kl"]) < 1e-6 and full_run.metrics[3]["kl"] > 1e-6


def test_stop_and_resume_takes_the_same_step(full_run, tmp_path):
    rc, tc = RC.replace(steps=3), TC
    kw = dict(progress=False, evaluate_heldout=False, compiler_options=FAST,
              sampler=full_run.sampler)
    a = run_rl(CONFIG, tc, rc, tmp_path, stop_at=2, **kw)
    assert a.stopped and a.final_step == 2
    # another task stream (effort draws) is refused by name before anything is read
    other = dict(rc.effort_weights, low=rc.effort_weights["low"] + 1.0)
    with pytest.raises(ValueError, match=r"rl\.effort_weights: checkpoint"):
        run_rl(CONFIG, tc, rc.replace(effort_weights=other), tmp_path, resume=True, **kw)
    reordered = dict(reversed(list(rc.effort_weights.items())))  # draws index the levels
    with pytest.raises(ValueError, match=r"rl\.effort_weights: checkpoint"):
        run_rl(CONFIG, tc, rc.replace(effort_weights=reordered), tmp_path, resume=True, **kw)
    b = run_rl(CONFIG, tc, rc, tmp_path, resume=True, **kw)
    assert b.resumed_from == 2 and b.final_step == 3
    for k in ("reward", "pg_loss", "grad_norm", "kept_groups", "kl"):
        assert b.metrics[3][k] == full_run.metrics[3][k], k
    _resumes_that_are_refused(tmp_path, rc, tc, kw)


def _resumes_that_are_refused(run_dir, rc, tc, kw):
    """``--resume`` refusals that leave the run as it was: a checkpoint past ``--steps`` (it
    used to report the run finished without a step), a ``kdsa train`` run's checkpoints (a
    TypeError traceback after reading them), and no readable checkpoint at all (it used to
    start over in the folder: its ``metrics.jsonl`` emptied, its reference set aside, the
    checkpoints renamed ``N.corrupt`` by the first save)."""
    import shutil

    with pytest.raises(ValueError, match=r"checkpoint .*/3 is past this run's 2 steps .*"
                                         r"--steps 3"):
        run_rl(CONFIG, tc, rc.replace(steps=2), run_dir, resume=True, **kw)
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    train_like, unreadable = run_dir.parent / "train_like", run_dir.parent / "unreadable"
    for other in (train_like, unreadable):
        shutil.copytree(run_dir, other)
    for step in steps:
        meta_file = train_like / "checkpoints" / str(step) / "meta" / "data.json"
        meta = json.loads(meta_file.read_text())
        meta["data_index"] = meta.pop("task_counter")
        meta_file.write_text(json.dumps(meta))
        for f in (unreadable / "checkpoints" / str(step) / "state").rglob("*"):
            if f.is_file() and f.parent.name == "d" and f.stat().st_size > 1000:
                f.write_bytes(bytes(f.stat().st_size))  # the array bytes zeroed
    with pytest.raises(ValueError, match="not a kdsa rl checkpoint .*kdsa train --resume"):
        run_rl(CONFIG, tc, rc, train_like, resume=True, **kw)
    metrics = (unreadable / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="--resume: no readable checkpoint in"):
        run_rl(CONFIG, tc, rc, unreadable, resume=True, **kw)
    assert (unreadable / "metrics.jsonl").read_text() == metrics and metrics
    assert sorted(p.name for p in (unreadable / "checkpoints").iterdir()
                  if p.name[0].isdigit()) == [str(s) for s in steps]


def test_partial_rollout_continues_the_greedy_episode(full_run):
    from kdsa.train.rl import rollout as ro

    s, envs = full_run.sampler, full_run.envs
    rc = RC.replace(token_budgets={"low": 9, "high": 9, "max": 9},
                    reasoning_caps={"low": 0, "high": 4, "max": 16})
    tasks = [(envs["test_first_letter"].task(0), e) for e in ("low", "high", "max")]
    kw = dict(rc=rc, seed=0, temperature=0.0)
    whole = ro.play(s.engine, s.fmt, envs, ro.start_episodes(s.fmt, tasks, 1), **kw)
    cut = ro.start_episodes(s.fmt, tasks, 1)
    ro.play(s.engine, s.fmt, envs, cut, step_cap=3, **kw)
    assert any(e.paused and not e.done for e in cut)
    ro.play(s.engine, s.fmt, envs, cut, **kw)
    for a, b in zip(whole, cut):
        assert b.done and a.tokens == b.tokens and a.mask == b.mask and a.texts == b.texts
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-4)


def test_an_error_mid_run_still_writes_the_finished_steps(full_run, tmp_path, monkeypatch):
    """An error in RL step 2 reaches the caller unchanged, and step 1 is in ``metrics.jsonl`` and
    in TensorBoard's file (buffered for 10 s; the run closes its writers on the way out)."""
    import json

    from kdsa.train.rl import loop
    from test_train_step import _events

    real, calls = loop._rl_iteration, []

    def breaks_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("an environment broke")
        return real(*a, **kw)

    monkeypatch.setattr(loop, "_rl_iteration", breaks_second)
    with pytest.raises(RuntimeError, match="an environment broke"):
        run_rl(CONFIG, TC, RC.replace(steps=3), tmp_path, progress=False,
               evaluate_heldout=False, compiler_options=FAST, sampler=full_run.sampler)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    (events,) = tmp_path.glob("events.out.tfevents.*")
    assert {e.step for e in _events(events) for v in e.summary.value} == {1}


def test_sft_and_rl_steps_run_one_compiled_step(full_run, tmp_path):
    """SFT warm-up steps and RL steps call the one compiled update with the same arguments (an
    SFT step once passed one argument fewer, and the whole step compiled a second time: 9 s of
    a 29 s ``tiny`` RL run, minutes on a large model): a run of 1 SFT + 1 RL step with this
    file's shapes compiles nothing new after ``full_run``."""
    from kdsa.train.rl.step import rl_step_with_options

    step_fn = rl_step_with_options(tuple(sorted(FAST.items())))
    compiled = step_fn._cache_size()
    run = run_rl(CONFIG, TC, RC.replace(steps=1, sft_steps=1), tmp_path, progress=False,
                 evaluate_heldout=False, compiler_options=FAST, sampler=full_run.sampler)
    assert run.final_step == 2 and (tmp_path / "sft" / "metrics.jsonl").is_file()
    assert step_fn._cache_size() == compiled


@pytest.mark.parametrize("k, prompts, micro", [(2, 4, 8), (3, 3, 4)])
def test_sft_steps_take_the_micro_batches_of_rl_updates(full_run, tmp_path, monkeypatch, k,
                                                        prompts, micro):
    """With ``minibatches_per_step=k`` an SFT step's rows (a whole rollout batch) go through the
    update in k x ``accum_steps`` micro-batches, so each holds the rows of an RL mini-batch's
    micro-batch, the size ``kdsa plan`` and the layout check allowed for (it was k x that);
    k = 3 with ``train.batch_size`` 8 (unused by RL, not divisible by 3 x 2) used to fail
    TrainConfig's check. The step is recorded, not run."""
    from kdsa.train.rl import loop

    seen = []

    class Recorded(Exception):
        pass

    def record(graphdef, state, batch, *a, tc, **kw):
        seen.append(batch["inputs"].shape[0] // tc.accum_steps)
        raise Recorded

    monkeypatch.setattr(loop, "rl_step_with_options", lambda options: record)
    rc = RC.replace(steps=1, sft_steps=1, minibatches_per_step=k, prompts_per_step=prompts)
    tc = TC.replace(accum_steps=2)
    with pytest.raises(Recorded):
        run_rl(CONFIG, tc, rc, tmp_path, progress=False, evaluate_heldout=False,
               compiler_options=FAST, sampler=full_run.sampler)
    assert seen == [rc.rows_per_micro_batch(tc.accum_steps)] == [micro]


def test_sigterm_in_the_final_evaluation_stops_it_and_resume_finishes(full_run, tmp_path,
                                                                     monkeypatch):
    """A SIGTERM that reaches the engine's decode step in the held-out evaluation after the last
    step stops the evaluation at once (through the engine's per-step error guards, which would
    otherwise abort the requests and go on), skips the export (the last checkpoint is
    complete) and leaves the engine idle; ``--resume`` evaluates and exports without taking a
    step again."""
    import os
    import signal
    import threading

    from kdsa.train.rl import loop

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed in the main thread only")
    runner, engine = full_run.sampler.runner, full_run.sampler.engine
    real_eval, real_decode = loop.evaluate, runner.decode
    calls, fired, handler = [], [], signal.getsignal(signal.SIGTERM)

    def evaluate(*a, **kw):  # the first call is the evaluation before RL
        calls.append(1)
        return real_eval(*a, **kw)

    def decode(*a, **kw):
        if len(calls) == 2 and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_decode(*a, **kw)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    monkeypatch.setattr(runner, "decode", decode)
    rc = RC.replace(steps=1, heldout_tasks=1, heldout_samples=2)
    kw = dict(progress=False, compiler_options=FAST, sampler=full_run.sampler)
    a = run_rl(CONFIG, TC, rc, tmp_path, **kw)
    assert fired and a.stopped and a.final_step == 1 and len(calls) == 2
    assert a.heldout_before is not None and a.heldout_after is None
    assert (tmp_path / "checkpoints" / "1").is_dir() and not (tmp_path / "model").exists()
    assert not engine.has_work() and engine.healthy  # the interrupted batch was aborted
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's handler again
    b = run_rl(CONFIG, TC, rc, tmp_path, resume=True, **kw)
    assert not b.stopped and b.resumed_from == 1 and b.final_step == 1 and len(calls) == 3
    assert b.heldout_before == a.heldout_before and b.heldout_after is not None
    assert (tmp_path / "model").is_dir()  # RUN_DIR/model: the export


def test_sigterm_while_the_last_checkpoint_is_written_waits_for_it(full_run, tmp_path,
                                                                  monkeypatch):
    """A SIGTERM while the last step's checkpoint is being written waits for the write (it
    used to interrupt the wait, leaving the checkpoint in Orbax's temporary folder while the
    log called it complete), then stops before the evaluation, without the export."""
    import os
    import signal
    import threading

    from kdsa.train.rl import loop

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed in the main thread only")
    real_wait, real_eval, calls, fired, said = loop.Checkpointer.wait, loop.evaluate, [], [], []

    def evaluate(*a, **kw):  # the first call is the evaluation before RL
        calls.append(1)
        return real_eval(*a, **kw)

    def wait(self):
        if len(calls) == 1 and not fired:  # after the last step: the final wait
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_wait(self)

    def log(msg):
        if "is complete" in msg:  # the checkpoint is in place when the log says so
            said.append((tmp_path / "checkpoints" / "1").is_dir())

    monkeypatch.setattr(loop, "evaluate", evaluate)
    monkeypatch.setattr(loop.Checkpointer, "wait", wait)
    rc = RC.replace(steps=1, heldout_tasks=1, heldout_samples=2)
    a = run_rl(CONFIG, TC, rc, tmp_path, progress=False, compiler_options=FAST,
               sampler=full_run.sampler, log=log)
    assert fired and a.stopped and a.final_step == 1 and len(calls) == 1 and said == [True]
    assert not (tmp_path / "model").exists() and a.heldout_after is None
