"""``kdsa quant-check`` on a tiny checkpoint: the report's KL and agreement recomputed from two
plain forward passes and NumPy (served on an 8-device generate mesh); identical models give KL 0
/ agreement 1; one expert's scales shifted by one exponent step are caught exactly on the tokens
after that expert first runs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.cli.main import main
from kdsa.model import checkpoint as ckpt
from kdsa.model.config import get_preset
from kdsa.model.moe_mxfp4 import pack_expert_arrays
from kdsa.model.outputs import Collect, layers_of
from kdsa.model.transformer import Transformer

CONFIG = get_preset("tiny")
PROMPTS = [{"id": "ids", "prompt_ids": [5, 17, 99, 3, 250, 42, 7]},
           {"id": "text", "prompt": "Once upon a time"},
           {"id": "chat", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
            "reasoning_effort": "low"}]
SEQ = ([5, 17, 99, 3], [250, 42, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12])  # prompt, "generated"
ARGS = ["--max-tokens", "10", "--slots", "2", "--max-len", "512", "--prefill-chunk", "16"]  # one bucket


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """bf16 reference, its MXFP4 version (the export path), and the MXFP4 version with one
    routed expert's w1 scales (in the scanned group of layers 1-2) one exponent step up: the
    expert that layers 1-2 first use latest on ``SEQ``, so positions before it exist."""
    d = tmp_path_factory.mktemp("qc")
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    ckpt.save_model(d / "ref", CONFIG, model)
    flat = {k: v[...] for k, v in ckpt.flat_variables(nnx.state(model)).items()}
    packed = jax.jit(pack_expert_arrays)(flat)
    q = CONFIG.replace(expert_weight_format="mxfp4")
    ckpt.save_params(d / "mxfp4", q, ((k, (lambda a=a: a)) for k, a in packed.items()))
    key = "segments.1.layers.0.block_sparse_moe.experts.w1_scale"  # [2 layers, E, N, K/32]
    _, m = ckpt.load_model(d / "mxfp4")
    expert = int(np.argmax(_first_use(m, SEQ[0] + SEQ[1])))
    bumped = dict(packed)
    bumped[key] = packed[key].at[:, expert].add(jnp.uint8(1))      # [R, E, N, K/32] codes + 1
    ckpt.save_params(d / "bumped", q, ((k, (lambda a=a: a)) for k, a in bumped.items()))
    (d / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return d, expert


# Jitted forwards shared by every test (eager forwards of the tiny model take ~4 s each on
# CPU, op by op): one compile per model structure and shape; equal graphdefs (the MXFP4 and
# bumped folders) share it
_routing = nnx.jit(lambda m, ids: m.forward(ids, collect=Collect(routing=True))
                   .stats.expert_ids)
_fwd = nnx.jit(lambda m, ids: m(ids))
PAD = 32  # every teacher-forced sequence zero-padded to this length: one compile per model


def _first_use(model, seq) -> np.ndarray:
    """``[E]``: the first position at which layer 1 or 2 routes a token to each expert."""
    assert layers_of(CONFIG, ffn="moe")[:2] == (1, 2)  # layers 1-2: the scanned MoE group
    ids = np.asarray(_routing(model, jnp.asarray([seq])))           # [L_moe, 1, T, k]
    used = (ids[0:2, 0, :, :, None] == np.arange(CONFIG.num_experts)).any((0, 2))  # [T, E]
    return np.where(used.any(0), used.argmax(0), len(seq))


def _report(d, *cand, out="r.json"):
    rc = main(["quant-check", "--reference", str(d / cand[0]), "--prompts",
               str(d / "prompts.jsonl"), "--out", str(d / out), *ARGS, *cand[1:]])
    assert rc == 0
    return json.loads((d / out).read_text())


def _log_probs(folder, ids):
    """``[T, V]`` log-probs of the plain forward of ``folder`` over ``ids`` (zero-padded to
    ``PAD``: causal, so the padding changes nothing, as in ``forced_log_probs``)."""
    _, model = ckpt.load_model(folder)
    padded = np.zeros((1, PAD), np.int32)
    padded[0, :len(ids)] = ids
    logits = _fwd(model, jnp.asarray(padded))[0, :len(ids)]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)


def test_report_equals_plain_forwards_and_numpy(folders, tmp_path):
    """bf16 reference against its MXFP4 version, served on the 8 host devices' generate mesh
    (experts over 2, requests over 4): the report equals single-device forwards + NumPy (KL
    to 1e-4 relative; agreement wherever the top-2 margin is not a near-tie)."""
    d = folders[0]
    rc = main(["quant-check", "--reference", str(d / "ref"), "--candidate", str(d / "mxfp4"),
               "--prompts", str(d / "prompts.jsonl"), "--out", str(tmp_path / "r.json"),
               "--html", str(tmp_path / "r.html"), *ARGS, "--mesh", "expert=2,data=4",
               "--slots", "8"])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    rec = next(p for p in report["prompts"] if p["id"] == "ids")
    gen = rec["token_ids"]
    seq = PROMPTS[0]["prompt_ids"] + gen
    a, b = (_log_probs(d / f, seq)[len(PROMPTS[0]["prompt_ids"]) - 1:-1] for f in ("ref", "mxfp4"))
    kl = np.sum(np.exp(a) * (a - b), axis=-1)
    agree = (a.argmax(-1) == b.argmax(-1)).astype(float)
    np.testing.assert_allclose(rec["tokens"]["kl"], kl, rtol=1e-4, atol=1e-6)
    margin = np.minimum(*(np.diff(np.sort(x, -1)[:, -2:], axis=-1)[:, 0] for x in (a, b)))
    clear = margin > 1e-4
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(np.asarray(rec["tokens"]["agree"])[clear], agree[clear])
    np.testing.assert_allclose(rec["tokens"]["logp_ref"], a[np.arange(len(gen)), gen], atol=1e-5)
    s = report["summary"]
    every = np.concatenate([p["tokens"]["kl"] for p in report["prompts"]])
    assert s["kl_mean"] == pytest.approx(every.mean()) and s["kl_mean"] > 0
    assert s["tokens"] == sum(len(p["token_ids"]) for p in report["prompts"]) == every.size
    assert 0 <= s["top1_agreement"] <= 1
    cats = s["by_category"]
    assert cats["reasoning"]["kl"]["n"] > 0 and cats["other"]["kl"]["n"] > 0
    assert set(s["reasoning_tokens_by_effort"]) == {"low", "none"}  # chat line; raw lines
    assert "<img" in (tmp_path / "r.html").read_text()


def test_identical_models_give_zero(folders):
    """The same log-probs on both sides: KL exactly 0, agreement 1; the same completion twice:
    identical outputs (the end-to-end runs above compare different models; the engine's greedy
    decoding is deterministic, tests/test_engine.py)."""
    from types import SimpleNamespace

    from kdsa.infer.quant_check import compare_outputs, reference_tokens, token_stats

    d = folders[0]
    seq = PROMPTS[0]["prompt_ids"] + [1, 2, 3, 4]
    logp = jnp.asarray(_log_probs(d / "ref", seq)[6:-1], jnp.float32)
    for top_k in (1024, 16):  # exact, and the top-k + rest coarsening
        st = token_stats(reference_tokens(logp, [1, 2, 3, 4], top_k), logp, [1, 2, 3, 4])
        assert st["kl"].tolist() == [0.0] * 4, (top_k, st["kl"])
        assert st["agree"].tolist() == [1.0] * 4
    done = SimpleNamespace(token_ids=[1, 2], text="x", output=None, reasoning_tokens=0)
    same = compare_outputs(done, done)
    assert same["first_divergence"] is None and same["answer_match"] and same["tool_args_match"]


def test_a_prompt_that_generated_nothing_is_summarized():
    """A prompt with no generated token (the engine refused it) has empty token lists: the
    summary counts it (its empty float masks used to raise an IndexError after both models
    had run, losing the whole report)."""
    from types import SimpleNamespace

    from kdsa.infer.quant_check import prompt_record, summarize

    none = SimpleNamespace(token_ids=[], text="", output=None, reasoning_tokens=0,
                           prompt_tokens=3)
    empty = {k: np.zeros(0) for k in ("kl", "agree", "logp_ref", "logp_cand")}
    one = {"kl": np.asarray([0.5]), "agree": np.asarray([1.0]),
           "logp_ref": np.asarray([-1.0]), "logp_cand": np.asarray([-1.5])}
    some = SimpleNamespace(token_ids=[7], text="a", output=None, reasoning_tokens=0,
                           prompt_tokens=3)
    records = [prompt_record("empty", None, none, none, [], [], empty),
               prompt_record("one", None, some, some, ["answer"], [False], one)]
    s = summarize(records)
    assert s["prompts"] == 2 and s["tokens"] == 1 and s["kl_mean"] == 0.5
    assert s["by_category"]["answer"]["kl"]["n"] == 1


def test_on_the_fly_mxfp4_is_the_exported_mxfp4(folders):
    """``--candidate-experts mxfp4`` builds the candidate with ``with_mxfp4_experts``: the same
    bytes as the MXFP4 folder the export path wrote (so its report is that folder's)."""
    from kdsa.infer.quant_check import with_mxfp4_experts

    d = folders[0]
    config, model = ckpt.load_model(d / "ref")
    q, fly = with_mxfp4_experts(config, model)
    _, folder = ckpt.load_model(d / "mxfp4")
    assert q == folder.config
    a, b = (ckpt.flat_variables(nnx.state(m)) for m in (fly, folder))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k][...]), np.asarray(b[k][...]), err_msg=k)
    with pytest.raises(ValueError, match="needs a reference with bf16 routed experts"):
        with_mxfp4_experts(q, folder)


