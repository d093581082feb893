"""Checkpoints: bit-exact resume, corrupted-latest fallback, SIGTERM mid-run then resume; a
corrupt newest step replaced after the fallback (and never outliving readable ones), a resume
with another config named field by field, metrics without repeated steps, and a training
checkpoint loaded for generation."""

import dataclasses
import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from kdsa.model.config import get_preset
from kdsa.train.checkpointing import Checkpointer, flatten_state
from kdsa.train.config import TrainConfig
from kdsa.train.trainer import prepare, run_training

TC = TrainConfig(steps=6, batch_size=4, seq_len=16, accum_steps=2, warmup_steps=2,
                 checkpoint_every=3, keep_checkpoints=3, learning_rate=1e-2, seed=3)


def small_config():
    cfg = get_preset("tiny")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=(2,))
    return cfg.replace(num_hidden_layers=2, attn_res_block_size=None, linear_attn_config=lac)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    return run_dir, run_training(small_config(), TC, run_dir, progress=False)


def test_resume_is_bit_exact(full_run, tmp_path, caplog):
    _, full = full_run
    assert sorted(full.losses) == [1, 2, 3, 4, 5, 6] and not full.stopped
    with jax.log_compiles(True):
        first = run_training(small_config(), TC, tmp_path, progress=False, stop_at=3)
        assert first.stopped and first.final_step == 3
        rest = run_training(small_config(), TC, tmp_path, progress=False, resume=True)
    # the restored state is committed to the device like the step-0 state: the step the full
    # run compiled serves both (uncommitted host arrays compiled it again)
    assert sum("Compiling jit(_train_step)" in r.getMessage() for r in caplog.records) == 0
    assert rest.resumed_from == 3 and rest.final_step == 6
    for step in (1, 2, 3):
        assert first.losses[step] == full.losses[step]
    for step in (4, 5, 6):
        assert rest.losses[step] == full.losses[step], (step, rest.losses, full.losses)
    assert full.losses[6] != full.losses[3]  # the losses do change from step to step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(k in rows[0] for k in ("loss", "grad_norm", "learning_rate", "tokens_per_s",
                                      "expert_load_max_over_mean", "indexer_kl"))
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_train_refuses_to_resume_an_rl_run(full_run, tmp_path):
    """``kdsa train --resume`` into a ``kdsa rl`` run folder (whose checkpoints hold a task
    counter, not a data index) is refused by name (a KeyError traceback before)."""
    import shutil

    run_dir, _ = full_run
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    for step in (3, 6):
        meta_file = tmp_path / "checkpoints" / str(step) / "meta" / "data.json"
        meta = json.loads(meta_file.read_text())
        meta["task_counter"], meta["rl_config"] = meta.pop("data_index"), {"steps": 6}
        meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a kdsa train checkpoint .*kdsa rl --resume"):
        run_training(small_config(), TC, tmp_path, progress=False, resume=True)


def test_resume_past_the_steps_is_refused(full_run, tmp_path):
    """``--resume`` with ``--steps`` below the newest checkpoint's step (e.g. the default 100
    forgotten on a longer run) is refused; it used to report the run finished, export, exit 0."""
    import shutil

    run_dir, _ = full_run
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"checkpoint .*/6 is past --steps 5; give at least "
                                         r"--steps 6"):
        run_training(small_config(), TC.replace(steps=5), tmp_path, progress=False, resume=True)
    assert not (tmp_path / "model").exists()


