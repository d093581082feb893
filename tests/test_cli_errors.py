"""Bad input and a hostile environment give one line and a non-zero exit, before anything
compiles: model configs with wrong JSON types or nulls, train configs with wrong types, a
read-only or full run dir, documents of the wrong type; Ctrl-C saves like SIGTERM; short runs
work with the default warm-up."""

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from kdsa.cli.main import main
from kdsa.model.config import ModelConfig, get_preset
from kdsa.train.config import TrainConfig
from kdsa.train.data import PackedJsonlData
from kdsa.train.trainer import _StopFlag, stop_reason

BAD_VALUES = (None, "x", -1, 0, 1.5, [], {}, True, [1, "a"], {"a": 1})


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith(f"kdsa {command}: error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_every_bad_model_config_value_is_a_value_error():
    base = get_preset("tiny-vl").to_hf_config()
    cases = 0
    for key, value in base.items():
        subs = [(key, None)] + [(key, sub) for sub in (value if isinstance(value, dict) else ())]
        for top, sub in subs:
            for bad in BAD_VALUES:
                hf = json.loads(json.dumps(base))
                if sub is None:
                    hf[top] = bad
                else:
                    hf[top][sub] = bad
                try:
                    ModelConfig.from_hf_config(hf)
                except ValueError:
                    cases += 1
    assert cases > 500  # most of them are refused; none raised anything but ValueError


def test_null_and_wrongly_typed_fields_are_named():
    hf = get_preset("tiny").to_hf_config()
    with pytest.raises(ValueError, match=r"no value for vocab_size \(missing or null\)"):
        ModelConfig.from_hf_config(dict(hf, vocab_size=None))
    with pytest.raises(ValueError, match="rms_norm_eps must be a finite number, got 'x'"):
        ModelConfig.from_hf_config(dict(hf, rms_norm_eps="x"))
    # Infinity (JSON's extension) converted into a model whose every logit was NaN or 0, a
    # rope_theta of 0 or below into other logits
    for key in ("routed_scaling_factor", "rms_norm_eps"):
        with pytest.raises(ValueError, match=f"{key} must be a finite number, got inf"):
            ModelConfig.from_hf_config(dict(hf, **{key: float("inf")}))
    with pytest.raises(ValueError, match="rms_norm_eps must be a finite number"):
        ModelConfig.from_hf_config(dict(hf, rms_norm_eps=10 ** 400))  # (OverflowError before)
    with pytest.raises(ValueError, match="rope_theta must be > 0, got 0"):
        ModelConfig.from_hf_config(dict(hf, rope_theta=0))
    with pytest.raises(ValueError, match="rope_scaling must be an object"):
        ModelConfig.from_hf_config(dict(hf, rope_scaling="yarn"))
    with pytest.raises(ValueError, match="kda_layers must be a list of integers"):
        ModelConfig.from_hf_config(dict(hf, linear_attn_config=dict(
            hf["linear_attn_config"], kda_layers=[1, "a"])))


def test_config_file_with_null_vocab_is_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(get_preset("tiny").to_hf_config(), vocab_size=None)))
    assert main(["params", "--config", str(path)]) == 2
    assert "vocab_size (missing or null)" in _one_error_line(capsys, "params")


def test_train_config_types_are_checked():
    for field, bad in (("learning_rate", "x"), ("b1", None), ("eps", float("nan")),
                       ("clip_norm", [1]), ("weight_decay", float("inf"))):
        with pytest.raises(ValueError, match=f"train.{field} must be a finite number"):
            TrainConfig(**{field: bad})


def test_train_set_bad_learning_rate_is_one_line(tmp_path, capsys):
    code = main(["train", "--preset", "tiny", "--steps", "3", "--run-dir",
                 str(tmp_path / "run"), "--train-set", 'learning_rate="x"'])
    assert code == 2
    assert "train.learning_rate must be a finite number, got 'x'" in _one_error_line(capsys,
                                                                                    "train")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_default_warmup_fits_short_and_long_runs():
    assert TrainConfig(steps=3).warmup == 0  # `kdsa train --steps 3` is a valid run
    assert TrainConfig(steps=50).warmup == 5
    assert TrainConfig(steps=1000).warmup == 10
    assert TrainConfig(steps=3, warmup_steps=1).warmup == 1
    with pytest.raises(ValueError, match="must exceed warmup_steps=5"):
        TrainConfig(steps=5, warmup_steps=5)


