"""Partial rollouts (Kimi K1.5): an episode cut by the per-step token cap and continued in later
steps is the episode generated in one go (tokens, trained-token mask, sampler log-probs, answer,
budget forcing), and the loop carries unfinished groups for at most ``max_staleness`` steps.
Driven by a scripted stand-in for the model whose next token is a function of the sequence
alone (as a model's is), so no model is compiled."""

import pytest

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import Message, get_format
from kdsa.infer.engine import Engine
from scripted import ScriptedRunner
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.train.config import TrainConfig
from kdsa.train.rl import rollout as ro
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.envs import Environment, Outcome, Task
from kdsa.train.rl.loop import _rl_iteration


class _SequenceScript(ScriptedRunner):
    """``ScriptedRunner`` whose script restarts at the *last* generation prompt of everything
    the slot has seen (not at the end of the submitted prompt), so a continued request picks
    up where the cut one stopped, as a model would."""

    def prefill(self, slot, tokens, start=0):
        super().prefill(slot, tokens, start)
        s, n = self.seen[slot], len(self.think_prompt)
        ends = [i + n for i in range(len(s) - n + 1) if s[i:i + n] == self.think_prompt]
        if ends:
            self.prompt_len[slot], self.thinking[slot] = ends[-1], True
        return self._logits([slot])


class _Yes(Environment):
    def __init__(self, seed=0):
        super().__init__(seed=seed)
        self.domain = "test_yes"

    def task(self, index, split="train"):
        return Task(self.domain, index, (Message("user", f"Question {index}?"),))

    def respond(self, task, output, history):
        return Outcome(float(output.content == "Yes it is."))


@pytest.fixture(scope="module", params=[0, 1], ids=["grace-0", "grace-1"])
def setup(request):
    tok = ByteTokenizer(384, flavor="k2")
    fmt = get_format("k2", tok)
    answer = tok.encode("Yes it is.") + [fmt.stop_ids[0]]
    # caps: low 0 (closed at once, forced), high 3 (forced mid-reasoning: at once without a
    # grace window; with a token of grace and no sentence boundary in "Hmm,", after 4, one
    # before the script's own close, so a cut after 3 tokens lands inside the window), max 16
    # (the script's own close after 5 reasoning tokens)
    rc = RLConfig(envs=("rg:basic_arithmetic",), seq_len=200, group_size=2,
                  reasoning_caps={"low": 0, "high": 3, "max": 16},
                  token_budgets={"low": 60, "high": 60, "max": 60})
    runner = _SequenceScript(tok, fmt, answer_ids=answer, reasoning_tokens=5, num_slots=8,
                             max_len=rc.seq_len + 1)
    engine = Engine(runner, tok, chat_format=fmt,
                    budgets=BudgetConfig(caps=dict(rc.reasoning_caps), grace=request.param),
                    seed=0)
    env = _Yes(seed=0)
    return fmt, engine, rc, {env.domain: env}, env


def _fields(e):
    return (e.tokens, e.mask, e.sampler_logp, e.texts, e.score, e.truncated, e.generated,
            e.reasoning_tokens)