def test_corrupted_latest_falls_back(full_run, tmp_path):
    run_dir, _ = full_run
    import shutil

    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    ckpt = Checkpointer(tmp_path / "checkpoints", every=3, keep=3)
    assert ckpt.all_steps() == [3, 6]
    data_files = [p for p in (tmp_path / "checkpoints" / "6" / "state").rglob("*")
                  if p.is_file() and p.parent.name == "d" and p.stat().st_size > 1000]
    assert data_files
    for p in data_files:  # garble the array bytes of the newest checkpoint
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2:] = bytes(len(raw) - len(raw) // 2)
        p.write_bytes(bytes(raw))
    messages = []
    template = jax.eval_shape(prepare(small_config(), TC)[3])
    step, state, meta = ckpt.restore_latest(template, log=messages.append)
    ckpt.close()
    assert step == 3 and meta["data_index"] == 3
    assert any("step 6" in m and "falling back to step 3" in m for m in messages), messages
    assert int(state.step) == 3


class _SigtermDuringStep:
    """The run's synthetic data (what ``make_data`` builds for ``TC``) whose ``batch(i)`` first
    sends this process a real SIGTERM when ``i == step - 1``: the signal arrives while the loop
    is running step ``step``, as a scheduler's would (deterministically, not after a race
    between a watcher and the steps)."""

    def __init__(self, config, tc, step: int):
        from kdsa.train.data import SyntheticData

        self.data, self.index = SyntheticData(config.vocab_size, tc.batch_size, tc.seq_len,
                                              tc.seed), step - 1

    def batch(self, i):
        if i == self.index:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.data.batch(i)


def test_sigterm_then_resume(tmp_path):
    """A real SIGTERM mid-run (sent to this process while step 2 runs, as a scheduler would):
    the running step finishes, a checkpoint is saved (step 2, not due with every=3), the run
    reports ``stopped``; ``--resume`` continues from it, and a second SIGTERM (during step 4)
    stops it again. In-process and with the module's ``TC`` so the compiled step of
    ``full_run`` is shared (a subprocess pays interpreter start, model build and compile twice:
    minutes on a loaded 2-core machine); the CLI's exit code 143 for a stopped run is checked in
    ``test_cli_exit_code_after_sigterm``.
    """
    cfg, tc = small_config(), TC
    assert 2 % tc.checkpoint_every and 4 % tc.checkpoint_every and tc.steps > 4
    metrics = tmp_path / "metrics.jsonl"
    messages = []
    first = run_training(cfg, tc, tmp_path, data_path=_SigtermDuringStep(cfg, tc, 2),
                         progress=False, log=messages.append)
    stopped_at = first.final_step
    assert first.stopped and stopped_at == 2, first
    assert any("stopped by SIGTERM" in m for m in messages), messages
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()  # saved although not due

    rest = run_training(cfg, tc, tmp_path, data_path=_SigtermDuringStep(cfg, tc, 4),
                        progress=False, resume=True, log=messages.append)
    assert rest.resumed_from == stopped_at and rest.stopped and rest.final_step == 4
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, rest.final_step + 1))
    assert all(np.isfinite(rest.losses[s]) for s in rest.losses)


def test_sigterm_while_the_last_checkpoint_is_written(tmp_path, monkeypatch):
    """A SIGTERM while the final checkpoint is written (after the last step; minutes on a large
    model) waits for the write: it came after the stop flag had given the signals back, so the
    default handler killed the process mid-write. The run reports ``stopped`` with the
    checkpoint complete and leaves ``RUN_DIR/model`` to ``--resume``, which writes it without
    taking a step."""
    real, fired, messages = Checkpointer.wait, [], []

    def wait(self):  # the trainer's wait for the last save
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(Checkpointer, "wait", wait)
    a = run_training(small_config(), TC, tmp_path, progress=False, log=messages.append)
    assert fired and a.stopped and a.final_step == TC.steps
    assert any("while the last checkpoint was written" in m for m in messages), messages
    assert Checkpointer(tmp_path / "checkpoints", every=3, keep=3).all_steps()[-1] == TC.steps
    assert not (tmp_path / "model").exists()
    monkeypatch.setattr(Checkpointer, "wait", real)
    b = run_training(small_config(), TC, tmp_path, progress=False, resume=True)
    assert b.resumed_from == TC.steps and not b.stopped and not b.losses
    assert (tmp_path / "model").is_dir()


