"""Rollouts from the generation engine: groups, multi-turn episodes, budgets, rewards, batches.

``run_episodes`` plays ``G`` episodes per task on the continuous-batching ``Engine`` (all
episodes of a turn are submitted together). An episode's token row is the rendered prompt
followed by each assistant turn as sampled (the chat format's stop token included) and, between
turns, the environment's messages rendered by the format (``continuation_ids``). Only sampled
tokens are trained on: ``mask`` is 1 on them and 0 on the prompt, the environment's tokens and
the tokens the thinking budget forced (the end-of-thinking marker); ``sampler_logp`` keeps the
engine's log-probs of the sampled tokens (for TIS and the mismatch metrics).

Budgets (``config.py``): ``reasoning_caps[effort]`` is the engine's reasoning cap;
``token_budgets[effort]`` bounds the episode's generated tokens (and ``seq_len`` the row); an
episode that runs out is truncated: the environment judges the output as it stands and the
score is that reward minus ``truncation_penalty``. ``group_rewards`` adds the
Kimi K1.5 group length penalty; ``varied_groups`` is DAPO's dynamic sampling (groups whose
verifiable rewards are all equal are dropped).
"""

from __future__ import annotations

import codecs
import dataclasses

import numpy as np

from kdsa.infer.budget import ThinkingBudget
from kdsa.infer.chat import AssistantOutput, Message
from kdsa.infer.engine import Engine, Request
from kdsa.infer.sampling import SamplingParams
from kdsa.model.vision.assemble import message_images, row_image_arrays
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.envs.base import Environment, Task


@dataclasses.dataclass
class Episode:
    task: Task
    effort: str
    tokens: list[int]
    mask: list[float]  # per token of ``tokens``: 1 where it was sampled
    sampler_logp: list[float]  # per token: the engine's log-prob where sampled, else 0
    prompt_len: int
    history: list[Message] = dataclasses.field(default_factory=list)
    score: float = 0.0  # the environment's reward (minus truncation_penalty if truncated)
    reward: float = 0.0  # score + length term
    done: bool = False
    truncated: bool = False
    generated: int = 0  # sampled + forced tokens over all turns
    reasoning_tokens: int = 0
    metrics: dict = dataclasses.field(default_factory=dict)
    texts: list[str] = dataclasses.field(default_factory=list)  # content per turn
    turns: int = 0  # assistant turns finished
    turn_tokens: list[int] = dataclasses.field(default_factory=list)  # a cut turn's tokens
    paused: bool = False  # cut by the step cap (partial rollouts), continued by a later play()
    born: int = 0  # RL step whose play() started it
    # routing replay: experts the engine used for tokens[:len(routing)] [n, L_moe, k] (the latest
    # turn's request re-ran the whole row, so its record covers every earlier token)
    routing: "np.ndarray | None" = None
    index: int | None = None  # position in the step's whole episode list (its sampling seed)


def render_prompt(fmt, task: Task, effort: str) -> list[int]:
    return fmt.render(list(task.messages), tools=list(task.tools), effort=effort)


def continuation_ids(fmt, task: Task, effort: str, history: list[Message],
                     new: list[Message]) -> list[int]:
    """Ids that follow the last assistant turn of ``history`` when ``new`` messages (tool
    results) are appended, up to the next generation prompt."""
    msgs = list(task.messages) + list(history)
    base = fmt.render(msgs, tools=list(task.tools), effort=effort, add_generation_prompt=False)
    full = fmt.render(msgs + list(new), tools=list(task.tools), effort=effort)
    if full[:len(base)] != base:
        raise ValueError(f"chat format {fmt.name!r}: rendering the conversation with the new "
                         f"messages changes its earlier part; cannot continue the episode")
    return full[len(base):]


def start_episodes(fmt, tasks: list[tuple[Task, str]], group_size: int) -> list[Episode]:
    """``group_size`` fresh episodes per ``(task, effort)``, consecutive."""
    eps = []
    for task, effort in tasks:
        prompt = render_prompt(fmt, task, effort)
        for _ in range(group_size):
            eps.append(Episode(task, effort, list(prompt), [0.0] * len(prompt),
                               [0.0] * len(prompt), len(prompt)))
    return eps


def run_episodes(engine: Engine, fmt, envs: dict[str, Environment],
                 tasks: list[tuple[Task, str]], *, group_size: int, rc: RLConfig,
                 seed: int, temperature: float | None = None) -> list[Episode]:
    """``group_size`` episodes per ``(task, effort)``, consecutive; returns them finished."""
    return play(engine, fmt, envs, start_episodes(fmt, tasks, group_size), rc=rc, seed=seed,
                temperature=temperature)