def test_one_expert_off_by_one_exponent_is_caught_where_it_runs(folders):
    """The report's per-token KL (``forced_log_probs`` -> ``reference_tokens`` ->
    ``token_stats``) of the MXFP4 model against the same model with one expert's scales one
    exponent step up: float32 rounding (under 1e-7) at every position before the first token
    routed to that expert, at least 1e-4 somewhere from there on. (Exactly 0 under JAX 0.12.0;
    0.12.1 left 1.4e-8 at one position before it; the cause was not traced.)"""
    from kdsa.infer.quant_check import forced_log_probs, reference_tokens, token_stats

    d, expert = folders
    prompt, gen = SEQ
    (_, a), (_, b) = ckpt.load_model(d / "mxfp4"), ckpt.load_model(d / "bumped")
    la, lb = (forced_log_probs(lambda ids, m=m: _fwd(m, ids), prompt, gen, PAD) for m in (a, b))
    kl = token_stats(reference_tokens(la, gen, 1024), lb, gen)["kl"]
    first = int(_first_use(a, prompt + gen)[expert])
    positions = len(prompt) - 1 + np.arange(len(kl))                    # where each is predicted
    assert (positions < first).any() and (positions >= first).any(), first  # both sides seen
    assert np.all(kl[positions < first] < 1e-7), (first, kl)
    assert kl[positions >= first].max() > 1e-4, (first, kl)


