"""SFT with images: the data path (rendering, loss mask, image files, errors), ``kdsa train
--data`` on a chat JSONL, and a tiny vision-language model (1-block tower, one KDA layer) that
learns by SFT through the training loop, in 40 steps, to name the stripes it is shown
(horizontal -> "h", vertical -> "v"), checked on held-out images."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from kdsa.infer.chat import get_format
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.vision.assemble import batch_image_inputs
from kdsa.model.vision.inputs import to_data_url
from kdsa.train.checkpointing import Checkpointer
from kdsa.train.config import TrainConfig
from kdsa.train.trainer import prepare, run_training
from kdsa.train.vision_data import ImageSftData, chat_sft_data, read_image_sft_jsonl

FMT = get_format("xtml", ByteTokenizer(384))
SEQ = 104


def _config():
    cfg = get_preset("tiny-vl")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=())
    return cfg.replace(num_hidden_layers=1, attn_res_block_size=None, linear_attn_config=lac,
                       num_experts=0, index_n_heads=None, index_head_dim=None, index_topk=None,
                       vision_config=dataclasses.replace(cfg.vision_config, num_hidden_layers=1))


def _stripes(rng, horizontal: bool) -> np.ndarray:
    """28 x 28 black/white stripes of random width and phase."""
    w, phase = int(rng.integers(2, 6)), int(rng.integers(0, 12))
    band = ((np.arange(28) + phase) // w) % 2 * 255
    img = np.broadcast_to(band[:, None, None], (28, 28, 3)).astype(np.uint8)
    return img if horizontal else img.transpose(1, 0, 2).copy()


def _example(rng, horizontal: bool, image=None) -> dict:
    image = image or {"type": "image_url",
                      "image_url": {"url": to_data_url(_stripes(rng, horizontal))}}
    return {"messages": [{"role": "user", "content": [image]},
                         {"role": "assistant", "content": "h" if horizontal else "v"}]}


def _data(n: int, seed: int) -> ImageSftData:
    rng = np.random.default_rng(seed)
    return ImageSftData([_example(rng, k % 2 == 1) for k in range(n)], FMT,
                        _config().vision_config, batch_size=16, seq_len=SEQ, seed=seed)


def test_data_rows_loss_mask_and_image_files(tmp_path):
    vc = _config().vision_config
    Image.fromarray(_stripes(np.random.default_rng(0), True)).save(tmp_path / "a.png")
    lines = [_example(None, True, {"type": "image", "path": "a.png"}),
             _example(np.random.default_rng(1), False)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    d = read_image_sft_jsonl(tmp_path / "d.jsonl", FMT, vc, batch_size=2, seq_len=SEQ)
    b = d.batch(0)
    assert b["image_patches"].shape == (2, 8, 3 * 14 * 14) and b["inputs"].shape == (2, SEQ)
    for r in range(2):
        assert (b["inputs"][r] == vc.media_placeholder_token_id).sum() == 1  # 2x2 -> 1 token
        assert b["image_segment"][r].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
        trained = b["targets"][r][b["loss_mask"][r] > 0]
        # the answer letter, then the close of response / message and the end of message
        assert bytes([trained[0]]) in (b"h", b"v") and trained[-1] == FMT.stop_ids[0]
        n = int(b["segment_ids"][r].sum())  # tokens of the example; its last one has no target
        assert np.nonzero(b["loss_mask"][r])[0].tolist() == list(range(n - 1 - len(trained),
                                                                          n - 1))


@pytest.mark.parametrize("messages, msg", [
    ([{"role": "user", "content": "hi"}], "must end with the assistant answer"),
    ([{"role": "user", "content": [{"type": "image", "path": "nope.png"}]},
      {"role": "assistant", "content": "x"}], "no such image file"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]},
      {"role": "assistant", "content": "x"}], "not base64"),
    ([{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "x"}],
     "more than seq_len"),
    ([{"role": "user", "content": "hi"},  # (dropped without a word before)
      {"role": "assistant", "content": "x", "reasoning_content": "r"}],
     "message 1 has reasoning_content"),
    ([{"role": "user", "content": "hi"},  # an earlier turn's too (only the last was refused)
      {"role": "assistant", "content": "x", "reasoning_content": "r"},
      {"role": "user", "content": "more"}, {"role": "assistant", "content": "y"}],
     "message 1 has reasoning_content"),
])
def test_bad_examples_are_named(tmp_path, messages, msg):
    with pytest.raises(ValueError, match=f"example 0: .*{msg}"):
        ImageSftData([{"messages": messages}], FMT, _config().vision_config, batch_size=1,
                      seq_len=SEQ, base_dir=tmp_path)


def _write_jsonl(path, lines):
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_kdsa_train_reads_chat_jsonl_and_names_bad_lines(tmp_path, monkeypatch):
    """``kdsa train --data`` on image conversations: the command hands the trainer chat SFT
    data (rows, loss mask, image arrays); a bad image, an image over the limits, or an image
    for a preset without a tower is a clear error naming FILE:LINE (before any compile)."""
    from kdsa.cli.main import main
    from kdsa.train import trainer

    seen = {}

    def fake_run(config, tc, run_dir, *, data_path, **kw):
        seen["data"] = trainer.make_data(config.vocab_size, tc.batch_size, tc.seq_len, tc.seed,
                                         data_path)
        return trainer.RunResult(losses={1: 1.0}, final_step=1, stopped=False, resumed_from=None)

    monkeypatch.setattr(trainer, "run_training", fake_run)
    Image.fromarray(_stripes(np.random.default_rng(0), True)).save(tmp_path / "a.png")
    good = [_example(None, True, {"type": "image", "path": "a.png"}),
            _example(np.random.default_rng(1), False)]
    args = ["train", "--run-dir", str(tmp_path / "run"), "--steps", "20", "--no-progress",
            "--train-set", "batch_size=2", "--train-set", f"seq_len={SEQ}", "--data"]
    assert main(args + [str(_write_jsonl(tmp_path / "d.jsonl", good)), "--preset",
                        "tiny-vl"]) == 0
    data = seen["data"]
    assert isinstance(data, ImageSftData)
    b = data.batch(0)
    assert b["image_patches"].shape == (2, 8, 3 * 14 * 14) and b["loss_mask"].sum() > 0
    Image.new("L", (5000, 4000)).save(tmp_path / "big.png")
    bad = {"bad.jsonl": (good + [_example(None, True, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgo="}})], "bad.jsonl:3: .*cannot decode"),
           "big.jsonl": ([good[0], _example(None, True, {"type": "image", "path": "big.png"})],
                         "big.jsonl:2: .*20000000 pixels; the limit is"),
           "text.jsonl": (good, "text.jsonl:1: .*does not read images")}
    for name, (lines, msg) in bad.items():
        preset = "tiny" if name == "text.jsonl" else "tiny-vl"
        with pytest.raises(ValueError, match=msg):
            chat_sft_data(get_preset(preset), TrainConfig(batch_size=2, seq_len=SEQ),
                          _write_jsonl(tmp_path / name, lines))
        assert main(args + [str(tmp_path / name), "--preset", preset]) == 2


def test_tiny_vl_learns_stripe_direction_by_sft(tmp_path):
    """The training loop ``kdsa train`` runs (``run_training``) on a chat JSONL of stripe
    images (data URLs), then the final checkpoint names held-out stripes."""
    cfg = _config()
    rng = np.random.default_rng(0)
    path = _write_jsonl(tmp_path / "train.jsonl", [_example(rng, k % 2 == 1) for k in range(64)])
    held_out = _data(16, seed=1)
    tc = TrainConfig(steps=40, batch_size=16, seq_len=SEQ, warmup_steps=0, learning_rate=1e-2,
                     weight_decay=0.0, bias_update_rate=0.0, checkpoint_every=1000)
    data = chat_sft_data(cfg, tc, path)
    result = run_training(cfg, tc, tmp_path / "run", data_path=data, progress=False)
    losses = [result.losses[k] for k in sorted(result.losses)]
    _, graphdef, _, build = prepare(cfg, tc)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", every=1000, keep=1)
    step, state, _ = ckpt.restore_latest(jax.eval_shape(build))
    assert step == 40

    @jax.jit
    def first_answer_token(state, batch):
        m = nnx.merge(graphdef, state.params, state.rest)
        logits = m.forward(batch["inputs"], segment_ids=batch["segment_ids"],
                           images=batch_image_inputs(m, batch)).logits
        pos = jnp.argmax(batch["loss_mask"], axis=1)                 # the answer letter
        pred = jnp.take_along_axis(logits, pos[:, None, None], 1)[:, 0].argmax(-1)
        return pred, jnp.take_along_axis(batch["targets"], pos[:, None], 1)[:, 0]

    pred, want = (np.asarray(x) for x in first_answer_token(state, held_out.batch(0)))
    assert set(want.tolist()) == {ord("h"), ord("v")}
    assert (pred == want).mean() == 1.0, (pred, want, losses[-5:])
    assert losses[-1] < 0.05 * losses[0]