def test_resume_refuses_other_data(tmp_path):
    """A checkpoint records its data's fingerprint (kind, packed rows, a hash of them): a resume
    on an edited file, or without ``--data`` (synthetic rows), is refused by name, since its
    data index would point into other rows (it went on silently); the same file resumes, also
    after a move."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "abc " * (5 + i)}) + "\n"
                            for i in range(12)))
    run = tmp_path / "run"
    tc = TC.replace(peak_flops=1e12)
    first = run_training(small_config(), tc, run, data_path=docs, progress=False, stop_at=2)
    assert first.stopped and first.final_step == 2
    # throughput and MFU count every position computed (4 x 16), not the loss tokens (the
    # packed rows' padding and document ends), and the one device the update ran on
    from kdsa.model.count import count_params

    active = count_params(small_config()).matmul_params  # the embedding lookup left out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["tokens"] < 64 for r in rows), rows
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(6 * active * 64 / r["step_time_s"] / 1e12)
    original = docs.read_text()
    docs.write_text(original + json.dumps({"text": "one more document"}) + "\n")
    for data in (docs, None):
        with pytest.raises(ValueError, match=r"was trained on other data \(jsonl rows="):
            run_training(small_config(), tc, run, data_path=data, progress=False, resume=True)
    moved = tmp_path / "moved.jsonl"
    moved.write_text(original)
    rest = run_training(small_config(), tc, run, data_path=moved, progress=False, resume=True,
                        stop_at=3)
    assert rest.resumed_from == 2 and rest.final_step == 3


def test_cli_exit_code_after_sigterm(tmp_path, monkeypatch):
    """``kdsa train`` exits 143 (128 + SIGTERM) when the run was stopped by the signal."""
    from kdsa.cli.main import main
    from kdsa.train import trainer

    def stopped_run(config, tc, run_dir, **kw):
        return trainer.RunResult(losses={1: 1.0}, final_step=1, stopped=True, resumed_from=None)

    monkeypatch.setattr(trainer, "run_training", stopped_run)
    rc = main(["train", "--preset", "tiny", "--run-dir", str(tmp_path), "--steps", "30",
               "--no-progress"])
    assert rc == trainer.SIGTERM_EXIT_CODE == 143


def _garble(step_dir: Path) -> None:
    """Overwrite the second half of every array data file of a checkpoint step with zeros."""
    files = [p for p in (step_dir / "state").rglob("*")
             if p.is_file() and p.parent.name == "d" and p.stat().st_size > 1000]
    assert files
    for p in files:
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2:] = bytes(len(raw) - len(raw) // 2)
        p.write_bytes(bytes(raw))


def _tiny_state(x: float) -> dict:
    import jax.numpy as jnp

    return {"w": jnp.arange(4096, dtype=jnp.float32) + x,
            "b": {"v": jnp.full((64, 33), x, jnp.float32)}}


def test_corrupt_newest_is_replaced_and_pruning_keeps_the_readable_one(tmp_path):
    """keep=2, steps [1, 2] with 2 corrupt: after the fallback to 1, saving step 3 sets the
    corrupt 2 aside (renamed, not deleted) instead of pruning the readable 1; saving step 2 again
    (a re-done step that "exists") writes it anew."""
    template = jax.eval_shape(lambda: _tiny_state(0.0))
    ck = Checkpointer(tmp_path, every=1, keep=2, async_save=False)
    for s in (1, 2):
        ck.save(s, _tiny_state(s), {"data_index": s})
    ck.close()
    assert json.loads((tmp_path / "2" / "meta" / "data.json").read_text())["data_index"] == 2
    _garble(tmp_path / "2")
    messages = []
    ck = Checkpointer(tmp_path, every=1, keep=2, async_save=False)
    step, _, _ = ck.restore_latest(template, log=messages.append)
    assert step == 1 and ck.skipped == [2]
    assert any("step 2" in m and "falling back to step 1" in m for m in messages), messages
    assert ck.save(3, _tiny_state(3), {"data_index": 3})
    ck.wait()
    assert ck.all_steps() == [1, 3], ck.all_steps()       # 1 kept, the corrupt 2 out of sight
    assert (tmp_path / "2.corrupt").is_dir()
    assert ck.save(2, _tiny_state(20), {"data_index": 2}, force=True)  # no longer "exists"
    ck.close()
    ck = Checkpointer(tmp_path, every=1, keep=2, async_save=False)
    assert ck.all_steps() == [2, 3]
    messages.clear()
    step, state, meta = ck.restore_latest(template, log=messages.append)
    assert step == 3 and not messages and float(state["w"][0]) == 3.0
    ck.close()
    from orbax.checkpoint.experimental import v1 as ocp

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # (no Orbax sharding warning)
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          flatten_state(template))
    got = ocp.load_checkpointables(tmp_path / "2", {"state": placed})
    assert float(got["state"]["w"][0]) == 20.0                # the re-done step 2, readable


def test_process_local_saves_prunes_and_falls_back(tmp_path):
    """``process_local`` (Orbax v1's free functions, this process alone): steps saved, the meta
    item stored as JSON, keep-N pruning in save order, an unfinished save reported, ignored and
    removed by the next save, a corrupt newest step falls back and is set aside, state restored
    onto this process's device."""
    template = jax.eval_shape(lambda: _tiny_state(0.0))
    ck = Checkpointer(tmp_path / "ck", every=2, keep=2, process_local=True)
    assert not ck.save(1, _tiny_state(1), {"data_index": 1})  # not due
    for s in (2, 4, 6):
        assert ck.save(s, _tiny_state(s), {"data_index": s})
    assert not ck.save(6, _tiny_state(6), {"data_index": 6}, force=True)  # exists
    ck.close()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["4", "6"]
    meta = json.loads((tmp_path / "ck" / "6" / "meta" / "data.json").read_text())
    assert meta["data_index"] == 6 and meta["step"] == 6 and set(meta["checksums"]) == {
        "w", "b.v"}
    _garble(tmp_path / "ck" / "6")
    (tmp_path / "ck" / "8.orbax-checkpoint-tmp").mkdir()
    messages = []
    ck = Checkpointer(tmp_path / "ck", every=2, keep=2, process_local=True)
    step, state, meta = ck.restore_latest(template, log=messages.append)
    assert step == 4 and meta["data_index"] == 4 and ck.skipped == [6]
    assert float(state["w"][0]) == 4.0 and isinstance(state["w"], jax.Array)
    assert any("unfinished save 8.orbax-checkpoint-tmp" in m for m in messages), messages
    assert any("step 6" in m and "falling back to step 4" in m for m in messages), messages
    assert ck.save(6, _tiny_state(60), {"data_index": 6}, force=True)
    ck.close()
    ck = Checkpointer(tmp_path / "ck", every=2, keep=2, process_local=True)
    assert ck.all_steps() == [4, 6] and (tmp_path / "ck" / "6.corrupt").is_dir()
    assert not (tmp_path / "ck" / "8.orbax-checkpoint-tmp").exists()  # removed by the save
    assert any("removed unfinished save 8.orbax-checkpoint-tmp" in m for m in messages)
    step, state, _ = ck.restore_latest(template)
    assert step == 6 and float(state["w"][0]) == 60.0
    ck.close()
    # without a corrupt step too, and in a folder with no step (an interrupted first save)
    for folder, steps in ((tmp_path / "ck", [4, 6]), (tmp_path / "fresh", [])):
        (folder / "9.orbax-checkpoint-tmp").mkdir(parents=True)
        messages = []
        ck = Checkpointer(folder, every=2, keep=2, process_local=True)
        got = ck.restore_run(template, resume=bool(steps), model_config={}, train_config={},
                             log=messages.append) if not steps else ck.restore_latest(
                                 template, log=messages.append)
        assert (got is None) == (not steps) and ck.skipped == []
        assert any("ignoring unfinished save 9.orbax-checkpoint-tmp" in m for m in messages)
        assert ck.save(8, _tiny_state(8), {"data_index": 8})
        ck.close()
        assert not (folder / "9.orbax-checkpoint-tmp").exists(), messages


def test_checkpoints_written_with_orbax_v0_still_read(full_run, tmp_path):
    """A step in the layout of Orbax's v0 ``CheckpointManager`` (``state`` StandardSave, ``meta``
    JsonSave: ``meta/metadata``), as kdsa wrote before the v1 port, restores and loads as a
    model."""
    import orbax.checkpoint as ocp0
    from flax import nnx

    from kdsa.model import checkpoint as mck

    run_dir, _ = full_run
    template = jax.eval_shape(prepare(small_config(), TC)[3])
    ck = Checkpointer(run_dir / "checkpoints", every=3, keep=3)
    step, state, meta = ck.restore_latest(template)
    ck.close()
    flat = flatten_state(state)
    old = tmp_path / "checkpoints"
    with ocp0.CheckpointManager(old, item_names=("state", "meta")) as mgr:
        mgr.save(step, args=ocp0.args.Composite(state=ocp0.args.StandardSave(flat),
                                                meta=ocp0.args.JsonSave(meta)))
    assert (old / str(step) / "meta" / "metadata").is_file()
    ck = Checkpointer(old, every=3, keep=3)
    messages = []
    got, state2, meta2 = ck.restore_latest(template, log=messages.append)
    ck.close()
    assert got == step and meta2 == meta and not messages
    for k, v in flatten_state(state2).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat[k]), err_msg=k)
    config, info = mck.read_info(tmp_path)
    assert config == small_config() and info["training"]["step"] == step
    _, model = mck.load_model(tmp_path)
    for k, v in mck.flat_variables(nnx.state(model)).items():
        want = flat.get(f"params.{k}", flat.get(f"rest.{k}"))
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(want), err_msg=k)
    key = next(k for k in mck.flat_variables(nnx.state(model)) if k.endswith("experts.w1"))
    stored = mck.StoredParam(tmp_path, key)  # the export's reads: v0 arrays are zarr (v2)
    np.testing.assert_array_equal(stored.read((slice(None), slice(1, 3))),
                                  np.asarray(flat[f"params.{key}"])[:, 1:3])


