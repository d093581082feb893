"""Images through the stack on one small vision-language model (2 layers: KDA + Gated DSA):
features at the placeholders, chunked prefill with images + decode == the full forward, the
engine, and ``/v1/chat/completions`` with an image (real HTTP); malformed images are 400s."""

import base64
import dataclasses
import http.client
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.infer import openai_api as api
from kdsa.infer.chat import get_format
from kdsa.infer.engine import Engine, Request
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.server_run import start_server
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.transformer import Transformer
from kdsa.model.outputs import ImageInputs
from kdsa.model.vision.assemble import image_inputs, pack_images
from kdsa.model.vision.inputs import ImageLimits, to_data_url
from kdsa.model.vision.patching import patchify

TOK = ByteTokenizer(384)
FMT = get_format("xtml", TOK)


def _config():
    cfg = get_preset("tiny-vl")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=(2,))
    return cfg.replace(num_hidden_layers=2, attn_res_block_size=None, linear_attn_config=lac,
                       kda_chunk_size=8, dsa_query_chunk_size=8)


@pytest.fixture(scope="module")
def model():
    return Transformer(_config(), rngs=nnx.Rngs(0))


def _images():
    rng = np.random.default_rng(0)
    vc = _config().vision_config
    return [patchify(rng.integers(0, 256, s + (3,)).astype(np.uint8), vc)
            for s in [(30, 45), (14, 28)]]


def _sequence(ims, ph):
    text = list(b"look: ")
    return np.asarray(text + [ph] * ims[0].num_tokens + list(b" and ") + [ph] * ims[1].num_tokens
                      + list(b" ok?"), np.int32)


MAX_LEN = 224


@nnx.jit
def _full_padded(model, ids, embeds, mask):
    return model.forward(ids, images=ImageInputs(embeds=embeds, mask=mask)).logits


def _full(model, seq, feats):
    """Full-forward logits [T, V] of ``seq`` with ``feats`` placed at its placeholders by hand
    (padded to MAX_LEN so one compile serves every test; causal, so padding changes nothing)."""
    ph = model.config.vision_config.media_placeholder_token_id
    ids = np.zeros((1, MAX_LEN), np.int32)
    ids[0, :len(seq)] = seq
    where = np.nonzero(ids[0] == ph)[0]
    embeds = np.zeros((1, MAX_LEN, model.config.hidden_size), np.float32)
    embeds[0, where] = feats[:len(where)]
    out = _full_padded(model, jnp.asarray(ids), jnp.asarray(embeds), jnp.asarray(ids == ph))
    return np.asarray(out)[0, :len(seq)], embeds


@pytest.fixture(scope="module")
def runner(model):
    return ModelRunner(model, num_slots=2, max_len=MAX_LEN, prefill_chunk=8, min_bucket=8)


def test_prefill_with_images_then_decode_equals_full_forward(model, runner):
    cfg = model.config
    ph = cfg.vision_config.media_placeholder_token_id
    ims = _images()
    seq = _sequence(ims, ph)                                                   # [T]
    feats = runner.encode_images(ims)                                          # [5, D]
    assert feats.shape == (sum(im.num_tokens for im in ims), cfg.hidden_size) == (5, 64)
    full, manual = _full(model, seq, feats)
    # image_inputs (the training path) puts the tower features exactly at the placeholders
    ids = np.zeros((1, MAX_LEN), np.int32)
    ids[0, :len(seq)] = seq
    kw = nnx.jit(image_inputs)(model, jnp.asarray(ids), jax.tree.map(
        jnp.asarray, pack_images([ims], 64)))
    np.testing.assert_allclose(np.asarray(kw.embeds), manual, rtol=1e-5, atol=1e-5)
    # the image changes what follows it, not what precedes it
    where = np.nonzero(seq == ph)[0]
    other, _ = _full(model, seq, feats * 0.5)
    np.testing.assert_allclose(other[:where[0]], full[:where[0]], rtol=1e-5, atol=1e-5)
    assert np.abs(other[where[0]:] - full[where[0]:]).max() > 1e-3
    # chunked prefill (chunks of 8 cut the image spans) of all but 3 tokens, then decode 3
    fidx = np.where(seq == ph, np.cumsum(seq == ph) - 1, -1)
    n_pre = len(seq) - 3
    for start in range(0, n_pre, 8):
        stop = min(start + 8, n_pre)
        idx = fidx[start:stop]
        last = runner.prefill(1, seq[start:stop], start, image_embeds=feats[np.maximum(idx, 0)],
                              image_mask=idx >= 0)
        np.testing.assert_allclose(np.asarray(last)[0], full[stop - 1], rtol=2e-4, atol=2e-4)
    for t in range(n_pre, len(seq)):
        tokens, pos, active = np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros(2, bool)
        tokens[1], pos[1], active[1] = seq[t], t, True
        out = np.asarray(runner.decode(tokens, pos, active))
        np.testing.assert_allclose(out[1], full[t], rtol=2e-4, atol=2e-4)


