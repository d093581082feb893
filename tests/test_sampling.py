"""Sampling: filters against a float64 NumPy transcription, greedy, forced tokens, model
log-probs, per-row seeds, empirical frequencies."""

import jax
import numpy as np
import pytest

from kdsa.infer.sampling import SamplingParams, filtered_logits, row_keys, sample_jit

V = 12


def ref_filter(logits, temperature, top_k, top_p, min_p):
    """Row by row, float64, written from the definitions (sort, walk, threshold)."""
    x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    keep = np.ones_like(x, bool)
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        keep &= x >= kth
    if top_p < 1.0:
        order = sorted(np.flatnonzero(keep), key=lambda i: -x[i])
        p = np.exp(x[order] - x[order].max())
        p /= p.sum()
        kept, mass = [], 0.0
        for i, pi in zip(order, p):
            if mass < top_p:
                kept.append(i)
            mass += pi
        thr = min(x[i] for i in kept)
        keep &= x >= thr
    if min_p > 0:
        p = np.exp(x - x.max())
        keep &= p >= min_p
    return np.where(keep, x, -np.inf)


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
    (0.5, 5, 0.6, 0.05), (2.0, 1, 1.0, 0.0), (1.0, 20, 0.999, 0.0), (0.0, 4, 0.5, 0.1)]


@pytest.fixture(scope="module")
def logits():
    x = jax.random.normal(jax.random.key(0), (len(CASES), V)) * 2.0
    return np.asarray(x.at[:, 3].set(x[:, 5]))  # a tie at the boundary somewhere


def _arrays(cases):
    t, k, p, m = zip(*cases)
    return (np.array(t, np.float32), np.array(k, np.int32), np.array(p, np.float32),
            np.array(m, np.float32))


def test_filters_match_reference(logits):
    got = np.asarray(filtered_logits(logits, *_arrays(CASES)))
    for r, case in enumerate(CASES):
        want = ref_filter(logits[r], *case)
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(want), err_msg=str(case))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[r][fin], want[fin], rtol=1e-5)
    assert np.isfinite(got).sum(1).min() >= 1


def test_greedy_forced_and_model_logprobs(logits):
    n = len(CASES)
    temp = np.zeros(n, np.float32)
    ones, zeros = np.ones(n, np.float32), np.zeros(n, np.float32)
    forced = np.full(n, -1, np.int32)
    forced[1] = 7
    tok, lp, top_ids, top_lp = sample_jit(logits, temp, np.zeros(n, np.int32), ones, zeros,
                                          np.arange(n, dtype=np.uint32), np.zeros(n, np.int32),
                                          forced, num_top=3)
    want = logits.argmax(-1)
    want[1] = 7
    np.testing.assert_array_equal(np.asarray(tok), want)
    ls = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ls[np.arange(n), want], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ls, -1)[:, :3])
    np.testing.assert_allclose(np.asarray(top_lp), -np.sort(-ls, -1)[:, :3], atol=1e-5)


def test_tempered_logprobs_are_those_of_the_sampled_distribution(logits):
    """``tempered``: the log-probs (chosen and top) of ``softmax(logits / T)`` on rows with
    T > 0, the model's on greedy rows and rows without the flag; the tokens are unchanged."""
    n = len(CASES)
    temp = np.asarray([0.5, 2.0, 0.0, 0.5] + [0.7] * (n - 4), np.float32)
    tempered = np.asarray([True, True, True, False] + [True] * (n - 4))
    args = (temp, np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32),
            np.arange(n, dtype=np.uint32), np.zeros(n, np.int32), np.full(n, -1, np.int32))
    tok, lp, top_ids, top_lp = sample_jit(logits, *args, None, tempered, num_top=3)
    plain = sample_jit(logits, *args, None, np.zeros(n, bool), num_top=3)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(plain[0]))
    t = np.where(tempered & (temp > 0), temp, 1.0).astype(np.float64)[:, None]
    x = logits.astype(np.float64) / t
    ls = x - np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ls[np.arange(n), np.asarray(tok)], atol=1e-5)
    np.testing.assert_allclose(np.asarray(top_lp), -np.sort(-ls, -1)[:, :3], atol=1e-5)
    assert not np.allclose(np.asarray(lp)[:2], np.asarray(plain[1])[:2], atol=1e-3)
    np.testing.assert_array_equal(np.asarray(lp)[2:4], np.asarray(plain[1])[2:4])
    with pytest.raises(ValueError, match="tempered_logprobs=1"):
        SamplingParams(tempered_logprobs=1)


def test_seeded_rows_are_batch_independent(logits):
    n = len(CASES)
    args = _arrays([(1.0, 0, 1.0, 0.0)] * n)
    seeds = np.arange(100, 100 + n, dtype=np.uint32)
    counters = np.full(n, 5, np.int32)
    forced = np.full(n, -1, np.int32)
    full = np.asarray(sample_jit(logits, *args, seeds, counters, forced)[0])
    for r in (0, 3):
        one = sample_jit(logits[r:r + 1], *(a[r:r + 1] for a in args), seeds[r:r + 1],
                         counters[r:r + 1], forced[r:r + 1])[0]
        assert int(one[0]) == full[r]
    k = row_keys(np.array([1, 1], np.uint32), np.array([0, 1], np.int32))
    assert not np.array_equal(jax.random.key_data(k[0]), jax.random.key_data(k[1]))


def test_empirical_frequencies_follow_the_filtered_distribution(logits):
    """20000 draws of one row (top-k 5, top-p 0.9, T 0.8) against the reference probabilities."""
    case = (0.8, 5, 0.9, 0.0)
    n = 20000
    row = np.repeat(logits[4:5], n, 0)
    args = _arrays([case] * n)
    tok = np.asarray(sample_jit(row, *args, np.full(n, 3, np.uint32),
                                np.arange(n, dtype=np.int32), np.full(n, -1, np.int32))[0])
    ref = ref_filter(logits[4], *case)
    p = np.exp(ref - ref[np.isfinite(ref)].max())
    p /= p.sum()
    freq = np.bincount(tok, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(p))
    np.testing.assert_allclose(freq, p, atol=0.015)  # ~4 standard errors at n=20000


def test_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("",))
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="ignore_eos"):  # a kdsa generate row's "yes"
        SamplingParams(ignore_eos="yes")