def _copy_run(run_dir: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(run_dir / "checkpoints", dst / "checkpoints")
    shutil.copy(run_dir / "metrics.jsonl", dst / "metrics.jsonl")
    return dst


def test_resume_after_a_corrupt_newest_saves_it_again_and_metrics_once(full_run, tmp_path):
    """The run's newest checkpoint (6) is garbled: ``--resume`` falls back to 3, redoes 4-6 with
    the uninterrupted run's losses, saves step 6 anew (the garbled one set aside), and
    ``metrics.jsonl`` lists each step once (the lines of 4-6 written before were dropped)."""
    run_dir, full = full_run
    _copy_run(run_dir, tmp_path)
    _garble(tmp_path / "checkpoints" / "6")
    messages = []
    rest = run_training(small_config(), TC, tmp_path, progress=False, resume=True,
                        log=messages.append)
    assert rest.resumed_from == 3 and rest.final_step == 6
    assert [rest.losses[s] for s in (4, 5, 6)] == [full.losses[s] for s in (4, 5, 6)]
    assert any("step 6" in m and "falling back to step 3" in m for m in messages), messages
    assert (tmp_path / "checkpoints" / "6.corrupt").is_dir()
    ck = Checkpointer(tmp_path / "checkpoints", every=3, keep=3)
    assert ck.all_steps() == [3, 6]
    messages.clear()
    step, state, meta = ck.restore_latest(jax.eval_shape(prepare(small_config(), TC)[3]),
                                          log=messages.append)
    ck.close()
    assert step == 6 and int(state.step) == 6 and meta["data_index"] == 6 and not messages
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], steps