def test_steps_flag_is_in_place_before_the_overrides_are_checked():
    """``--steps 1000 --train-set warmup_steps=100`` is a valid run: the overrides were checked
    against the default 100 steps first ("train.steps=100 must exceed warmup_steps=100");
    ``--steps`` still wins over ``--train-set steps=...``."""
    from argparse import Namespace

    from kdsa.cli.train_cmd import train_config_from_args

    tc = train_config_from_args(Namespace(steps=1000, seed=None,
                                          train_overrides=["warmup_steps=100"]))
    assert (tc.steps, tc.warmup) == (1000, 100)
    tc = train_config_from_args(Namespace(steps=7, seed=3, train_overrides=["steps=50"]))
    assert (tc.steps, tc.seed) == (7, 3)


@contextlib.contextmanager
def _tmpfs(path, *options):
    """A small tmpfs at ``path`` (root only; skipped where mounting is not allowed)."""
    path.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
                         capture_output=True)
    if got.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("options, message", [
    (("size=50M", "ro"), "is not writable (Read-only file system)"),
    (("size=1M",), "MiB free, but 3 kept checkpoints plus the one being written need"),
])
def test_read_only_or_full_run_dir_is_one_line_before_compiling(tmp_path, capsys, options,
                                                                 message):
    with _tmpfs(tmp_path / "fs", *options) as fs:
        code = main(["train", "--preset", "tiny", "--steps", "3", "--no-progress",
                     "--run-dir", str(fs / "run")])
    assert code == 2
    assert message in _one_error_line(capsys, "train")


def test_a_run_dir_check_failing_on_one_process_fails_on_every_process(tmp_path, monkeypatch):
    """In a job of several processes the run-dir check is agreed: the process whose own check
    passed raises too when another's failed (it went on into the first collective and waited
    there). The collective is stood in for by its answer: process 0 failed, this one did
    not."""
    import numpy as np
    from jax.experimental import multihost_utils

    from kdsa.train import run_dir

    monkeypatch.setattr(run_dir.jax, "process_count", lambda: 2)
    seen = []
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: seen.append(int(x)) or np.asarray([1, int(x)]))
    with pytest.raises(ValueError, match=r"the check failed on process\(es\) \[0\]"):
        run_dir.check_run_dir(tmp_path / "run", 1, keep=1)
    assert seen == [0]  # this process's own check passed


def test_set_aside_steps_do_not_count_as_room(tmp_path, monkeypatch):
    """The space check counts as room the run gets back its step folders (pruning) and the
    unfinished saves of interrupted runs (its first save removes them), not steps set aside as
    corrupt, which nothing removes (each used to count as room); the error names them."""
    import shutil
    from collections import namedtuple

    from kdsa.train import run_dir

    ckpts = tmp_path / "run" / "checkpoints"
    for name in ("3", "6.orbax-checkpoint-tmp-123", "2.corrupt"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "data").write_bytes(b"x" * 4000)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 0, 5000))
    run_dir.check_run_dir(tmp_path / "run", 6500, keep=1)  # 5000 free + 4000 + 4000 >= 13,000
    with pytest.raises(ValueError, match=r"0\.0 MiB of it in .* is steps set aside as corrupt"):
        run_dir.check_run_dir(tmp_path / "run", 7000, keep=1)  # 14,000 > 13,000: the 4,000 in
        # the set-aside step is not room