def play(engine: Engine, fmt, envs: dict[str, Environment], eps: list[Episode], *,
         rc: RLConfig, seed: int, step_cap: int | None = None,
         temperature: float | None = None) -> list[Episode]:
    """Advance every unfinished episode until it is done or, with ``step_cap`` (partial
    rollouts), has generated ``step_cap`` tokens in this call: then it is ``paused`` mid-turn
    and a later call continues it (its tokens and sampler log-probs kept). ``temperature``
    overrides ``rc.temperature`` (0: greedy). An episode's sampling seed comes from ``seed``, its
    ``index`` (default: its position in ``eps``) and its turn. Returns ``eps``."""
    order = {id(e): i for i, e in enumerate(eps)}
    used = {id(e): 0 for e in eps}  # tokens generated in this call
    for e in eps:
        e.paused = False
    temp = rc.temperature if temperature is None else temperature
    while True:
        active = [e for e in eps if not e.done and not e.paused]
        if not active:
            return eps
        reqs = []
        for e in active:
            room = min(rc.token_budgets[e.effort] - e.generated, rc.seq_len - len(e.tokens))
            if room < 1:
                _truncate(e, rc)
                continue
            calls = sum(len(m.tool_calls) for m in e.history)
            parser, budget, pre = fmt.parser(first_call_index=calls), None, ""
            in_reasoning, pending = True, b""
            if e.turn_tokens:  # continue a turn cut by an earlier call's step cap
                parser, budget, pre, pending = _resume_turn(engine, fmt, e, rc, calls)
                in_reasoning = budget.in_reasoning
                budget = budget if in_reasoning else None  # closed before the cut: none left
                room = min(rc.token_budgets[e.effort] - e.generated, rc.seq_len - len(e.tokens))
                if room < 1:
                    _truncate(e, rc)
                    continue
            n = room if step_cap is None else min(room, step_cap - used[id(e)])
            if n < 1:
                e.paused = True
                continue
            sp = SamplingParams(temperature=temp, max_tokens=n, tempered_logprobs=True,
                                seed=(seed * 7919 + (order[id(e)] if e.index is None else
                                                     e.index) * 131 + e.turns) % (2**31 - 1))
            reqs.append((e, n < room, pre, Request(
                list(e.tokens), sp, reasoning_cap=rc.reasoning_caps[e.effort],
                in_reasoning=in_reasoning, budget=budget, pending_utf8=pending, parser=parser,
                images=message_images(e.task.messages))))
        if not reqs:
            continue
        outs = engine.generate([r for *_, r in reqs])
        for (e, capped, pre, req), c in zip(reqs, outs):
            split = bool(e.turn_tokens) or (capped and c.finish_reason == "length")
            forced = set()  # the tokens the budget forced: the budget replayed over the turn
            if split or c.forced_close:  # (not a search for the whole marker: when the model
                # had sampled its first tokens, the budget forced only the rest)
                forced = {i - len(e.turn_tokens) for i in _budget_replay(
                    engine, fmt, rc.reasoning_caps[e.effort], e.turn_tokens + list(
                        c.token_ids))[0]}
            for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
                e.tokens.append(int(t))
                e.mask.append(0.0 if i in forced else 1.0)
                e.sampler_logp.append(0.0 if i in forced else float(lp))
            e.generated += len(c.token_ids)
            used[id(e)] += len(c.token_ids)
            if c.routing is not None:
                e.routing = c.routing
            # a continued budget counts the turn's earlier reasoning too
            e.reasoning_tokens += c.reasoning_tokens - (req.budget.reasoning_tokens
                                                        if req.budget else 0)
            if capped and c.finish_reason == "length":  # step cap hit: continue later
                e.turn_tokens += [int(t) for t in c.token_ids]
                e.paused = True
                continue
            out: AssistantOutput = c.output
            if e.turn_tokens:
                out = dataclasses.replace(out, content=pre + out.content)
                e.turn_tokens = []
            e.texts.append(out.content)
            env = envs[e.task.env]
            outcome = env.respond(e.task, out, tuple(e.history))
            e.history.append(out.as_message())
            for k, v in outcome.metrics.items():
                e.metrics[k] = float(v)
            e.turns += 1
            if c.finish_reason != "stop":  # over budget: judged as it stands, penalised
                _truncate(e, rc, float(outcome.reward))
                continue
            if outcome.done:
                e.score, e.done = float(outcome.reward), True
                continue
            if e.turns >= env.max_turns:
                e.score, e.done = 0.0, True
                continue
            more = continuation_ids(fmt, e.task, e.effort, e.history, list(outcome.messages))
            e.history.extend(outcome.messages)
            e.tokens += more
            e.mask += [0.0] * len(more)
            e.sampler_logp += [0.0] * len(more)
            if len(e.tokens) >= rc.seq_len:
                _truncate(e, rc)