def test_a_fresh_run_replaces_the_metrics_of_one_that_saved_no_checkpoint(tmp_path):
    """An earlier run into the folder stopped before its first checkpoint, leaving metrics of
    steps 1-4: a fresh run (no checkpoint to resume) writes each of its steps once."""
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 5)))
    run_training(small_config(), TC, tmp_path, progress=False, stop_at=2)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] != 9.0


def test_metrics_truncated_to_the_resumed_step(tmp_path):
    """``MetricsWriter(resume_step=k)`` keeps steps <= k (and drops a torn last line)."""
    from kdsa.train.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8))
                    + '{"step": 8, "lo')
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=5)
    writer.write(6, {"loss": 0.5})
    writer.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_with_another_config_names_the_fields(full_run, tmp_path):
    """A changed model config, optimizer and batch size: one ``ValueError`` line naming each
    differing field with both values, nothing called corrupt, no checkpoint set aside."""
    run_dir, _ = full_run
    _copy_run(run_dir, tmp_path)
    base = small_config()
    changed = base.replace(intermediate_size=base.intermediate_size + 32)
    messages = []
    with pytest.raises(ValueError) as e:
        run_training(changed, TC.replace(optimizer="muon", batch_size=8), tmp_path,
                     progress=False, resume=True, log=messages.append)
    msg = str(e.value)
    assert "\n" not in msg and "corrupt" not in msg, msg
    assert (f"intermediate_size: checkpoint {base.intermediate_size}, now "
            f"{base.intermediate_size + 32}") in msg, msg
    assert "train.optimizer: checkpoint adamw, now muon" in msg, msg
    assert "train.batch_size: checkpoint 4, now 8" in msg, msg  # the data position's unit
    assert "checkpoints/6 was written with another config" in msg, msg
    assert not any("corrupt" in m for m in messages), messages
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "6"]