def test_documents_of_the_wrong_type_are_refused(tmp_path):
    for line, what in (('{"text": 42}', "'text' must be a string, got 42"),
                       ('{"tokens": "abc"}', "'tokens' must be a list of integers"),
                       ('{"tokens": [1, true]}', "'tokens' must be a list of integers")):
        path = tmp_path / "docs.jsonl"
        path.write_text('{"text": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"docs.jsonl:2: {what}"):
            PackedJsonlData(path, 1, 8, 0, vocab_size=256)


def test_jsonl_readers_split_lines_at_newlines_only_and_name_a_non_utf8_line(tmp_path):
    """JSON strings may hold U+2028 / U+2029 / U+0085 raw (``ensure_ascii=False`` writes them
    so): every JSONL reader keeps such a line whole (``str.splitlines`` cut it: "not valid
    JSON"), takes a byte-order mark and CRLF endings, and names the line where non-UTF-8 text
    starts (the data readers gave only the codec's message)."""
    from kdsa.infer.chat import get_format
    from kdsa.infer.quant_check import _efforts
    from kdsa.infer.tokenizer import ByteTokenizer
    from kdsa.train.vision_data import is_chat_jsonl, read_image_sft_jsonl

    odd = "a\u2028b\u2029c\x85d"
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(("\ufeff" + json.dumps({"text": odd}, ensure_ascii=False) + "\r\n\r\n"
                      + json.dumps({"tokens": [1, 2, 3]}) + "\n").encode())
    data = PackedJsonlData(docs, 1, 16, 0, vocab_size=256, eos_id=0)
    assert data.tokens[0].tolist()[:len(odd.encode()) + 5] == [*odd.encode(), 0, 1, 2, 3, 0]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"id": "x", "reasoning_effort": "high", "messages": [
        {"role": "user", "content": odd}, {"role": "assistant", "content": "ok"}]},
        ensure_ascii=False) + "\n", encoding="utf-8")
    assert is_chat_jsonl(chat) and _efforts(chat, None) == {"x": "high"}
    assert len(read_image_sft_jsonl(chat, get_format("xtml", ByteTokenizer(512)), None,
                                    batch_size=1, seq_len=128).tokens) == 1
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    for read in (lambda: PackedJsonlData(bad, 1, 8, 0, vocab_size=256), lambda: is_chat_jsonl(bad)):
        with pytest.raises(ValueError, match=f"{bad}: not UTF-8 text at line 3"):
            read()


def test_ctrl_c_stops_like_sigterm_and_a_second_one_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with _StopFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.set and stop_reason(flag, None, 1, 10) == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    with _StopFlag() as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_reason(flag, None, 1, 10) == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_generate_and_quant_check_refuse_bad_paths_and_flags_before_loading(tmp_path, capsys,
                                                                           monkeypatch):
    """A missing prompts file, sampling flags no request could use, an output under a file:
    one line and exit 2 before any model is built or loaded (they were found after the model
    load, or, for the output, after the whole job). Output folders are made up front."""
    import kdsa.cli.generate_cmd as generate_cmd

    def no_engine(args):
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr(generate_cmd, "engine_from_args", no_engine)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cases = [(["--prompts", str(tmp_path / "missing.jsonl")], "no such file"),
             (["--prompts", str(prompts), "--temperature", "-1"],
              "the sampling flags: temperature must be a number in [0, 2], got -1.0"),
             # the HTTP API's limit, which every chat line meets (above it every chat line
             # became an error record after the model loaded)
             (["--prompts", str(prompts), "--temperature", "3"], "in [0, 2], got 3.0"),
             (["--prompts", str(prompts), "--max-tokens", "0"],
              "max_tokens must be an integer >= 1, got 0"),
             (["--prompts", str(prompts), "--out", str(blocker / "out.jsonl")], "--out"),
             # the results written over the prompts (the input was gone, exit 0)
             (["--prompts", str(prompts), "--out", str(tmp_path / "." / "p.jsonl")],
              "is the --prompts file")]
    for extra, what in cases:
        argv = ["generate", "--preset", "tiny", "--out", str(tmp_path / "o.jsonl"), *extra]
        assert main(argv) == 2, extra
        assert what in _one_error_line(capsys, "generate"), extra
    import kdsa.model.checkpoint as ckpt

    ref = tmp_path / "no_model"
    assert main(["quant-check", "--reference", str(ref), "--candidate-experts", "mxfp4",
                 "--prompts", str(prompts), "--out",
                 str(tmp_path / "new" / "dir" / "r.json")]) == 2  # no model there: nothing made
    assert not (tmp_path / "new").exists() and "no_model" in _one_error_line(
        capsys, "quant-check")
    tiny = get_preset("tiny")
    monkeypatch.setattr(ckpt, "read_info", lambda path: (  # (a model there)
        {"mx": tiny.replace(expert_weight_format="mxfp4"),
         "wider": tiny.replace(intermediate_size=128)}.get(Path(path).name, tiny), {}))
    assert main(["quant-check", "--reference", str(ref), "--candidate-experts", "mxfp4",
                 "--prompts", str(prompts), "--out", str(blocker / "r.json")]) == 2
    assert "--out" in _one_error_line(capsys, "quant-check")
    assert main(["quant-check", "--reference", str(ref), "--candidate-experts", "mxfp4",
                 "--prompts", str(prompts), "--out", str(prompts)]) == 2
    assert "is the --prompts file" in _one_error_line(capsys, "quant-check")
    assert main(["quant-check", "--reference", str(ref), "--candidate-experts", "mxfp4",
                 "--prompts", str(prompts), "--out", str(tmp_path / "r1.json"), "--html",
                 str(tmp_path / "r1.json")]) == 2  # (neither exists yet)
    assert "--html" in _one_error_line(capsys, "quant-check")
    assert prompts.read_text() == json.dumps({"prompt": "hi"}) + "\n"
    (tmp_path / "old.json").write_text("{}")  # an earlier report is kept without --overwrite
    assert main(["quant-check", "--reference", str(ref), "--candidate-experts", "mxfp4",
                 "--prompts", str(prompts), "--out", str(tmp_path / "old.json")]) == 2
    assert "exists; --overwrite replaces it" in _one_error_line(capsys, "quant-check")
    with pytest.raises(SystemExit):  # engine sizes below 1, before either model loads
        main(["quant-check", "--reference", str(ref), "--candidate-experts", "mxfp4",
              "--prompts", str(prompts), "--out", str(tmp_path / "r2.json"), "--slots", "0"])
    assert "argument --slots: must be >= 1, got 0" in capsys.readouterr().err
    # another model as the candidate (an IndexError traceback after both models ran, or a
    # meaningless report), MXFP4 experts made of MXFP4 experts (refused after the reference ran)
    out = str(tmp_path / "r.json")
    assert main(["quant-check", "--reference", str(ref), "--candidate", str(tmp_path / "wider"),
                 "--prompts", str(prompts), "--out", out]) == 2
    assert "another model than --reference (differs in intermediate_size)" in _one_error_line(
        capsys, "quant-check")
    assert main(["quant-check", "--reference", str(tmp_path / "mx"), "--candidate-experts",
                 "mxfp4", "--prompts", str(prompts), "--out", out]) == 2
    assert "needs a reference with bf16 routed experts" in _one_error_line(capsys, "quant-check")


