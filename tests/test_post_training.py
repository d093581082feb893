"""convert -> SFT -> export -> convert back / generate, from a published-style checkpoint.

The source is the golden tiny Kimi Linear checkpoint (``tests/data/kimi_linear``, saved by
transformers) plus a small character-level ``tokenizer.json`` made here with the
``tokenizers`` package (XTML's specials included, 64 ids = the model's vocabulary):

* ``kdsa convert hf-to-orbax`` copies the tokenizer into the model folder;
* ``kdsa train --init-from DIR --data text.jsonl`` tokenizes with it; the first step's loss
  equals an independent forward of the converted model on the same packed rows (NumPy
  cross-entropy);
* the run writes ``RUN_DIR/model`` (config, weights, tokenizer), which ``kdsa convert
  orbax-to-hf`` turns into safetensors with the source's tensor names and shapes, and from
  which ``kdsa generate`` answers with the tokenizer's own text;
* from MXFP4 experts (``--experts mxfp4``): training starts from their exact dequantization
  (first loss = the MXFP4 model's forward) and the export keeps MXFP4;
* clear errors: ``--init-from`` with ``--preset``, architecture ``--set``, a tokenizer larger
  than the vocabulary.
"""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.cli.main import main
from kdsa.infer.tokenizer import load_tokenizer
from kdsa.model.checkpoint import load_model, read_info
from kdsa.train.data import PackedJsonlData
from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

DATA = Path(__file__).parent / "data" / "kimi_linear"
SPECIALS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "[PAD]"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:=\"/-_<>")
TRAIN_SETS = ["batch_size=2", "seq_len=16", "learning_rate=1e-3", "checkpoint_every=100"]


def write_tokenizer(path: Path, chars=CHARS) -> None:
    """A character-level BPE (no merges) with the XTML specials."""
    from tokenizers import Tokenizer, models

    vocab = {c: i for i, c in enumerate(list(chars) + ["[UNK]"])}  # unknown characters
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("post")
    src = root / "hf"
    shutil.copytree(DATA, src)
    write_tokenizer(src / "tokenizer.json")
    (root / "docs.jsonl").write_text("".join(
        json.dumps({"text": f"the answer is {i} and {i * 7}."}) + "\n" for i in range(40)))
    return root


def _first_loss(run: Path) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]


@nnx.jit
def _packed_logits(model, ids, segment_ids):
    """The reference forward as one compiled program (op by op it is hundreds of eager
    compiles, one per op shape)."""
    return model.forward(ids, segment_ids=segment_ids).logits


def _reference_loss(folder: Path, docs: Path) -> float:
    """Cross-entropy of the first batch under an independent forward of ``folder``."""
    config, model = load_model(folder)
    tok = load_tokenizer(folder, vocab_size=config.vocab_size)
    data = PackedJsonlData(docs, 2, 16, 0, vocab_size=config.vocab_size,
                           eos_id=config.eos_token_id, pad_id=config.pad_token_id or 0,
                           tokenizer=tok)
    b = data.batch(0)
    logits = np.asarray(_packed_logits(model, jnp.asarray(b["inputs"]),
                                       jnp.asarray(b["segment_ids"])), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(b["targets"])[..., None], -1)[..., 0]
    mask = np.asarray(b["loss_mask"], np.float64)
    return float((nll * mask).sum() / mask.sum())