@pytest.mark.parametrize("cap", [1, 2, 3, 5, 8])
def test_episode_split_across_steps_equals_one_go(setup, cap):
    fmt, engine, rc, envs, env = setup
    tasks = [(env.task(i), effort) for i, effort in enumerate(("low", "high", "max"))]
    whole = ro.play(engine, fmt, envs, ro.start_episodes(fmt, tasks, 1), rc=rc, seed=0,
                    temperature=0.0)
    assert all(e.done and e.score == 1.0 for e in whole), [e.texts for e in whole]
    eps, calls = ro.start_episodes(fmt, tasks, 1), 0
    while not all(e.done for e in eps):
        ro.play(engine, fmt, envs, eps, rc=rc, seed=calls, step_cap=cap, temperature=0.0)
        calls += 1
        assert all(e.done or e.paused for e in eps)
    assert calls == max(-(-e.generated // cap) for e in whole)  # ceil(tokens / cap) steps
    for a, b in zip(whole, eps):
        assert _fields(a) == _fields(b)
    forced = [t for t, m, i in zip(eps[1].tokens, eps[1].mask, range(len(eps[1].tokens)))
              if not m and i >= eps[1].prompt_len]
    assert forced == list(fmt.reasoning_end_ids)  # the forced close is not trained on
    assert whole[1].reasoning_tokens == 3 + engine.budgets.grace  # no boundary in "Hmm, "


def _one_high_effort_episode(tok, fmt, caps, grace, **script):
    """``(rc, engine, envs, tasks, episodes)``: one "high" episode played in one go, greedy,
    by a ``_SequenceScript`` with ``script``'s options."""
    rc = RLConfig(envs=("rg:basic_arithmetic",), seq_len=200, group_size=2,
                  reasoning_caps=caps, token_budgets={"low": 60, "high": 60, "max": 60})
    runner = _SequenceScript(tok, fmt, num_slots=8, max_len=rc.seq_len + 1, **script)
    engine = Engine(runner, tok, chat_format=fmt, budgets=BudgetConfig(caps=caps, grace=grace),
                    seed=0)
    env = _Yes(seed=0)
    envs, tasks = {env.domain: env}, [(env.task(0), "high")]
    whole = ro.play(engine, fmt, envs, ro.start_episodes(fmt, tasks, 1), rc=rc, seed=0,
                    temperature=0.0)
    return rc, engine, envs, tasks, whole


def test_a_cut_inside_a_boundary_character_continues_as_one_go():
    """Reasoning "ab。cd..." (byte tokens: "。" is three) under a cap of 2 with 4 tokens of
    grace: the uncut turn's close is forced right after "。", a sentence boundary (5 reasoning
    tokens). Cut after the character's first or second byte, the continued turn's text decoder
    holds them (``Request.pending_utf8``), so "。" completes there as well (a fresh decoder read
    the rest as U+FFFD, no boundary: the turn reasoned on, and the replay over the whole turn
    found a sampled token where the close was due)."""
    tok = ByteTokenizer(384, flavor="k2")
    fmt = get_format("k2", tok)
    answer = tok.encode("Yes it is.") + [fmt.stop_ids[0]]
    caps = {"low": 0, "high": 2, "max": 16}
    rc, engine, envs, tasks, whole = _one_high_effort_episode(
        tok, fmt, caps, 4, answer_ids=answer, reasoning="ab\u3002cdefgh")
    assert whole[0].done and whole[0].score == 1.0 and whole[0].reasoning_tokens == 5
    for cap in (3, 4):  # cut after the first, the second byte of the character
        eps, calls = ro.start_episodes(fmt, tasks, 1), 0
        while not eps[0].done:
            ro.play(engine, fmt, envs, eps, rc=rc, seed=calls, step_cap=cap, temperature=0.0)
            calls += 1
        assert _fields(eps[0]) == _fields(whole[0]), cap


def test_a_close_the_model_began_masks_only_the_tokens_the_budget_forced():
    """xtml's end-of-thinking marker is several tokens. A model that samples the marker's first
    token on the token that reaches the cap gets only the rest forced (``ThinkingBudget``):
    its own first token stays a trained token with its sampler log-prob (the rollout searched
    for the whole marker and masked the sampled token too), in one go and cut by a step cap."""
    from scripted import _answer

    tok = ByteTokenizer(384)
    fmt = get_format("xtml", tok)
    close, opener = list(fmt.reasoning_end_ids), list(fmt.after_reasoning_ids)
    assert len(close) > 1
    caps = {"low": 0, "high": 5, "max": 16}  # the script's 4 reasoning tokens, then its close
    rc, engine, envs, tasks, whole = _one_high_effort_episode(
        tok, fmt, caps, 0, answer_ids=_answer("Yes it is.", fmt=fmt), reasoning_tokens=4)
    e = whole[0]
    assert e.done and e.score == 1.0, e.texts
    gen = e.tokens[e.prompt_len:]
    mask, logp = e.mask[e.prompt_len:], e.sampler_logp[e.prompt_len:]
    assert gen[4:4 + len(close) + len(opener)] == close + opener
    assert mask[:5] == [1.0] * 5 and logp[4] != 0.0  # the model's own first marker token
    assert mask[5:4 + len(close) + len(opener)] == [0.0] * (len(close) + len(opener) - 1)
    eps, calls = ro.start_episodes(fmt, tasks, 1), 0
    while not eps[0].done:  # cut after 3 tokens: the replay over the turn agrees
        ro.play(engine, fmt, envs, eps, rc=rc, seed=calls, step_cap=3, temperature=0.0)
        calls += 1
    assert _fields(eps[0]) == _fields(e)


class _Sampler:
    """The loop's generation side without weights."""

    def __init__(self, engine, fmt):
        self.engine, self.fmt = engine, fmt

    def sync(self, graphdef, state):
        return 0.0


def test_loop_carries_partial_groups_up_to_max_staleness(setup):
    fmt, engine, rc, envs, env = setup
    sampler = _Sampler(engine, fmt)
    tc = TrainConfig(steps=10, warmup_steps=0, seed=0)
    base = rc.replace(prompts_per_step=2, group_size=2, max_sampling_rounds=1,
                      dynamic_sampling=False, partial_rollout_tokens=4,
                      effort_weights={"low": 0.0, "high": 0.0, "max": 1.0})
    # an episode here is 5 reasoning + 1 close + 11 answer = 17 tokens: 5 steps of 4

    def run(rc, steps):
        pending, counter, out = [], 0, []
        for step in range(steps):
            m, counter = _rl_iteration(sampler, envs, {env.domain: 1.0}, None, None, rc,
                                       tc, step, counter, rc.rollouts_per_step, pending)
            out.append((m["sampled_groups"], m["pending_groups"], m["stale_dropped_groups"],
                        float(m["_batch"]["loss_mask"].sum())))
        return out

    # staleness 1: a group started at step s may be continued at s + 1 only, then dropped
    got = run(base.replace(max_staleness=1), 3)
    assert [g[:3] for g in got] == [(0, 2, 0), (0, 2, 2), (0, 2, 2)]
    # staleness 4: groups started at step s finish at step s + 4 (ceil(17 / 4) = 5 pieces)
    got = run(base.replace(max_staleness=4), 6)
    assert [g[0] for g in got] == [0, 0, 0, 0, 2, 2]
    assert [g[1] for g in got] == [2, 4, 6, 8, 8, 8]
    assert got[4][3] > 0 and got[3][3] == 0  # finished groups are trained on


def test_finished_groups_past_the_batch_wait_for_the_next_step(setup):
    """Efforts of different lengths (low: 12 tokens, 3 pieces of 4; max: 17 tokens, 5 pieces)
    make carried groups finish beside new ones, more than ``prompts_per_step`` in a step: the
    surplus leads the next step's batch (it was thrown away). Every group started is trained
    on, waiting or dropped as stale."""
    fmt, engine, rc, envs, env = setup
    sampler = _Sampler(engine, fmt)
    tc = TrainConfig(steps=10, warmup_steps=0, seed=0)
    rc = rc.replace(prompts_per_step=2, group_size=2, max_sampling_rounds=1,
                    dynamic_sampling=False, partial_rollout_tokens=4, max_staleness=4,
                    effort_weights={"low": 1.0, "high": 0.0, "max": 1.0})
    pending, counter, rows = [], 0, []
    for step in range(8):
        m, counter = _rl_iteration(sampler, envs, {env.domain: 1.0}, None, None, rc, tc,
                                   step, counter, rc.rollouts_per_step, pending)
        rows.append((m["sampled_groups"], m["kept_groups"], m["stale_dropped_groups"]))
    assert max(r[0] for r in rows) > rc.prompts_per_step, rows  # a step with a surplus
    trained, dropped = sum(r[1] for r in rows), sum(r[2] for r in rows)
    assert trained + dropped + len(pending) == 8 * rc.prompts_per_step, (rows, len(pending))
    assert dropped == 0, rows


def test_a_step_without_finished_episodes_reports_no_reward():
    """Partial rollouts can cut every group of a step: its reward is missing (NaN; null in
    metrics.jsonl), not 0.0, which drew a false zero on the reward curve."""
    import math

    from kdsa.train.rl.rollout import domain_metrics

    m = domain_metrics([])
    assert all(math.isnan(m[k]) for k in ("reward", "score", "truncated_frac", "gen_tokens"))