def test_engine_sizes_and_launch_timeouts_are_checked_first(capsys):
    """Engine sizes below 1 name their flag before the model is built (``--prefill-chunk 0``
    was "need 1 <= min_bucket <= prefill_chunk", ``--prefix-snapshots 0`` silently became 2 x
    ``--slots``); ``launch-local --timeout 0`` meant no timeout, a negative one killed the job."""
    import argparse

    from kdsa.cli.generate_cmd import add_engine_args, engine_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for flag in ("--slots", "--max-len", "--prefill-chunk", "--prefix-snapshots",
                 "--prefix-snapshot-every", "--num-pages"):
        with pytest.raises(ValueError, match=f"{flag} must be >= 1, got 0"):
            engine_from_args(p.parse_args(["--preset", "tiny", flag, "0"]))
    # pool sizes too, naming their flag (a bad --cache-memory was found after the model load)
    for extra, what in ((["--cache-memory", "2GX"], "--cache-memory: cannot read size '2GX'"),
                        (["--cache-memory", "1.2.3GB"], "--cache-memory: cannot read size"),
                        (["--cache-memory", "1GB", "--num-pages", "4"], "not both"),
                        (["--cache-memory", "1GB", "--dense-cache"], "takes no pool size")):
        with pytest.raises(ValueError, match=what):
            engine_from_args(p.parse_args(["--preset", "tiny", *extra]))
    for flag in ("--timeout", "--stop-timeout"):
        assert main(["launch-local", "--processes", "1", flag, "0", "--", "train"]) == 2
        assert f"{flag} must be > 0" in _one_error_line(capsys, "launch-local")


def test_launch_local_keeps_a_later_double_dash_in_the_command():
    """Only the separating ``--`` goes: every ``--`` was dropped, so a command that needs one
    ran differently under the launcher."""
    from kdsa.cli.launch_local import inner_command
    from kdsa.cli.main import build_parser

    def cmd(*argv):
        return inner_command(build_parser().parse_args(["launch-local", "--processes", "2",
                                                        *argv]))

    assert cmd("--", "kdsa", "train", "--set", "a=1", "--", "-x") == \
        ["train", "--set", "a=1", "--", "-x"]
    assert cmd("--", "rl", "--demo") == ["rl", "--demo"]