def test_convert_sft_export_convert_back_and_generate(work, capsys, caplog):
    import jax

    conv, run = work / "conv", work / "run"
    assert main(["convert", "hf-to-orbax", str(work / "hf"), str(conv)]) == 0
    assert (conv / "tokenizer.json").is_file()
    with jax.log_compiles(True):
        assert main(["train", "--init-from", str(conv), "--steps", "2", "--no-progress",
                     "--data", str(work / "docs.jsonl"), "--run-dir", str(run),
                     *sum((["--train-set", s] for s in TRAIN_SETS), [])]) == 0
    # bfloat16 parameters: the state a step returns has the dtypes it was given (its AdamW
    # moments once turned float32 after step 1), so both steps ran one compiled program
    assert sum("Compiling jit(_train_step)" in r.getMessage() for r in caplog.records) == 1
    np.testing.assert_allclose(_first_loss(run), _reference_loss(conv, work / "docs.jsonl"),
                               rtol=2e-5)
    model_dir = run / "model"
    assert (model_dir / "tokenizer.json").is_file()
    exported, _ = read_info(model_dir)
    assert exported == read_info(conv)[0]

    hf_out = work / "hf_out"
    assert main(["convert", "orbax-to-hf", str(model_dir), str(hf_out)]) == 0
    src, out = SafetensorsCheckpoint(work / "hf"), SafetensorsCheckpoint(hf_out)
    assert sorted(out.names()) == sorted(src.names())
    assert all(out.tensor(n).shape == src.tensor(n).shape for n in src.names())
    assert (hf_out / "tokenizer.json").is_file()
    # the run's last training checkpoint exports like RUN_DIR/model: the source's layout, names
    # and tokenizer, found through the init folder its metadata records (same weights: same
    # bytes); before, it came out in the kimi_k3 layout without a tokenizer
    from_step = work / "hf_from_step"
    assert main(["convert", "orbax-to-hf", str(run / "checkpoints" / "2"), str(from_step)]) == 0
    step_out = SafetensorsCheckpoint(from_step)
    assert sorted(step_out.names()) == sorted(src.names())
    assert all(step_out.tensor(n).tobytes() == out.tensor(n).tobytes() for n in src.names())
    assert {p.name: p.read_bytes() for p in from_step.iterdir() if p.suffix != ".safetensors"} \
        == {p.name: p.read_bytes() for p in hf_out.iterdir() if p.suffix != ".safetensors"}
    conv.rename(work / "conv_moved")  # the init folder gone: our layout, and one warning line
    try:
        capsys.readouterr()
        assert main(["convert", "orbax-to-hf", str(run / "checkpoints" / "2"),
                     str(work / "hf_orphan")]) == 0
        assert "cannot be read now" in capsys.readouterr().err
        assert not (work / "hf_orphan" / "tokenizer.json").exists()
    finally:
        (work / "conv_moved").rename(conv)

    prompts, answers = work / "prompts.jsonl", work / "answers.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "the answer is 3"}) + "\n")
    assert main(["generate", "--checkpoint", str(model_dir), "--prompts", str(prompts),
                 "--out", str(answers), "--max-tokens", "6", "--temperature", "0",
                 "--no-progress", "--slots", "1", "--max-len", "64"]) == 0
    line = json.loads(answers.read_text())
    tok = load_tokenizer(model_dir, vocab_size=exported.vocab_size)
    text = b"".join(tok.token_bytes(t) for t in line["token_ids"]
                    if not tok.is_special(t)).decode()
    assert line["content"] == text[:len(line["content"])] and len(line["token_ids"]) >= 1
    assert set(line["content"]) <= set(CHARS)  # the tokenizer's own characters


def test_mxfp4_experts_train_from_their_dequantization_and_export_mxfp4(work):
    conv, run = work / "conv_mxfp4", work / "run_mxfp4"
    assert main(["convert", "hf-to-orbax", str(work / "hf"), str(conv),
                 "--experts", "mxfp4"]) == 0
    assert read_info(conv)[0].expert_weight_format == "mxfp4"
    assert main(["train", "--init-from", str(conv), "--steps", "1", "--no-progress",
                 "--data", str(work / "docs.jsonl"), "--run-dir", str(run),
                 *sum((["--train-set", s] for s in TRAIN_SETS), [])]) == 0
    np.testing.assert_allclose(_first_loss(run), _reference_loss(conv, work / "docs.jsonl"),
                               rtol=2e-5)
    assert read_info(run / "model")[0].expert_weight_format == "mxfp4"