def test_token_categories_from_the_engine_events():
    """Reasoning / answer from their events; the tokens up to a ``tool_call`` event are the
    call: those over its name ``tool_name``, the rest ``tool_args``; markers ``other``."""
    from kdsa.infer.chat import ToolCall
    from kdsa.infer.quant_check import has_digit, token_categories
    from kdsa.infer.tokenizer import ByteTokenizer

    tok = ByteTokenizer(384)
    call = ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris 7"}')
    think, answer, span = tok.encode("hm"), tok.encode("ok"), tok.encode('<get_weather city="Paris 7">')
    ids = think + answer + span + [0]
    deltas = ([[("reasoning", "h")], [("reasoning", "m")], [("content", "o")], [("content", "k")]]
              + [[] for _ in span[:-1]] + [[("tool_call", call)]] + [[]])
    cats = token_categories(tok, ids, deltas)
    assert cats[:4] == ["reasoning"] * 2 + ["answer"] * 2 and cats[-1] == "other"
    named = [tok.decode([t]) for t, c in zip(ids, cats) if c == "tool_name"]
    assert "".join(named) == "get_weather"
    assert cats[4:-1].count("tool_args") == len(span) - len("get_weather")
    assert [has_digit(tok, t) for t in tok.encode("a7")] == [False, True]


def test_quant_check_runs_every_line_greedy():
    """A prompts line in ``kdsa generate``'s format may set sampling fields: quant-check runs
    both models greedy with ``--max-tokens`` anyway (a line's temperature made both sample,
    and equal seeds made their answers look alike)."""
    from kdsa.infer.engine import Request
    from kdsa.infer.quant_check import greedy
    from kdsa.infer.sampling import SamplingParams

    line = Request([1, 2], SamplingParams(temperature=1.0, seed=1, top_p=0.5, top_k=3,
                                          max_tokens=3, stop=("x",), ignore_eos=True))
    (r,) = greedy([line], 6)
    assert r.sampling == SamplingParams(temperature=0.0, max_tokens=6)
