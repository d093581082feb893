"""``kdsa convert`` destinations and paths (``model/folders.py``, ``train/convert/pipeline.py``).

Every refusal is checked to leave the disk as it was: the source, a parent folder holding it, an
unrelated folder, a regular file, an existing kdsa folder without ``--overwrite``. Relative paths
go through the CLI and through the library functions (which Python users call directly). The
source is the tiny Kimi Linear model in ``tests/data`` (a conversion takes about a second).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kdsa.cli.main import main
from kdsa.model import checkpoint as ckpt
from kdsa.model.folders import HF, KDSA, DestinationError, check_destination, folder_kind
from kdsa.train import convert
from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

DATA = Path(__file__).parent / "data"


def snapshot(root: Path) -> dict:
    """Every file under ``root`` with its bytes (what a refusal must leave unchanged)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def tensors(path) -> dict:
    c = SafetensorsCheckpoint(path)
    return {n: c.tensor(n).tobytes() for n in c.names()}


def convert_cli(*args) -> int:
    return main(["convert", *[str(a) for a in args], "--no-progress"])


def test_convert_destination_rules(tmp_path, capsys):
    src = tmp_path / "models" / "hf"
    shutil.copytree(DATA / "kimi_linear", src)
    (tmp_path / "models" / "notes.txt").write_text("a sibling of the source")
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("not a checkpoint")
    regular = tmp_path / "file.bin"
    regular.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(src)
    before = snapshot(tmp_path)

    refused = [  # (DST, flags, message)
        (src, ["--overwrite"], "is the source of this command"),
        (src.parent / ".." / "models" / "hf", ["--overwrite"], "is the source"),
        (tmp_path / "link", ["--overwrite"], "is the source"),          # a symlink to SRC
        (src.parent, ["--overwrite"], "contains the source"),           # DST = parent of SRC
        (tmp_path, ["--overwrite"], "contains the source"),
        (src / "orbax", [], "is inside the source"),
        (other, ["--overwrite"], "is not a kdsa model folder or a Hugging Face checkpoint "
                                 "folder (a folder holding 1 entry, e.g. ['thesis.tex'])"),
        (regular, ["--overwrite"], "(a regular file); refusing to replace it, even with "
                                   "--overwrite"),
    ]
    for dst, flags, message in refused:
        assert convert_cli("hf-to-orbax", src, dst, *flags) == 2, dst
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (dst, err)
        assert snapshot(tmp_path) == before, dst                      # nothing deleted or added

    out = tmp_path / "out"
    assert convert_cli("hf-to-orbax", src, out) == 0 and folder_kind(out) == KDSA
    kdsa_files = snapshot(out)
    assert convert_cli("hf-to-orbax", src, out) == 2
    assert "out: already exists (a kdsa model folder); pass --overwrite" in \
        capsys.readouterr().err
    assert snapshot(out) == kdsa_files
    assert convert_cli("hf-to-orbax", src, out, "--overwrite") == 0
    assert ckpt.read_info(out)[0].num_hidden_layers == 3

    # orbax-to-hf: the same rules
    assert convert_cli("orbax-to-hf", out, out, "--overwrite") == 2
    assert "is the source" in capsys.readouterr().err
    assert convert_cli("orbax-to-hf", out, out / "hf") == 2
    assert "is inside the source" in capsys.readouterr().err
    hf2 = tmp_path / "hf2"
    assert convert_cli("orbax-to-hf", out, hf2) == 0 and folder_kind(hf2) == HF
    hf_files = snapshot(hf2)
    assert convert_cli("orbax-to-hf", out, hf2) == 2
    assert "hf2: already exists (a Hugging Face checkpoint folder)" in capsys.readouterr().err
    assert snapshot(hf2) == hf_files
    assert convert_cli("orbax-to-hf", out, hf2, "--overwrite") == 0
    assert tensors(hf2) == tensors(src)
    assert convert_cli("orbax-to-hf", out, regular, "--overwrite") == 2
    assert regular.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin", "hf2", "link", "models",
                                                          "other", "out"]