def test_a_second_run_into_a_folder_with_checkpoints_needs_resume(full_run, tmp_path):
    """Without ``--resume`` a run dir that holds another run's checkpoints is refused before
    anything is built (before, the new run's saves of existing steps were skipped silently)."""
    run_dir, _ = full_run
    _copy_run(run_dir, tmp_path)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"already holds checkpoints \(steps \[3, 6\]\); pass "
                                         r"--resume to continue that run"):
        run_training(small_config(), TC, tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_a_training_checkpoint_loads_for_generation(full_run, tmp_path, monkeypatch):
    """``load_model`` reads the model out of ``RUN_DIR/checkpoints/6`` (and of
    ``RUN_DIR/checkpoints`` and ``RUN_DIR``: the newest step) with the trained state's arrays,
    and ``kdsa generate --checkpoint`` accepts it, given as a relative path."""
    from flax import nnx

    from kdsa.cli.main import main
    from kdsa.model import checkpoint as mck

    run_dir, _ = full_run
    ck = Checkpointer(run_dir / "checkpoints", every=3, keep=3)
    step, state, _ = ck.restore_latest(jax.eval_shape(prepare(small_config(), TC)[3]))
    ck.close()
    trained = {k: np.asarray(v) for k, v in flatten_state(state).items()}
    for path in (run_dir / "checkpoints" / "6", run_dir / "checkpoints", run_dir):
        config, info = mck.read_info(path)
        assert config == small_config() and info["training"]["step"] == 6
        _, model = mck.load_model(path)
        got = mck.flat_variables(nnx.state(model))
        assert got
        for k, v in got.items():
            want = trained.get(f"params.{k}", trained.get(f"rest.{k}"))
            np.testing.assert_array_equal(np.asarray(v[...]), want, err_msg=k)
    monkeypatch.chdir(tmp_path)
    os.symlink(run_dir, tmp_path / "run")
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [5, 17, 3],
                                                   "ignore_eos": True}) + "\n")
    assert main(["generate", "--checkpoint", "run/checkpoints/6", "--prompts", "in.jsonl",
                 "--out", "out.jsonl", "--temperature", "0", "--max-tokens", "3", "--slots",
                 "1", "--max-len", "32", "--prefill-chunk", "16", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a"] and len(rows[0]["token_ids"]) == 3


class _BrokenAt:
    """Synthetic batches, then an error for batch ``index`` (a data source failing mid-run)."""

    def __init__(self, config, tc, index: int):
        from kdsa.train.data import SyntheticData

        self.data, self.index = SyntheticData(config.vocab_size, tc.batch_size, tc.seq_len,
                                              tc.seed), index

    def batch(self, i):
        if i == self.index:
            raise RuntimeError("the data source broke")
        return self.data.batch(i)


def test_an_error_mid_run_keeps_the_checkpoint_and_the_metrics(tmp_path):
    """An error in step 4, right after step 3's checkpoint went to its background save: the
    error reaches the caller unchanged, the checkpoint is complete and resumable, and every
    finished step is in ``metrics.jsonl`` and in TensorBoard's file (its writer buffers events
    for 10 s; the run closes it on the way out)."""
    from test_train_step import _events

    cfg, tc = small_config(), TC
    assert tc.checkpoint_every == 3
    with pytest.raises(RuntimeError, match="the data source broke"):
        run_training(cfg, tc, tmp_path, data_path=_BrokenAt(cfg, tc, 3), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    (events,) = tmp_path.glob("events.out.tfevents.*")
    steps = sorted(e.step for e in _events(events) for v in e.summary.value
                   if v.tag == "train/loss")
    assert steps == [1, 2, 3]
    assert Checkpointer(tmp_path / "checkpoints", every=3, keep=3).all_steps() == [3]
    rest = run_training(cfg, tc, tmp_path, progress=False, resume=True)
    assert rest.resumed_from == 3 and rest.final_step == tc.steps
