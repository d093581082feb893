"""SFT with images: the data path (rendering, loss mask, image files, errors) and a tiny
vision-language model (1-block tower, one KDA layer) that learns by SFT, in 40 steps, to name
the stripes it is shown (horizontal -> "h", vertical -> "v"), checked on held-out images."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from kdsa.infer.chat import get_format
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.transformer import Transformer
from kdsa.model.vision.assemble import image_batch, image_inputs
from kdsa.model.vision.inputs import to_data_url
from kdsa.train.config import TrainConfig
from kdsa.train.optim import make_optimizer
from kdsa.train.step import init_state, split_model, train_step
from kdsa.train.vision_data import ImageSftData, read_image_sft_jsonl

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
    (tmp_path / "d.jsonl").write_text("\n".join(__import__("json").dumps(x) for x in lines))
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
])
def test_bad_examples_are_named(tmp_path, messages, msg):
    with pytest.raises(ValueError, match=f"example 0: .*{msg}"):
        ImageSftData([{"messages": messages}], FMT, _config().vision_config, batch_size=1,
                      seq_len=SEQ, base_dir=tmp_path)


def test_tiny_vl_learns_stripe_direction_by_sft():
    cfg = _config()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    train, held_out = _data(64, seed=0), _data(16, seed=1)
    tc = TrainConfig(steps=40, batch_size=16, seq_len=SEQ, warmup_steps=0, learning_rate=1e-2,
                     weight_decay=0.0, bias_update_rate=0.0)
    _, params, _ = split_model(model, tc)
    tx = make_optimizer(tc, params)
    graphdef, state = init_state(model, tc, tx)

    @jax.jit
    def first_answer_token(state, batch):
        m = nnx.merge(graphdef, state.params, state.rest)
        logits = m.forward(batch["inputs"], segment_ids=batch["segment_ids"],
                           **image_inputs(m, batch["inputs"], image_batch(batch))).logits
        pos = jnp.argmax(batch["loss_mask"], axis=1)                 # the answer letter
        pred = jnp.take_along_axis(logits, pos[:, None, None], 1)[:, 0].argmax(-1)
        return pred, jnp.take_along_axis(batch["targets"], pos[:, None], 1)[:, 0]

    losses = []
    for i in range(tc.steps):
        state, metrics = train_step(graphdef, state, train.batch(i), tc=tc, tx=tx,
                                    layout=model.segment_layout)
        losses.append(float(metrics["loss"]))
    pred, want = (np.asarray(x) for x in first_answer_token(state, held_out.batch(0)))
    assert set(want.tolist()) == {ord("h"), ord("v")}
    assert (pred == want).mean() == 1.0, (pred, want, losses[-5:])
    assert losses[-1] < 0.05 * losses[0]