def test_a_source_among_the_scratch_folders_is_refused(tmp_path, capsys):
    """Writing DST uses scratch siblings ``DST.kdsa-*`` and removes an interrupted run's
    leftovers there: a source named like one (or inside one) was deleted by the convert
    itself. It is refused, and the cleanup removes only the writer's own names (a user's
    ``DST.kdsa-tmp.bak`` stays)."""
    from kdsa.model.checkpoint import _remove_scratch

    src = tmp_path / "m.kdsa-tmp-hf"
    shutil.copytree(DATA / "kimi_linear", src)
    before = snapshot(tmp_path)
    assert convert_cli("hf-to-orbax", src, tmp_path / "m") == 2
    err = capsys.readouterr().err
    assert "uses the scratch folders" in err and "is one of them" in err and \
        err.count("\n") == 1, err
    with pytest.raises(DestinationError, match="is inside one"):
        check_destination(tmp_path / "m", sources=[src / "model.safetensors"])
    assert snapshot(tmp_path) == before
    check_destination(tmp_path / "n", sources=[src])  # another DST's scratch names: fine
    real = tmp_path / "real"  # a kdsa model folder (its metadata is what tells)
    real.mkdir()
    (real / "_CHECKPOINT_METADATA").write_text('{"custom_metadata": {"kdsa": {}}}')
    (tmp_path / "link").symlink_to(real)  # the writers' scratch sits beside the link's name
    for name in ("link.kdsa-tmp", "real.kdsa-old"):
        (tmp_path / name).mkdir()
    with pytest.raises(DestinationError, match="is one of them"):
        check_destination(tmp_path / "link", sources=[tmp_path / "link.kdsa-tmp"])
    check_destination(tmp_path / "link", sources=[tmp_path / "real.kdsa-old"], overwrite=True)
    keep = tmp_path / "out.kdsa-tmp.bak"
    for d in (keep, tmp_path / "out.kdsa-tmp", tmp_path / "out.kdsa-tmp.partial_save",
              tmp_path / "out.kdsa-tmp.orbax-checkpoint-tmp-12"):
        d.mkdir()
    _remove_scratch(tmp_path / "out.kdsa-tmp")
    assert sorted(p.name for p in tmp_path.glob("out*")) == [keep.name]