def test_init_from_errors_are_one_line(work, tmp_path, capsys):
    conv = work / "conv"
    if not conv.exists():
        assert main(["convert", "hf-to-orbax", str(work / "hf"), str(conv)]) == 0
    capsys.readouterr()
    base = ["train", "--init-from", str(conv), "--steps", "1", "--run-dir", str(tmp_path / "r")]
    assert main(base + ["--preset", "tiny"]) == 2
    assert "brings its own model config; drop --preset/--config" in capsys.readouterr().err
    assert main(base + ["--set", "hidden_size=64"]) == 2
    assert "--set hidden_size: with --init-from the architecture comes from" in \
        capsys.readouterr().err
    big = tmp_path / "big"
    shutil.copytree(conv, big)
    write_tokenizer(big / "tokenizer.json", chars=[chr(0x4e00 + i) for i in range(80)])
    assert main(["train", "--init-from", str(big), "--steps", "1", "--run-dir",
                 str(tmp_path / "r2")]) == 2
    assert "ids but the model vocabulary is 64" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "r2").exists()
    # starting from the run's own export folder: its export at the end replaced the weights
    # the run started from (silently); refused before training
    own = tmp_path / "r3"
    shutil.copytree(conv, own / "model")
    before = sorted((p.relative_to(own), p.stat().st_mtime_ns) for p in own.rglob("*"))
    assert main(["train", "--init-from", str(own / "model"), "--steps", "1", "--run-dir",
                 str(own)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # (after the run's header line)
    assert err.startswith("kdsa train: error: ") and f"{own / 'model'}: the run's export would " \
        "be written over or into" in err
    assert sorted((p.relative_to(own), p.stat().st_mtime_ns) for p in own.rglob("*")) == before


def test_rl_from_a_converted_checkpoint_uses_its_tokenizer_and_exports(work):
    import rl_entry  # noqa: F401  registers test_first_letter
    from kdsa.infer.tokenizer import HFTokenizer
    from kdsa.train.config import TrainConfig
    from kdsa.train.init_from import training_config
    from kdsa.train.rl.config import RLConfig
    from kdsa.train.rl.loop import run_rl

    conv = work / "conv"
    if not conv.exists():
        assert main(["convert", "hf-to-orbax", str(work / "hf"), str(conv)]) == 0
    config = training_config(read_info(conv)[0])
    rc = RLConfig(envs=("test_first_letter",), steps=1, prompts_per_step=2, group_size=2,
                  seq_len=144, num_slots=4, chat_format="xtml",  # prompts: 135 tokens
                  reasoning_caps={"low": 0, "high": 0, "max": 0},
                  token_budgets={"low": 2, "high": 2, "max": 2}, max_sampling_rounds=1)
    tc = TrainConfig(steps=1, learning_rate=1e-3, schedule="constant", checkpoint_every=100)
    out = run_rl(config, tc, rc, work / "rl", init_from=conv, progress=False,
                 evaluate_heldout=False, compiler_options={"xla_backend_optimization_level": 0})
    assert isinstance(out.sampler.tok, HFTokenizer)  # the model's own, not the byte tokenizer
    assert out.final_step == 1 and 1 in out.metrics
    assert out.metrics[1]["rollout_tokens"] > 0  # (at seq_len 48 every prompt filled the row)
    assert (work / "rl" / "model" / "tokenizer.json").is_file()
    assert read_info(work / "rl" / "model")[0] == read_info(conv)[0]


def test_a_fresh_indexer_starts_in_dense_warmup(tmp_path):
    """``info["fresh"]`` (what ``kdsa convert`` writes when it initialises the DSA indexer)
    puts ``--init-from`` runs into the indexer's dense warm-up stage unless one is chosen."""
    from model_fixtures import MICRO, random_params

    from kdsa.model import checkpoint as ckpt
    from kdsa.train.config import TrainConfig
    from kdsa.train.init_from import indexer_stage_for

    # two layers, the second a gated DSA layer with its indexer, and random NumPy weights:
    # only the folder's info is read, so no model is built (an eager build of the tiny preset
    # compiles one op per initializer)
    config = MICRO
    fresh = [k for k in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config)))
             if ".indexer." in k]
    assert fresh
    ckpt.save_params(tmp_path / "fresh", config, random_params(config, 0),
                     metadata={"fresh": fresh})
    ckpt.save_params(tmp_path / "trained", config, random_params(config, 0))
    tc = TrainConfig()
    assert indexer_stage_for(tmp_path / "fresh", tc, chosen=False).indexer_stage == \
        "dense_warmup"
    assert indexer_stage_for(tmp_path / "fresh", tc, chosen=True).indexer_stage == "none"
    assert indexer_stage_for(tmp_path / "trained", tc, chosen=False).indexer_stage == "none"


def test_source_folder_follows_runs_back_to_the_converted_folder(tmp_path, monkeypatch):
    """A run started from another run's checkpoint descends from the converted folder two hops
    back: ``source_folder`` follows ``init_from`` there (the export's layout and tokenizer, and
    the tokenizer a next run trains with); a loop, a folder gone, or one that now holds
    another architecture ends the chain with the reason. (Metadata faked: no compiles.)"""
    from kdsa.model import checkpoint as ckpt
    from kdsa.model.config import get_preset
    from kdsa.train import init_from

    tiny = get_preset("tiny")
    infos = {"run2": {"training": {"init_from": str(tmp_path / "run1")}},
             "run1": {"training": {"init_from": str(tmp_path / "conv")}},
             "conv": {"source": {"layout": "kimi_linear"}},
             "loop_a": {"training": {"init_from": str(tmp_path / "loop_b")}},
             "loop_b": {"training": {"init_from": str(tmp_path / "loop_a")}},
             "orphan": {"training": {"init_from": str(tmp_path / "gone")}},
             "random": {"training": {"init_from": None}},
             # a run started from its own RUN_DIR, which locates to its step folder
             "own_step": {"training": {"init_from": str(tmp_path / "own_run")}}}
    configs = {"conv": tiny.replace(expert_weight_format="mxfp4", moe_impl="pallas")}

    def read_info(path):
        name = Path(path).name
        if name not in infos:
            raise ckpt.CheckpointError(f"{path}: no such folder")
        return configs.get(name, tiny), infos[name]

    monkeypatch.setattr(ckpt, "locate", lambda p: (
        Path(str(p).replace("own_run", "own_step")), "conv" not in str(p)))
    monkeypatch.setattr(ckpt, "read_info", read_info)
    folder, info, why = init_from.source_folder(tmp_path / "run2", tiny)
    assert folder == tmp_path / "conv" and info["source"]["layout"] == "kimi_linear" and not why
    assert "a loop" in init_from.source_folder(tmp_path / "loop_a", tiny)[2]
    assert "a loop" in init_from.source_folder(tmp_path / "own_run", tiny)[2]
    assert "cannot be read now" in init_from.source_folder(tmp_path / "orphan", tiny)[2]
    assert init_from.source_folder(tmp_path / "random", tiny) == (None, {}, "")
    other = tiny.replace(hidden_size=2 * tiny.hidden_size)
    assert "another model" in init_from.source_folder(tmp_path / "run2", other)[2]