def test_generate_jsonl_with_image_file(runner, tmp_path):
    from PIL import Image

    from kdsa.infer.generate import read_requests

    Image.fromarray(np.full((30, 60, 3), 200, np.uint8)).save(tmp_path / "wide.png")
    row = {"id": "a", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "image", "path": "wide.png"}]}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    eng = Engine(runner, TOK, chat_format=FMT)
    (req,) = read_requests(tmp_path / "in.jsonl", eng, FMT, effort="low", defaults={}, seed=0)
    assert len(req.images) == 1 and req.images[0].grid == (4, 6)           # 6 image tokens
    assert req.prompt.count(_config().vision_config.media_placeholder_token_id) == 6
    (done,) = eng.generate([req])
    assert done.prompt_tokens == len(req.prompt) and 1 <= len(done.token_ids) <= 2
    (tmp_path / "bad.jsonl").write_text(json.dumps(dict(row, messages=[{"role": "user", "content": [
        {"type": "image", "path": "missing.png"}]}])) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: .*image_url: no such image file .*missing.png"):
        read_requests(tmp_path / "bad.jsonl", eng, FMT, effort="low", defaults={}, seed=0)


SERVE_LIMITS = ["--max-images", "2", "--max-image-pixels", "40000", "--max-image-bytes", "20000"]


def _serve_args(extra):
    from kdsa.cli.main import build_parser

    return build_parser().parse_args(["serve", "--preset", "tiny-vl"] + extra)


@pytest.fixture(scope="module")
def served(runner):
    """The server with the image limits of ``kdsa serve --max-images 2 --max-image-pixels
    40000 --max-image-bytes 20000``."""
    from kdsa.cli.serve_cmd import image_limits_from_args

    limits = image_limits_from_args(_serve_args(SERVE_LIMITS))
    assert limits == ImageLimits(max_images=2, max_pixels=200 * 200, max_bytes=20000)
    eng = Engine(runner, TOK, chat_format=FMT)
    handle = start_server(eng, FMT, model_name="kdsa-vl", image_limits=limits)
    yield handle, eng
    handle.stop()


def _post(handle, body):
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def _body(*images, text="What is shown?"):
    parts = [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"model": "kdsa-vl", "messages": [{"role": "user", "content": parts}],
            "reasoning_effort": "none", "temperature": 0, "max_tokens": 3, "logprobs": True}


def test_server_image_request_matches_full_forward(served, model, runner):
    handle, _ = served
    px = np.random.default_rng(1).integers(0, 256, (40, 30, 3)).astype(np.uint8)
    body = _body(to_data_url(px))
    status, out = _post(handle, body)
    assert status == 200, out
    first = out["choices"][0]["logprobs"]["content"][0]["logprob"]
    job = api.parse_chat_request(body, model_name="kdsa-vl", chat_format=FMT, max_len=MAX_LEN,
                                 vision=model.config.vision_config)
    assert len(job.images) == 1 and job.images[0].size == (30, 40)
    assert out["usage"]["prompt_tokens"] == len(job.prompt)
    full, _ = _full(model, np.asarray(job.prompt, np.int32), runner.encode_images(job.images))
    assert abs(float(jax.nn.log_softmax(full[-1]).max()) - first) < 1e-3


@pytest.mark.parametrize("url, msg", [
    ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA", "cannot decode"),      # truncated PNG
    ("data:image/png;base64,@@@", "invalid base64"),
    ("https://example.com/cat.png", "only base64 data URLs"),
    ("data:image/png;base64,", "empty image data"),
])
def test_malformed_images_are_400(served, url, msg):
    handle, eng = served
    status, out = _post(handle, _body(url))
    assert status == 400 and msg in out["error"]["message"], out
    assert "messages[0].content[1].image_url" in out["error"]["message"]
    assert out["error"]["param"] == "messages"


def test_image_limits_are_400(served):
    handle, _ = served
    small = to_data_url(np.zeros((20, 20, 3), np.uint8))
    status, out = _post(handle, _body(small, small, small))
    assert status == 400 and "limit is 2" in out["error"]["message"]
    status, out = _post(handle, _body(to_data_url(np.zeros((300, 300, 3), np.uint8))))
    assert status == 400 and "90000 pixels" in out["error"]["message"]
    noisy = np.random.default_rng(0).integers(0, 256, (150, 150, 3)).astype(np.uint8)
    status, out = _post(handle, _body(to_data_url(noisy)))       # 22500 px, > 20000 bytes
    assert status == 400 and "more than 20000 bytes" in out["error"]["message"], out
    status, out = _post(handle, _body(small))  # the server still serves
    assert status == 200


def test_body_limit_leaves_room_for_the_image_limits():
    """aiohttp's body cap was 16 MiB whatever the image limits: an image over about 12 MiB
    (16 MiB in base64) was a 413 before the 400 naming the image could be given."""
    import types

    from kdsa.infer.server import TEXT_BODY_BYTES, body_limit, build_app

    def engine(vision):
        return types.SimpleNamespace(runner=types.SimpleNamespace(
            config=types.SimpleNamespace(vision_config=vision)), tok=None)

    assert body_limit(engine(None)) == TEXT_BODY_BYTES
    lim = ImageLimits()
    b64 = len(base64.b64encode(bytes(lim.max_bytes)))
    assert body_limit(engine(object()), lim) >= TEXT_BODY_BYTES + lim.max_images * b64
    small = ImageLimits(max_images=2, max_bytes=20000)
    assert body_limit(engine(object()), small) == TEXT_BODY_BYTES + 2 * (20000 * 4 // 3 + 4)
    app = build_app(engine(object()), FMT, image_limits=small)
    assert app._client_max_size == body_limit(engine(object()), small)


def test_serve_passes_the_image_limit_flags(monkeypatch):
    from kdsa.cli import generate_cmd, serve_cmd
    from kdsa.infer import server_run

    seen = {}
    monkeypatch.setattr(generate_cmd, "engine_from_args", lambda a: (None, FMT, "m"))
    monkeypatch.setattr(server_run, "serve", lambda engine, fmt, **kw: seen.update(kw))
    assert serve_cmd.run(_serve_args(SERVE_LIMITS + ["--no-warmup"])) == 0
    assert seen["image_limits"] == ImageLimits(max_images=2, max_pixels=40000, max_bytes=20000)
    with pytest.raises(ValueError, match="max_images must be a positive integer, got 0"):
        serve_cmd.run(_serve_args(["--max-images", "0"]))
    with pytest.raises(SystemExit):  # -1 made every request without max_tokens a 500
        _serve_args(["--default-max-tokens", "-1"])


def test_engine_refuses_mismatched_placeholders_and_text_models(runner):
    eng = Engine(runner, TOK, chat_format=FMT)
    ims = _images()
    with pytest.raises(ValueError, match="2 image placeholder tokens but its 2 image"):
        eng.submit(Request([1, 277, 277, 2], SamplingParams(max_tokens=1), images=ims))
    ph = _config().vision_config.media_placeholder_token_id
    a, b = (im.num_tokens for im in ims)
    assert a != b
    with pytest.raises(ValueError, match="does not hold whole images in order"):  # swapped
        eng.submit(Request([1] + [ph] * b + [2] + [ph] * a, SamplingParams(max_tokens=1),
                           images=ims))
    eng.submit(Request([1] + [ph] * (a + b) + [2], SamplingParams(max_tokens=1), images=ims))
    with pytest.raises(api.ApiError, match="does not read images"):
        api.parse_chat_request(_body(to_data_url(np.zeros((20, 20, 3), np.uint8))),
                               model_name="kdsa-vl", chat_format=FMT, max_len=64)


def test_rl_with_image_episodes(model, runner):
    """RL with image prompts (``image_stripes``): the rollouts hand the task's image to the
    engine, the training batch carries it, the sampler's log-probs equal a forward with the
    same images (and not one without), and one RL step on the batch trains the tower."""
    from kdsa.train.config import TrainConfig
    from kdsa.train.optim import make_optimizer
    from kdsa.train.rl import rollout as ro
    from kdsa.train.rl.config import RLConfig
    from kdsa.train.rl.envs import make_env, registered_envs
    from kdsa.train.rl.step import rl_step
    from kdsa.train.step import init_state, split_model

    assert "image_stripes" in registered_envs()
    env = make_env("image_stripes", seed=0)
    rc = RLConfig(envs=("image_stripes",), group_size=2, seq_len=200, chat_format="xtml",
                  tis="none")
    tasks = [(env.task(i), "low") for i in range(2)]
    assert {t.data for t, _ in tasks} <= {"h", "v"} and tasks[0][0].messages[0].images
    eng = Engine(runner, TOK, chat_format=FMT)
    eps = ro.run_episodes(eng, FMT, {env.domain: env}, tasks, group_size=2, rc=rc, seed=0)
    for e in eps:
        e.reward = float(e is eps[0] or e is eps[2])          # varied groups -> advantages
    batch = ro.training_batch([eps[:2], eps[2:]], 4, rc.seq_len, 2, rc)
    assert batch["image_patches"].shape == (4, 8, 3 * 14 * 14)
    assert batch["image_segment"][:, :4].tolist() == [[1] * 4] * 4   # 28 x 28 px: 4 patches

    mask = batch["loss_mask"] > 0
    assert mask.sum() >= 4
    for r, e in enumerate(eps):              # the module's compiled full forward, per row
        n = len(e.tokens) - 1
        feats = runner.encode_images(e.task.messages[0].images)
        lp = jax.nn.log_softmax(_full(model, np.asarray(e.tokens[:n], np.int32), feats)[0], -1)
        got = np.take_along_axis(lp, batch["targets"][r, :n, None], -1)[:, 0][mask[r, :n]]
        np.testing.assert_allclose(got, batch["sampler_logp"][r, :n][mask[r, :n]], atol=2e-3)
        blind = jax.nn.log_softmax(_full(model, np.asarray(e.tokens[:n], np.int32),
                                         0 * feats)[0], -1)         # image features zeroed
        assert np.abs(np.take_along_axis(blind, batch["targets"][r, :n, None], -1)[:, 0]
                      [mask[r, :n]] - got).max() > 1e-2             # the images matter here

    tc = TrainConfig(batch_size=4, seq_len=rc.seq_len, warmup_steps=0, learning_rate=1e-3,
                     weight_decay=0.0, bias_update_rate=0.0, steps=2)
    m2 = nnx.clone(model)
    _, params, _ = split_model(m2, tc)
    tx = make_optimizer(tc, params)
    graphdef, state = init_state(m2, tc, tx)
    new, metrics = rl_step(graphdef, state, batch, 0.0, None, 1.0, tc=tc, tx=tx,
                           loss_cfg=rc.loss_config(), layout=m2.segment_layout)
    assert float(metrics["mismatch_abs"]) < 2e-3 and np.isfinite(float(metrics["loss"]))
    path = ("vision_tower", "patch_embed", "proj", "kernel")
    before, after = (np.asarray(s.params[path[0]][path[1]][path[2]][path[3]][...])
                     for s in (state, new))
    assert np.abs(after - before).max() > 0                  # gradient reached the tower


def test_prefix_cache_keys_images_by_content(model):
    """Image placeholders are keyed by the image's content: the same prompt and image again
    resumes from the deepest page snapshot of the first request's prefill (past the image); the
    same placeholders with another image share only the page before it. Outputs equal a paged
    engine without the cache."""
    vc = model.config.vision_config
    rng = np.random.default_rng(5)
    px = [rng.integers(0, 256, (30, 45, 3)).astype(np.uint8) for _ in range(2)]
    ims = [[patchify(p, vc)] for p in px]
    n = ims[0][0].num_tokens
    seq = (list(rng.integers(0, 256, 70)) + [vc.media_placeholder_token_id] * n
           + list(rng.integers(0, 256, 60)))

    def engine(snapshots):
        r = ModelRunner(model, num_slots=2, max_len=MAX_LEN, prefill_chunk=32, min_bucket=8,
                        num_pages=12, num_snapshots=snapshots)
        return Engine(r, TOK, max_top_logprobs=0, prefix_snapshot_every=1)

    def run(eng, images):
        c, = eng.generate([Request(seq, SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True), images=images)])
        return c.token_ids, np.asarray(c.logprobs)

    cached, plain = engine(4), engine(0)
    hits = []
    for images in (ims[0], ims[0], ims[1]):
        got, want = run(cached, images), run(plain, images)
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], atol=1e-5)
        hits.append(cached.metrics()["prefix_cache"]["hit_tokens"])
    deep = (len(seq) - 1) // 64 * 64
    assert deep >= 128 and hits == [0, deep, deep + 64], hits  # the other image: page 0 only