def test_check_destination_empty_folder_and_dangling_link(tmp_path):
    """An empty folder holds nothing to lose (accepted without ``overwrite``); a dangling link
    is refused even with it."""
    (tmp_path / "empty").mkdir()
    assert check_destination(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    with pytest.raises(DestinationError, match="a dangling symbolic link"):
        check_destination(tmp_path / "dangling", overwrite=True)
    assert (tmp_path / "dangling").is_symlink()


def test_relative_paths_through_the_cli_and_the_library(tmp_path, monkeypatch):
    """``kdsa convert`` both ways and ``hf_to_orbax`` / ``orbax_to_hf`` / ``read_info`` /
    ``load_model`` called with paths relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(DATA / "kimi_linear", tmp_path / "hf")
    assert main(["convert", "hf-to-orbax", "hf", "rel/orbax", "--no-progress"]) == 0
    assert main(["convert", "orbax-to-hf", "rel/orbax", "rel/hf_cli", "--no-progress"]) == 0
    assert tensors("rel/hf_cli") == tensors("hf")
    s = convert.hf_to_orbax("hf", "api/orbax", progress=False)
    assert s.tensors > 0 and (tmp_path / "api" / "orbax").is_dir()
    convert.orbax_to_hf(Path("api") / "orbax", "api/hf", progress=False)
    assert tensors("api/hf") == tensors("hf")
    config, info = ckpt.read_info("api/orbax")
    assert config.num_hidden_layers == 3 and info["source"]["path"] == str(tmp_path / "hf")
    _, model = ckpt.load_model("rel/orbax")
    assert model.config == config
    assert ckpt.save_model("api/again", config, model) == tmp_path / "api" / "again"


def test_fewer_layers_than_the_source(tmp_path, capsys):
    """A config with fewer layers than the source is refused (one line, both counts) unless
    ``--allow-partial``, which converts the first layers with a one-line warning."""
    src, dst = DATA / "deepseek_v32", tmp_path / "part"
    sets = ["--set", "num_hidden_layers=2", "--set", "linear_attn_config.full_attn_layers=[1,2]"]
    assert convert_cli("hf-to-orbax", src, dst, *sets) == 2
    err = capsys.readouterr().err
    assert "the config has 2 layers, the source 3; converting would drop the last 1 (pass " \
           "--allow-partial" in err and err.count("\n") == 1, err
    assert not dst.exists()
    assert convert_cli("hf-to-orbax", src, dst, *sets, "--allow-partial") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "converting only the first 2" in warnings[0], warnings
    assert ckpt.read_info(dst)[0].num_hidden_layers == 2


def _deepseek_copy(tmp_path: Path, name: str, **config) -> Path:
    """The tiny DeepSeek-V3.2 source with ``config`` set in its config.json."""
    import json

    src = tmp_path / name
    shutil.copytree(DATA / "deepseek_v32", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_a_config_that_undercounts_its_tensors_is_refused(tmp_path, capsys):
    """config.json says 2 layers, the tensors hold 3: refused, naming the third layer's tensors
    (they were skipped as if they were DeepSeek's multi-token-prediction layers, a truncated
    model that looked complete). With ``num_nextn_predict_layers: 1`` the third layer is that
    MTP layer and is skipped."""
    two = {"num_hidden_layers": 2, "layer_types": ["indexed_attention"] * 2,
           "mlp_layer_types": ["dense", "sparse"]}
    src = _deepseek_copy(tmp_path, "under", **two)
    assert convert_cli("hf-to-orbax", src, tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "unexpected tensor(s): model.layers.2." in err and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()
    mtp = _deepseek_copy(tmp_path, "mtp", **two, num_nextn_predict_layers=1)
    assert convert_cli("hf-to-orbax", mtp, tmp_path / "b") == 0
    assert ckpt.read_info(tmp_path / "b")[0].num_hidden_layers == 2


def test_malformed_config_and_index_are_one_line(tmp_path, capsys):
    import json

    src = tmp_path / "src"
    shutil.copytree(DATA / "kimi_linear", src)
    (src / "config.json").write_text("[1, 2]")
    assert convert_cli("hf-to-orbax", src, tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "not a model config" in err and err.count("\n") == 1, err
    shutil.copy2(DATA / "kimi_linear" / "config.json", src / "config.json")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    assert convert_cli("hf-to-orbax", src, tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "not a safetensors index" in err and err.count("\n") == 1, err
    for shard in ("../hf/model.safetensors", "/etc/hostname"):  # shards outside the folder
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": shard}}))
        assert convert_cli("hf-to-orbax", src, tmp_path / "b") == 2, shard
        err = capsys.readouterr().err
        assert "is not a file name in this folder" in err and err.count("\n") == 1, err
    # fields of the wrong JSON type: one line (TypeErrors before), and a header dtype that
    # is not a string ("unhashable type: 'list'")
    (src / "model.safetensors.index.json").unlink()  # (one file: no index)
    good = json.loads((DATA / "kimi_linear" / "config.json").read_text())
    for key, value in (("kdsa", [1]), ("layer_types", 5), ("mlp_layer_types", 5)):
        (src / "config.json").write_text(json.dumps(dict(good, **{key: value})))
        assert convert_cli("hf-to-orbax", src, tmp_path / "c", "--dry-run") == 2, key
        err = capsys.readouterr().err
        assert f"config {key} must be" in err and err.count("\n") == 1, err
    from kdsa.train.convert.safetensors_io import SafetensorsError, _parse_entry

    with pytest.raises(SafetensorsError, match="unknown dtype"):
        _parse_entry(src / "x.safetensors", "t", {"dtype": ["BF16"], "shape": [1],
                                                  "data_offsets": [0, 2]}, 0)


@pytest.mark.parametrize("named_in", ["tokenizer_config.json", "config.json"])
def test_generation_config_and_remote_code_travel_with_the_weights(tmp_path, named_in):
    """``generation_config.json`` and the Python files of remote code (``auto_map`` in
    ``tokenizer_config.json``: a tokenizer; in ``config.json``: the model) are copied into the
    model folder and from it into an export, whose config.json keeps the ``auto_map``, so the
    exported folder loads with ``trust_remote_code`` (vLLM, transformers)."""
    import json

    src = tmp_path / "src"
    shutil.copytree(DATA / "kimi_linear", src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    auto_map = {"AutoTokenizer": ["tokenization_fake.FakeTokenizer", None]}
    named = json.loads((src / named_in).read_text())
    (src / named_in).write_text(json.dumps(dict(named, auto_map=auto_map)))
    (src / "tokenization_fake.py").write_text("from helper_fake import X\n")
    (src / "helper_fake.py").write_text("X = 1\n")
    convert.hf_to_orbax(src, tmp_path / "model", progress=False)
    convert.orbax_to_hf(tmp_path / "model", tmp_path / "hf", progress=False)
    for folder in ("model", "hf"):
        for name in ("generation_config.json", "tokenizer_config.json", "tokenization_fake.py",
                     "helper_fake.py"):
            assert (tmp_path / folder / name).read_bytes() == (src / name).read_bytes(), \
                (folder, name)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("auto_map") == (
        auto_map if named_in == "config.json" else None)


def test_orbax_to_hf_refuses_a_job_of_several_processes(tmp_path, monkeypatch):
    """Every process of a job would write (and rename) the same folder: refused, nothing
    written (a fake process count: the check comes first)."""
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="run it once, on one host"):
        convert.orbax_to_hf(tmp_path / "model", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_replace_folder_swaps_in_one_step(tmp_path, monkeypatch):
    """Where the system can swap two names atomically (Linux ``renameat2``), the destination
    is replaced without the two renames that once left a crash window in which it did not
    exist: with ``os.rename`` failing, the folder is still replaced and nothing is left over.
    Where it cannot, the two renames (tested by the other destination tests) remain."""
    from kdsa.model import folders

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    if not folders._exchange(a, b):
        pytest.skip("no atomic rename exchange on this system or file system")
    old, new = tmp_path / "model", tmp_path / "model.kdsa-tmp"
    old.mkdir(), new.mkdir()
    (old / "x").write_text("old")
    (new / "x").write_text("new")

    def no_rename(*args):
        raise OSError("rename not allowed in this test")

    monkeypatch.setattr(os, "rename", no_rename)
    folders.replace_folder(new, old)
    assert (old / "x").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "model"]


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_folder_syncs_the_new_files_before_the_rename(tmp_path, monkeypatch, exchange):
    """Every file and folder of the new tree is synced before it takes the name, and the parent
    folder after, before the old folder is removed (nothing was synced: a machine crash could
    leave the new name on empty files with the old ones gone)."""
    from kdsa.model import folders

    if not exchange:
        monkeypatch.setattr(folders, "_exchange", lambda a, b: False)
    old, new = tmp_path / "model", tmp_path / "model.kdsa-tmp"
    (old / "d").mkdir(parents=True), (new / "d").mkdir(parents=True)
    for f in (old / "x", new / "x", new / "d" / "y"):
        f.write_text(f.parent.name)
    events, fsync, remove = [], os.fsync, folders._remove
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(
        ("sync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    monkeypatch.setattr(folders, "_remove", lambda p: events.append(("remove", str(p)))
                        or remove(p))
    folders.replace_folder(new, old)
    synced = [p for kind, p in events if kind == "sync"]
    assert {str(new / "x"), str(new / "d" / "y"), str(new / "d"), str(new)} <= set(synced)
    last = max(i for i, (kind, p) in enumerate(events) if kind == "sync" and p == str(tmp_path))
    assert last < max(i for i, (kind, _) in enumerate(events) if kind == "remove")  # the old
    assert (old / "d" / "y").read_text() == "d"


def test_replace_folder_without_the_exchange_restores_the_old_folder(tmp_path, monkeypatch):
    """Where no atomic exchange exists, the old folder moves aside and the new one takes its
    name; when that second rename fails, the old folder is put back and the error raised."""
    from kdsa.model import folders

    monkeypatch.setattr(folders, "_exchange", lambda a, b: False)
    old, new = tmp_path / "model", tmp_path / "model.kdsa-tmp"
    old.mkdir(), new.mkdir()
    (old / "x").write_text("old")
    (new / "x").write_text("new")
    rename = os.rename

    def failing_second(src, dst):
        if Path(src) == new:
            raise OSError("injected rename failure")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_second)
    with pytest.raises(OSError, match="injected"):
        folders.replace_folder(new, old)
    assert (old / "x").read_text() == "old" and (new / "x").read_text() == "new"
    monkeypatch.setattr(os, "rename", rename)
    folders.replace_folder(new, old)  # the two renames
    assert (old / "x").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_one_line_drops_both_forms_of_the_spec_dump():
    """Orbax's read errors embed the TensorStore spec as ``[tensorstore_spec='...`` and, when it
    reads several arrays, as ``[tensorstore_spec[1]='...``: both are cut from the one line."""
    from kdsa.model.folders import one_line

    for tag in ("tensorstore_spec=", "tensorstore_spec[1]="):
        text = f"Error reading 'params.a': checksum mismatch [{tag}'{{\"driver\": \"zarr3\"}}']\nx"
        assert one_line(text) == "Error reading 'params.a': checksum mismatch", tag


def test_closed_loop_reports_of_a_failed_restore_are_dropped(monkeypatch, caplog):
    """Orbax stops its uvloop loop when one read of a restore fails; the other reads' later
    completions each printed "RuntimeError: Event loop is closed", and asyncio "Task exception
    was never retrieved" for them (dozens of tracebacks around the one-line reason, some at
    exit). ``quiet_orbax`` installs a hook and a log filter dropping just those reports."""
    import sys
    import types

    from kdsa.model.folders import quiet_orbax

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with quiet_orbax():
        pass

    def report(exc, filename):
        try:
            exec(compile("raise exc", filename, "exec"), {"exc": exc})
        except Exception as e:  # noqa: BLE001
            sys.unraisablehook(types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__,
                                                     exc_type=type(e), err_msg=None, object=None))

    report(RuntimeError("Event loop is closed"), "uvloop/loop.pyx")
    assert seen == []
    report(RuntimeError("Event loop is closed"), "elsewhere.py")  # not uvloop's: reported
    report(ValueError("other"), "uvloop/loop.pyx")
    assert [str(u.exc_value) for u in seen] == ["Event loop is closed", "other"]
    import logging

    log = logging.getLogger("asyncio")
    for e in (ValueError("DATA_LOSS: ... [tensorstore_spec='{}']"), ValueError("a bug")):
        log.error("Task exception was never retrieved", exc_info=(ValueError, e, None))
    assert [r.exc_info[1].args for r in caplog.records if r.name == "asyncio"] == [("a bug",)]
    installed = sys.unraisablehook
    with quiet_orbax():  # installed once, not wrapped again
        pass
    assert sys.unraisablehook is installed