def _budget_replay(engine: Engine, fmt, cap, tokens: list[int]):
    """Replay the engine's thinking budget (``infer/budget.py``) over one turn's tokens:
    ``(forced positions, ids still to force, budget, the bytes of a character the turn ends
    inside)``."""
    b = ThinkingBudget(cap=cap, grace=engine.budgets.grace,
                       end_marker=tuple(fmt.reasoning_end_ids),
                       after=tuple(fmt.after_reasoning_ids), in_reasoning=True,
                       exits=tuple(fmt.reasoning_exit_ids))
    queue, forced = list(b.start()), set()
    raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, t in enumerate(tokens):
        if queue:
            if queue[0] != t:
                raise ValueError(f"budget replay: token {i} is {t}, the engine forced "
                                 f"{queue[0]}")
            queue.pop(0)
            forced.add(i)
        piece = "" if engine.tok.is_special(t) else raw.decode(engine.tok.token_bytes(t))
        queue += b.observe(t, piece, partial=bool(raw.getstate()[0]))  # as the engine does
    return forced, queue, b, raw.getstate()[0]


def _resume_turn(engine: Engine, fmt, e: Episode, rc: RLConfig, calls: int):
    """State to continue ``e``'s cut turn: ids the budget still had to force are appended (as
    forced tokens); returns ``(parser fed with the turn so far, the turn's thinking budget
    replayed over it, content so far, the bytes of a character the turn ends inside)``. With
    both, the engine goes on as in the uncut turn: a cut inside the grace window keeps waiting
    for a sentence boundary, one completed after the cut included."""
    cap = rc.reasoning_caps[e.effort]
    _, queue, b, pending = _budget_replay(engine, fmt, cap, e.turn_tokens)
    if queue:
        e.tokens += queue
        e.turn_tokens += queue
        e.mask += [0.0] * len(queue)
        e.sampler_logp += [0.0] * len(queue)
        e.generated += len(queue)
        _, _, b, pending = _budget_replay(engine, fmt, cap, e.turn_tokens)
    parser = fmt.parser(first_call_index=calls)
    pre = "".join(v for t in e.turn_tokens for k, v in parser.feed(t) if k == "content")
    return parser, b, pre, pending


def _truncate(e: Episode, rc: RLConfig, judged: float = 0.0) -> None:
    """Over budget: ``score = reward of the output as it stands - truncation_penalty``."""
    e.truncated, e.done, e.score = True, True, judged - rc.truncation_penalty
    del e.tokens[rc.seq_len:], e.mask[rc.seq_len:], e.sampler_logp[rc.seq_len:]


def group_rewards(eps: list[Episode], group_size: int, rc: RLConfig) -> None:
    """Set ``reward = score + w[effort] * length term`` (Kimi K1.5, per group); ``correct`` is
    ``score >= 1``, lengths are generated tokens."""
    for g in range(0, len(eps), group_size):
        grp = eps[g:g + group_size]
        lens = np.array([e.generated for e in grp], np.float64)
        lo, hi = lens.min(), lens.max()
        for e, n in zip(grp, lens):
            lam = 0.5 - (n - lo) / (hi - lo) if hi > lo else 0.0
            w = rc.length_penalty[e.effort]
            e.reward = e.score + w * (lam if e.score >= 1.0 else min(0.0, lam))


def varied_groups(eps: list[Episode], group_size: int) -> list[list[Episode]]:
    """Groups (in order) whose verifiable rewards (``score``: environment reward and
    truncation) are not all equal (DAPO dynamic sampling). A group that differs only by the
    length term is dropped too: with std-normalised advantages its small length differences
    would become full-size updates toward shorter answers, right or wrong (measured: the demo
    collapsed to empty answers)."""
    out = []
    for g in range(0, len(eps), group_size):
        grp = eps[g:g + group_size]
        if max(e.score for e in grp) > min(e.score for e in grp):
            out.append(grp)
    return out


