"""Per-request sampling as pure functions of logits: greedy, temperature, top-k, top-p, min-p.

Every row of a batch has its own parameters and its own random stream, so a request samples the
same tokens alone or in any batch (``key = fold_in(key(seed), step)``). Filters apply in the
order temperature -> top-k -> top-p -> min-p, on float32 logits:

* ``temperature == 0`` is greedy (``argmax`` of the raw logits, lowest id on ties);
* top-k keeps tokens whose tempered logit is >= the k-th largest (ties at the boundary kept);
* top-p (nucleus, Holtzman et al. 2019) keeps the smallest prefix of the top-k survivors, sorted
  by probability, whose mass reaches ``top_p`` (a token is kept while the mass *before* it is
  < ``top_p``; ties with the last kept token kept);
* min-p keeps tokens with ``p >= min_p * p_max`` (``logit >= max + log(min_p)``); the ratio is
  unchanged by renormalisation, so its place in the order does not matter.

Log-probs returned with a token are those of the *model* distribution (``log_softmax`` of the raw
logits, before temperature and filters), or with ``tempered_logprobs`` those of the tempered one
(``log_softmax(logits / temperature)``, before the filters; greedy rows: the model's): the
policy an RL trainer recomputes for importance ratios when it samples at a temperature other
than 1 (``train/rl/step.py``). Forced tokens (thinking-budget close, ``forced >= 0``) replace the
sample and get their log-prob from the same distribution.

Banned tokens (``banned [B, K]`` ids per row, ``-1`` padding; ``tool_choice: "none"`` bans the
chat format's tool-call opener, ``docs/serving.md``) get logit ``-inf`` before everything else
on rows that are not forced: they are never sampled (greedy or not), and the returned log-probs
are those of the model distribution restricted to the allowed tokens (renormalised; a banned
token's probability is 0). A fixed ``K`` per engine keeps one compiled sampler.

Tested against a float64 NumPy transcription (``tests/test_sampling.py``): filtered log-probs
agree to 1e-5; kept sets are identical.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
SEED_LIMIT = 2**32  # seeds are uint32
TOP_K_LIMIT = 2**31  # top_k is int32


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What one request asks for. ``temperature=0`` is greedy; ``top_k=0``, ``top_p=1``,
    ``min_p=0`` switch the filters off; ``seed=None`` takes one from the engine.

    Ranges are those the sampler's arrays hold: ``seed`` in ``[0, 2**32)`` (uint32), ``top_k``
    in ``[0, 2**31)`` (int32; the engine clamps it to the vocabulary size, where it keeps
    every token, as 0 does)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    ignore_eos: bool = False
    tempered_logprobs: bool = False  # log-probs of softmax(logits / temperature) (RL rollouts)

    def __post_init__(self):
        bad = []
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 100):
            bad.append(f"temperature={self.temperature!r} (0..100)")
        if not (isinstance(self.top_k, int) and 0 <= self.top_k < TOP_K_LIMIT):
            bad.append(f"top_k={self.top_k!r} (int in [0, 2**31))")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad.append(f"top_p={self.top_p!r} (0 < top_p <= 1)")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            bad.append(f"min_p={self.min_p!r} (0..1)")
        if self.seed is not None and not (isinstance(self.seed, int) and
                                          0 <= self.seed < SEED_LIMIT):
            bad.append(f"seed={self.seed!r} (int in [0, 2**32))")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            bad.append(f"max_tokens={self.max_tokens!r} (int >= 1)")
        if not (isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20):
            bad.append(f"top_logprobs={self.top_logprobs!r} (0..20)")
        if not isinstance(self.ignore_eos, bool):
            bad.append(f"ignore_eos={self.ignore_eos!r} (true or false)")
        if not isinstance(self.tempered_logprobs, bool):
            bad.append(f"tempered_logprobs={self.tempered_logprobs!r} (true or false)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad.append(f"stop={self.stop!r} (non-empty strings)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad.append(f"stop_token_ids={self.stop_token_ids!r} (ids >= 0)")
        if bad:
            raise ValueError("invalid sampling parameters: " + "; ".join(bad))


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """logits [B, V] -> tempered logits with filtered-out tokens at -inf, [B, V] float32.

    temperature, top_p, min_p [B] float32; top_k [B] int32. Rows with temperature 0 are
    treated as temperature 1 here (the caller takes the argmax for them).
    """
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    x = x / t[:, None]                                                    # [B, V]
    desc = -jnp.sort(-x, axis=-1)                                         # [B, V] descending
    # top-k: threshold at the k-th largest value
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)  # [B, 1]
    kth = jnp.where(top_k[:, None] > 0, kth, NEG_INF)
    keep = x >= kth
    # top-p over the top-k survivors, in sorted order
    desc_k = jnp.where(desc >= kth, desc, NEG_INF)
    p_sorted = jax.nn.softmax(desc_k, axis=-1)                            # [B, V]
    mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)  # [B]
    p_thr = jnp.take_along_axis(desc_k, (n_keep - 1)[:, None], axis=-1)   # [B, 1]
    keep &= jnp.where(top_p[:, None] < 1.0, x >= p_thr, True)
    # min-p relative to the most likely token
    m_thr = desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    keep &= jnp.where(min_p[:, None] > 0, x >= m_thr, True)
    return jnp.where(keep, x, NEG_INF)


def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One key per row: ``fold_in(key(seed), counter)``; seeds, counters [B] -> keys [B]."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def ban_tokens(logits: jax.Array, banned: jax.Array, forced: jax.Array) -> jax.Array:
    """logits [B, V] float32, banned [B, K] int32 (ids, -1 = none), forced [B] int32 ->
    logits with each row's banned ids at -inf, except on forced rows (``forced >= 0``)."""
    b, v = logits.shape
    if banned.ndim != 2 or banned.shape[0] != b:
        raise ValueError(f"banned must be [B={b}, K] token ids, got shape {banned.shape}")
    ids = jnp.where((banned >= 0) & (forced[:, None] < 0), banned, v)   # [B, K]; v = dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    return logits.at[rows, ids].set(NEG_INF, mode="drop")


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seeds: jax.Array, counters: jax.Array, forced: jax.Array,
           banned: jax.Array | None = None, tempered: jax.Array | None = None, *,
           num_top: int = 0):
    """Choose one token per row and report model log-probs.

    logits [B, V]; per-row parameters [B]; ``seeds`` uint32 [B], ``counters`` int32 [B] (tokens
    sampled so far: the stream position); ``forced`` int32 [B] (>= 0 replaces the sample);
    ``banned`` int32 [B, K] (optional; ids never sampled, -1 padding); ``tempered`` bool [B]
    (optional; True: log-probs of the tempered distribution on rows with temperature > 0).
    Returns tokens [B] int32, logprobs [B] float32, top ids [B, num_top] int32 and top
    log-probs [B, num_top] float32 (model or tempered distribution, without the banned ids).
    """
    logits = logits.astype(jnp.float32)
    if banned is not None:
        logits = ban_tokens(logits, banned, forced)
    masked = filtered_logits(logits, temperature, top_k, top_p, min_p)
    keys = row_keys(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(keys, masked)               # [B]
    greedy = jnp.argmax(logits, axis=-1)
    tokens = jnp.where(temperature > 0, drawn, greedy)
    tokens = jnp.where(forced >= 0, forced, tokens).astype(jnp.int32)
    if tempered is not None:  # softmax(logits / T): the distribution sampled before filters
        t = jnp.where(tempered & (temperature > 0), temperature, 1.0)
        logits = logits / t[:, None]
    logp = jax.nn.log_softmax(logits, axis=-1)                            # [B, V]
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if num_top:
        top_lp, top_ids = jax.lax.top_k(logp, num_top)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp


sample_jit = jax.jit(sample, static_argnames=("num_top",))