def test_moe_capacity_factor_reaches_the_update_rules(monkeypatch):
    """``--train-set moe_capacity_factor=1.25`` (the K3 pod recipe, docs/post_training.md) is
    a train-config field the update's sharding rules get (it was a ``use_sharding`` option no
    command could set, so the recipe's planned layout could not run); 0 or a string is refused."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from kdsa.sharding import constrain
    from kdsa.train.config import apply_train_overrides
    from kdsa.train.placement import Placement

    tc = apply_train_overrides(TrainConfig(), ["moe_capacity_factor=1.25"])
    assert tc.moe_capacity_factor == 1.25 and TrainConfig().moe_capacity_factor is None
    for bad in (0, -1.0, "1.25", True):
        with pytest.raises(ValueError, match="moe_capacity_factor must be a number > 0"):
            TrainConfig(moe_capacity_factor=bad)
    seen = {}
    monkeypatch.setattr(constrain, "use_sharding", lambda mesh, layout, **kw: seen.update(
        kw, layout=layout) or contextlib.nullcontext())
    place = Placement.__new__(Placement)  # (its state shardings are not what is tested here)
    place.mesh = Mesh(np.asarray(jax.devices()[:2]), ("expert",))
    place.moe_capacity_factor = tc.moe_capacity_factor
    with place.rules():
        pass
    assert seen == {"layout": "train", "moe_capacity_factor": 1.25}


def test_a_binary_config_is_one_line_and_kdsa_debug_shows_the_traceback(tmp_path, capsys,
                                                                        monkeypatch):
    """A ``--config`` that is not UTF-8 names the file (a decode error's line did not); with
    ``KDSA_DEBUG=1`` the error is raised with its traceback instead."""
    binary = tmp_path / "c.json"
    binary.write_bytes(b"\xff\xfe\x00binary")
    assert main(["params", "--config", str(binary)]) == 2
    line = _one_error_line(capsys, "params")
    assert str(binary) in line and "not UTF-8" in line
    from kdsa.infer.generate import read_requests

    with pytest.raises(ValueError, match=f"--prompts {binary}: not UTF-8"):
        read_requests(binary, None, None, effort=None, defaults={}, seed=0)
    monkeypatch.setenv("KDSA_DEBUG", "1")
    with pytest.raises(ValueError, match="not UTF-8"):
        main(["params", "--config", str(binary)])


@pytest.mark.parametrize("argv", [["forward", "--seq", "0"], ["forward", "--batch", "-2"],
                                  ["plan", "--preset", "tiny", "--batch", "0"],
                                  ["plan", "--preset", "tiny", "--seq", "x"],
                                  ["plan", "--devices", "8", "--moe-capacity-factor", "0"],
                                  ["plan", "--devices", "8", "--moe-capacity-factor", "nan"],
                                  ["params", "--context", "0"]])
def test_sizes_below_one_are_refused_by_name_before_building(argv, capsys):
    """``forward --seq 0`` built the model and then failed inside JAX ("x has no tokens"; -3: a
    TypeError); ``plan --batch 0`` blamed the mesh, ``--moe-capacity-factor 0`` planned a buffer
    of nothing; ``params --context 0`` printed no cache."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kdsa {argv[0]}: error: argument {argv[-2]}: "), err