def training_batch(groups: list[list[Episode]], rows: int, seq_len: int, group_size: int,
                   rc: RLConfig, routing_dims: tuple[int, int] | None = None
                   ) -> dict[str, np.ndarray]:
    """Fixed-shape arrays ``[rows, seq_len]`` (next-token layout) from whole groups; rows past
    the groups are padding (mask 0, advantage 0, ``segment_ids`` 0: the MoE's expert load and
    so the routing-bias update count real tokens only). Advantages are group-relative (GRPO
    ``(r - mean) / (std + 1e-6)``, or ``r - mean`` for Dr.GRPO and Kimi, and for a group whose
    verifiable scores are all equal).

    ``routing_dims = (L_moe, k)`` (routing replay): also ``expert_ids [rows, seq_len, L_moe, k]``, the
    experts the engine used for each input token, -1 where there is no record (the router
    then chooses)."""
    b = {"inputs": np.zeros((rows, seq_len), np.int32),
         "targets": np.zeros((rows, seq_len), np.int32),
         "loss_mask": np.zeros((rows, seq_len), np.float32),
         "sampler_logp": np.zeros((rows, seq_len), np.float32),
         "advantages": np.zeros((rows,), np.float32),
         "segment_ids": np.zeros((rows, seq_len), np.int32)}  # 1: a token, 0: padding
    if routing_dims is not None:
        b["expert_ids"] = no_routing(rows, seq_len, routing_dims)
    r, row_images = 0, []
    for grp in groups:
        if r + len(grp) > rows:
            break
        rew = np.array([e.reward for e in grp], np.float64)
        adv = rew - rew.mean()
        # std-normalised only when the verifiable scores differ: a group that differs by the
        # length term alone (dynamic_sampling off) keeps its small differences small, as in
        # varied_groups (normalised, they became full-size pushes toward shorter answers)
        scores = [e.score for e in grp]
        if rc.normalize_std and rc.loss != "kimi" and max(scores) > min(scores):
            adv = adv / (rew.std() + 1e-6)
        for e, a in zip(grp, adv):
            n = min(len(e.tokens) - 1, seq_len)
            b["inputs"][r, :n] = e.tokens[:n]
            b["targets"][r, :n] = e.tokens[1:n + 1]
            b["loss_mask"][r, :n] = e.mask[1:n + 1]
            b["segment_ids"][r, :n] = 1
            b["sampler_logp"][r, :n] = e.sampler_logp[1:n + 1]
            b["advantages"][r] = a
            if routing_dims is not None and e.routing is not None:
                k = min(n, len(e.routing))
                b["expert_ids"][r, :k] = e.routing[:k]
            row_images.append(message_images(e.task.messages))
            r += 1
    return b | row_image_arrays(row_images, rows)  # image prompts: image_* arrays per row


def no_routing(rows: int, seq_len: int, routing_dims: tuple[int, int]) -> np.ndarray:
    """``expert_ids [rows, seq_len, L_moe, k]`` all -1: every token routed by the router."""
    return np.full((rows, seq_len) + tuple(routing_dims), -1, np.int32)


def sample_tasks(envs: dict[str, Environment], weights: dict[str, float], n: int, *,
                 rc: RLConfig, rng: np.random.Generator, start_index: int,
                 split: str = "train") -> list[tuple[Task, str]]:
    """``n`` (task, effort) pairs: the domain drawn by ``weights``, the effort by
    ``rc.effort_weights``; task indices ``start_index + i`` (the caller's counter)."""
    names = list(envs)
    p = np.array([weights[k] for k in names], np.float64)
    levels = list(rc.effort_weights)
    q = np.array([rc.effort_weights[k] for k in levels], np.float64)
    out = []
    for i in range(n):
        env = envs[names[rng.choice(len(names), p=p / p.sum())]]
        effort = levels[rng.choice(len(levels), p=q / q.sum())]
        out.append((env.task(start_index + i, split), effort))
    return out


def domain_metrics(eps: list[Episode]) -> dict[str, float]:
    """Means per domain: ``reward/D``, ``score/D``, every outcome metric ``M/D``; per effort
    level: ``effort_score/low``, lengths ``gen_tokens/low``, ``reasoning_tokens/low`` ..."""
    acc: dict[str, list[float]] = {}
    for e in eps:
        d = e.task.env
        acc.setdefault(f"reward/{d}", []).append(e.reward)
        acc.setdefault(f"score/{d}", []).append(e.score)
        for k, v in e.metrics.items():
            acc.setdefault(f"{k}/{d}", []).append(v)
        acc.setdefault(f"effort_score/{e.effort}", []).append(e.score)
        acc.setdefault(f"gen_tokens/{e.effort}", []).append(e.generated)
        acc.setdefault(f"reasoning_tokens/{e.effort}", []).append(e.reasoning_tokens)
    out = {k: float(np.mean(v)) for k, v in acc.items()}
    # no finished episode (partial rollouts cut every group): no value, not a reward of 0
    # (metrics.jsonl writes null; the reward curve leaves a gap)
    for key, attr in (("reward", "reward"), ("score", "score"), ("truncated_frac", "truncated"),
                      ("gen_tokens", "generated")):
        out[key] = float(np.mean([getattr(e, attr) for e in eps])) if eps else float("nan")
    return out
