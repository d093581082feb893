"""Batched prefill (``ModelRunner.prefill_batch``): several slots' prompt chunks in one step,
each at its own start and length, equal the same chunks prefilled one slot at a time (the
last-token logits, and the decode step after them), with dense slots and with the paged cache;
the engine batches the prompts of requests admitted together and gives the tokens and
log-probs (1e-5) of an engine that prefills one slot at a time."""

import numpy as np
import pytest
from flax import nnx

from kdsa.infer.engine import Engine, Request
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.overrides import apply_overrides
from kdsa.model.transformer import Transformer

# tiny with 2 layers (KDA, Gated DSA + MoE), top-k 8 below the context
CFG = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                            "linear_attn_config.kda_layers=[1]",
                                            "linear_attn_config.full_attn_layers=[2]"])
SLOTS, MAX_LEN = 4, 192


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _runner(model, paged: bool, batch: bool = True):  # batched prefill is opt-in
    return ModelRunner(model, num_slots=SLOTS, max_len=MAX_LEN, prefill_chunk=32, min_bucket=8,
                       num_pages=SLOTS * 3 if paged else None, batch_prefill=batch)


@pytest.mark.parametrize("paged", [False, True])
def test_batched_chunks_equal_one_slot_at_a_time(model, paged):
    rng = np.random.default_rng(0)
    prompts = {2: rng.integers(0, 256, 40).tolist(), 0: rng.integers(0, 256, 21).tolist(),
               3: rng.integers(0, 256, 9).tolist()}
    together, alone = _runner(model, paged), _runner(model, paged, batch=False)
    if paged:  # each slot's pages scattered, in another order in each runner
        for r, order in ((together, [5, 0, 9, 1, 7, 3, 11, 2, 6, 4, 10, 8]),
                         (alone, list(range(12)))):
            for s in range(SLOTS):
                r.set_pages(s, order[3 * s:3 * s + 3])
    assert together.batched_prefill and not alone.batched_prefill
    rounds = [{2: (0, 17), 0: (0, 5), 3: (0, 9)},   # new requests: fresh rows
              {2: (17, 23), 0: (5, 16)}]             # continuing: slot 3 is done
    for chunks in rounds:
        slots = list(chunks)
        got = np.asarray(together.prefill_batch(
            slots, [prompts[s][a:a + n] for s, (a, n) in chunks.items()],
            [a for a, _ in chunks.values()]))
        assert got.shape == ({3: 4, 2: 2}[len(slots)], CFG.vocab_size)  # row buckets 2, 4
        for r, (s, (a, n)) in enumerate(chunks.items()):
            want = np.asarray(alone.prefill(s, prompts[s][a:a + n], a))[0]
            np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5)
    pos = np.asarray([len(prompts[0]), 0, len(prompts[2]), len(prompts[3])], np.int32)
    active = np.asarray([1, 0, 1, 1], bool)
    tokens = np.asarray([3, 0, 5, 7], np.int32)
    for _ in range(2):
        got, want = (np.asarray(r.decode(tokens, pos, active)) for r in (together, alone))
        np.testing.assert_allclose(got[active], want[active], rtol=1e-5, atol=1e-5)
        pos = pos + active


def test_engine_batches_prompts_and_equals_one_slot_at_a_time(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (70, 12, 33, 101, 5)]

    def run(batch):
        eng = Engine(_runner(model, paged=True, batch=batch), ByteTokenizer(CFG.vocab_size),
                     max_top_logprobs=0, prefill_tokens_per_step=96)
        done = eng.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=5,
                                                       ignore_eos=True)) for p in prompts])
        return eng.metrics(), [(c.token_ids, np.asarray(c.logprobs)) for c in done]

    (m1, together), (m0, alone) = run(True), run(False)
    assert m1["batched_prefill_steps"] > 0 and m1["mean_batched_prefill_rows"] >= 2
    assert m0["batched_prefill_steps"] == 0
    for (gt, gl), (wt, wl) in zip(together, alone):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, atol=1e-5)