def test_params_json_reports_the_cache_at_context(capsys):
    assert main(["params", "--preset", "tiny", "--context", "100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["decode_cache_bytes_at_context"] == (100 * d["cache_bytes_per_token"]
                                                  + d["cache_bytes_per_sequence"]) > 0


def test_a_moved_start_folder_is_taken_from_init_from(tmp_path):
    """A resumed run takes its start folder from its checkpoint (the weights descend from it),
    unless that folder is gone and ``--init-from`` names another: the final export reads the
    layout and tokenizer there (the recorded path always won, and the export failed on every
    resume after a move)."""
    from kdsa.train.init_from import resumed_origin

    notes = []
    (tmp_path / "moved").mkdir()
    (tmp_path / "first").mkdir()
    gone, moved, first = (str(tmp_path / n) for n in ("gone", "moved", "first"))
    assert resumed_origin(gone, moved, notes.append) == moved and "is gone" in notes[0]
    assert resumed_origin(first, moved, notes.append) == first and len(notes) == 1
    assert resumed_origin(gone, None, notes.append) == gone
    assert resumed_origin(None, moved, notes.append) == moved


def test_demo_resume_finds_the_run_a_stopped_demo_left(tmp_path, monkeypatch, capsys):
    """``kdsa rl --demo`` writes to the first free ``runs/rl-demo[-N]``; ``--demo --resume``
    picks the newest of those that did not finish (no ``model/`` export), else the newest. It
    used to always pick ``runs/rl-demo``, resuming a finished run while the stopped one waited."""
    from kdsa.cli.rl_cmd import _demo_run_dir

    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    assert _demo_run_dir(False) == _demo_run_dir(True) == runs / "rl-demo"
    for name, finished in (("rl-demo", True), ("rl-demo-2", False), ("rl-demo-3", True)):
        (runs / name / "checkpoints" / "6").mkdir(parents=True)
        if finished:
            (runs / name / "model").mkdir()
    assert _demo_run_dir(False) == runs / "rl-demo-4"
    assert _demo_run_dir(True) == runs / "rl-demo-2"
    assert "resuming" in capsys.readouterr().err
    (runs / "rl-demo-2" / "model").mkdir()  # all finished: the newest
    assert _demo_run_dir(True) == runs / "rl-demo-3"


def test_read_metrics_gives_every_logged_step(tmp_path):
    """The demo's reward curve is drawn from ``metrics.jsonl`` (a resumed demo's process ran
    only the steps after the checkpoint), skipping a line a crash tore."""
    from kdsa.train.metrics import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "score": 0.5}\n{"step": 2, "score": 0.7}\n{"step": 3, "sc')
    assert read_metrics(f) == [{"step": 1, "score": 0.5}, {"step": 2, "score": 0.7}]
    assert read_metrics(tmp_path / "none.jsonl") == []


def _fake_run(run):
    """A run directory's folder layout (no arrays): step 6 in ``checkpoints``, a ``model``."""
    step = run / "checkpoints" / "6"
    for d in ("state", "meta"):
        (step / d).mkdir(parents=True)
    for folder in (step, run / "model"):
        folder.mkdir(exist_ok=True)
        (folder / "_CHECKPOINT_METADATA").write_text("{}")
    return run


def test_resume_into_a_folder_inside_a_run_is_refused(tmp_path):
    """``--resume --run-dir RUN/model`` (or ``RUN/checkpoints``, or a step in it) found no
    checkpoint there and started a new run inside that folder; it is refused, naming RUN."""
    from kdsa.train import run_dir

    run = _fake_run(tmp_path / "run")
    step = run / "checkpoints" / "6"
    for inside, what in ((run / "model", "checkpoint or model folder"),
                         (run / "checkpoints", "folder of training checkpoints"),
                         (step, "checkpoint or model folder")):
        with pytest.raises(ValueError, match=f"--resume: {inside} is a {what}, not a run "
                                             f"directory; resume with --run-dir {run}$"):
            run_dir.check_run_dir(inside, 1, keep=1, resume=True)
        run_dir.check_run_dir(inside, 1, keep=1)  # a new run there is what was asked for
    run_dir.check_run_dir(run, 1, keep=1, resume=True)


def test_the_export_never_lands_on_the_folder_a_run_starts_from(tmp_path):
    """``RUN_DIR/model`` may not be the folder the weights are read from, lie inside it or
    among its scratch siblings; a run directory nested in the run it starts from is fine (its
    newest step is what is read)."""
    from kdsa.model.folders import DestinationError
    from kdsa.train.init_from import check_export_destination

    sft = _fake_run(tmp_path / "sft")
    step = sft / "checkpoints" / "6"
    check_export_destination(sft / "rl", sft)  # reads sft/checkpoints/6
    check_export_destination(tmp_path / "rl", sft / "model")
    check_export_destination(tmp_path / "rl", None)
    for run, start in ((sft, sft / "model"), (sft / "model" / "x", sft / "model"),
                       (sft / "checkpoints" / "6", step)):
        with pytest.raises(DestinationError, match="the run's export would be written over or "
                                                   "into"):
            check_export_destination(run, start)
