"""What quantization changed: a reference model against a candidate on the user's own prompts.

``kdsa quant-check`` (``cli/quant_check_cmd.py``) runs the two models one after the other (peak
memory of one model), each on the ``generate`` layout:

1. the reference A: greedy generation of every prompt (``kdsa generate`` format, temperature 0),
   then A teacher-forced on its own sequences (prompt + generated tokens), keeping per token
   the top ``top_k`` log-probs, the log-mass of the rest, its argmax and the log-prob of the
   generated token;
2. the candidate B: greedy generation of the same prompts, then B teacher-forced on A's
   sequences.

Per generated token of A (:func:`token_stats`): ``KL(A || B)`` over the vocabulary coarsened to
A's top-k plus one "rest" bucket (exact when ``top_k`` >= the vocabulary; otherwise a lower bound
of the full KL, by the data-processing inequality), top-1 agreement (B's argmax equals A's),
and the log-prob of A's token under each. Tokens are split by where they are
(:func:`token_categories`, from the engine's own parse of the output): ``reasoning``,
``answer``, ``tool_name``, ``tool_args``, ``other`` (markers), plus ``digits`` (any token
whose text holds a digit). Per prompt, from the two greedy outputs: final answer exact match,
tool-call names and JSON-equal arguments, the first position where the token streams differ,
reasoning tokens per effort level.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from kdsa.infer.jsonl import read_records
from kdsa.infer.sampling import SamplingParams

CATEGORIES = ("reasoning", "answer", "tool_name", "tool_args", "other", "digits")


# ----------------------------------------------------------------------------- per token

def token_categories(tok, token_ids: list[int], deltas: list[list[tuple[str, object]]]
                     ) -> list[str]:
    """The part of the output each generated token belongs to, from the engine's events
    (``deltas[i]``: what token ``i`` added). Tokens without an event up to a ``tool_call``
    event form that call: those whose text overlaps the call's name are ``tool_name``, the rest
    ``tool_args``. Tokens with no event outside a call are ``other``."""
    cats: list[str | None] = [None] * len(token_ids)
    pending: list[int] = []
    for i, ds in enumerate(deltas):
        kinds = [k for k, _ in ds]
        if "tool_call" in kinds:
            call = next(v for k, v in ds if k == "tool_call")
            span = pending + [i]
            texts = [tok.decode([token_ids[j]]) for j in span]
            joined = "".join(texts)
            start = joined.find(call.name) if call.name else -1
            pos = 0
            for j, text in zip(span, texts):
                hit = start >= 0 and pos < start + len(call.name) and pos + len(text) > start
                cats[j] = "tool_name" if hit else "tool_args"
                pos += len(text)
            pending = []
        elif "reasoning" in kinds:
            cats[i] = "reasoning"
        elif "content" in kinds or "text" in kinds:
            cats[i] = "answer"
        else:
            pending.append(i)
    return [c or "other" for c in cats]


def has_digit(tok, token_id: int) -> bool:
    return any(ch.isdigit() for ch in tok.decode([token_id]))


def forced_log_probs(forward, prompt: list[int], generated: list[int],
                     length: int | None = None) -> jax.Array:
    """``[G, V]`` float32 log-probs of the model at each generated position (teacher-forced on
    ``prompt + generated``, zero-padded to ``length``: one compiled shape for every prompt);
    ``forward(ids [1, T]) -> logits [1, T, V]``. Causal, so the padding changes nothing."""
    seq = prompt + generated
    n = len(seq)
    ids = np.zeros((1, max(length or n, n)), np.int32)
    ids[0, :n] = seq
    logits = forward(jnp.asarray(ids))[0, :n - 1]                       # predicts ids[1:n]
    return jax.nn.log_softmax(logits[len(prompt) - 1:].astype(jnp.float32), axis=-1)


@dataclasses.dataclass
class ReferenceTokens:
    """A's teacher-forced view of one sequence (host arrays, ``G`` generated tokens)."""
    top_ids: np.ndarray  # [G, K] int32
    top_logp: np.ndarray  # [G, K] float32
    rest_logp: np.ndarray  # [G] float64: log of the probability outside the top-k, as
    # token_stats computes B's from the same top-k (rounded to float32 it left a KL of up to
    # 1e-8 between identical distributions)
    argmax: np.ndarray  # [G] int32
    token_logp: np.ndarray  # [G] float32: log-prob of the generated token


_TINY = 1e-30  # floor of a "rest" probability: rounding can leave 1 - sum(top-k) <= 0


def _log_rest(top_logp: np.ndarray) -> np.ndarray:
    """log(1 - sum(exp(top_logp))) per row, floored at log(_TINY)."""
    return np.log(np.maximum(-np.expm1(np.logaddexp.reduce(top_logp, axis=-1)), _TINY))


def reference_tokens(logp: jax.Array, generated: list[int], top_k: int) -> ReferenceTokens:
    k = min(top_k, logp.shape[-1])
    top_logp, top_ids = jax.lax.top_k(logp, k)
    lp, ids = np.asarray(top_logp, np.float64), np.asarray(top_ids, np.int32)
    gen = np.asarray(generated, np.int32)
    rest = (np.full(len(gen), -np.inf) if k == logp.shape[-1]  # every token kept: no rest
            else _log_rest(lp))
    return ReferenceTokens(top_ids=ids, top_logp=lp.astype(np.float32),
                           rest_logp=rest,
                           argmax=np.asarray(jnp.argmax(logp, -1), np.int32),
                           token_logp=np.asarray(logp)[np.arange(len(gen)), gen])


def token_stats(ref: ReferenceTokens, cand_logp: jax.Array, generated: list[int]) -> dict:
    """Per token: ``kl`` (A || B on A's top-k + rest), ``agree`` (argmax equal), ``logp_ref``,
    ``logp_cand`` (of the generated token), as float64 host arrays ``[G]``."""
    b = np.asarray(cand_logp, np.float64)                               # [G, V]
    b_top = np.take_along_axis(b, ref.top_ids, axis=-1)                 # [G, K]
    a_top = ref.top_logp.astype(np.float64)
    kl = np.sum(np.exp(a_top) * (a_top - b_top), axis=-1)
    rest = ref.rest_logp
    tail = np.zeros_like(kl)
    coarse = np.isfinite(rest)  # the top-k did not cover the vocabulary
    if coarse.any():
        b_rest = _log_rest(b_top)
        tail = np.where(coarse, np.exp(rest) * (rest - b_rest), 0.0)
    gen = np.asarray(generated, np.int64)
    return {"kl": np.maximum(kl + tail, 0.0),
            "agree": (np.argmax(b, -1) == ref.argmax).astype(np.float64),
            "logp_ref": ref.token_logp.astype(np.float64),
            "logp_cand": b[np.arange(len(gen)), gen]}


# ----------------------------------------------------------------------------- per prompt

def _calls(output) -> list[tuple[str, object]]:
    out = []
    for c in (output.tool_calls if output is not None else ()):
        try:
            args = json.loads(c.arguments)
        except (TypeError, json.JSONDecodeError):
            args = c.arguments
        out.append((c.name, args))
    return out


def compare_outputs(a, b) -> dict:
    """Two greedy completions of one prompt: answer exact match, tool-call names and JSON-equal
    arguments, the first differing token position (None when identical), reasoning tokens."""
    div = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    if div is None and len(a.token_ids) != len(b.token_ids):
        div = min(len(a.token_ids), len(b.token_ids))
    ca, cb = _calls(a.output), _calls(b.output)
    return {"answer_match": (a.text or "").strip() == (b.text or "").strip(),
            "tool_names_match": [n for n, _ in ca] == [n for n, _ in cb],
            "tool_args_match": ca == cb, "first_divergence": div,
            "reasoning_tokens": [a.reasoning_tokens, b.reasoning_tokens],
            "tokens": [len(a.token_ids), len(b.token_ids)]}


# ----------------------------------------------------------------------------- summary

def _tails(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"n": 0}
    return {"n": int(x.size), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p95": float(np.percentile(x, 95)), "max": float(x.max())}


def summarize(per_prompt: list[dict], worst: int = 5) -> dict:
    """Means and tails over all teacher-forced tokens and per category; greedy-output rates;
    reasoning length per effort; the ``worst`` prompts by mean KL."""
    def cat(name, key):  # (a prompt that generated nothing has empty float lists: bool mask)
        return np.concatenate([np.zeros(0)] + [
            np.asarray(p["tokens"][key], np.float64)[np.asarray(p["tokens"][name], bool)]
            for p in per_prompt])

    allk = np.concatenate([np.zeros(0)] + [np.asarray(p["tokens"]["kl"]) for p in per_prompt])
    alla = np.concatenate([np.zeros(0)] + [np.asarray(p["tokens"]["agree"])
                                          for p in per_prompt])
    out = {"prompts": len(per_prompt), "tokens": int(allk.size),
           "kl_mean": float(allk.mean()) if allk.size else 0.0,
           "top1_agreement": float(alla.mean()) if alla.size else 1.0,
           "kl": _tails(allk), "by_category": {}}
    for c in CATEGORIES:
        k, a = cat(f"is_{c}", "kl"), cat(f"is_{c}", "agree")
        out["by_category"][c] = {"kl": _tails(k),
                                 "top1_agreement": float(a.mean()) if a.size else None}
    greedy = [p["greedy"] for p in per_prompt]
    for key in ("answer_match", "tool_names_match", "tool_args_match"):
        out[key] = float(np.mean([g[key] for g in greedy])) if greedy else None
    out["identical_outputs"] = float(np.mean([g["first_divergence"] is None for g in greedy]))
    efforts: dict[str, list] = {}
    for p in per_prompt:
        efforts.setdefault(p["effort"] or "none", []).append(p["greedy"]["reasoning_tokens"])
    out["reasoning_tokens_by_effort"] = {
        e: {"reference": float(np.mean([r[0] for r in v])),
            "candidate": float(np.mean([r[1] for r in v]))} for e, v in efforts.items()}
    ranked = sorted(per_prompt, key=lambda p: -p["kl_mean"])
    out["worst_prompts"] = [{"id": p["id"], "kl_mean": p["kl_mean"],
                             "first_divergence": p["greedy"]["first_divergence"]}
                            for p in ranked[:worst]]
    return out


def prompt_record(rid: str, effort, comp_a, comp_b, cats: list[str], digits: list[bool],
                  stats: dict) -> dict:
    tokens = {k: [float(x) for x in v] for k, v in stats.items()}
    for c in CATEGORIES[:-1]:
        tokens[f"is_{c}"] = [x == c for x in cats]
    tokens["is_digits"] = list(digits)
    return {"id": rid, "effort": effort, "greedy": compare_outputs(comp_a, comp_b),
            "prompt_tokens": comp_a.prompt_tokens, "token_ids": list(comp_a.token_ids),
            "tokens": tokens,
            "kl_mean": float(np.mean(stats["kl"])) if len(stats["kl"]) else 0.0}


# ----------------------------------------------------------------------------- the job

def with_mxfp4_experts(config, model, shardings=None):
    """``(config, model)`` with the routed experts quantized to MXFP4 (the "even" scale rule,
    as ``kdsa convert --experts mxfp4``); other weights are kept. ``shardings``: a
    ``state -> shardings`` function (``sharding.rules.layout_shardings``) for the result."""
    from flax import nnx

    from kdsa.model import checkpoint as ckpt
    from kdsa.model.moe_mxfp4 import pack_expert_arrays

    if not config.num_experts or config.expert_weight_format == "mxfp4":
        raise ValueError("--candidate-experts mxfp4 needs a reference with bf16 routed experts")
    out = config.replace(expert_weight_format="mxfp4")
    graphdef, state = nnx.split(ckpt.abstract_model(out))
    flat = {k: v[...] for k, v in ckpt.flat_variables(nnx.state(model)).items()}

    def build(flat):
        packed = pack_expert_arrays(flat)
        return nnx.from_flat_state([(p, v.replace(packed[ckpt.flat_key(p)]))
                                    for p, v in nnx.to_flat_state(state)])

    target = None if shardings is None else shardings(state)
    return out, nnx.merge(graphdef, jax.jit(build, out_shardings=target)(flat))


def _forward(model, mesh, layout: str):
    from flax import nnx

    fwd = nnx.jit(lambda m, ids: m(ids))
    if mesh is None:
        return lambda ids: fwd(model, ids)
    from kdsa.sharding.constrain import use_sharding

    def run(ids):
        with use_sharding(mesh, layout):
            return fwd(model, ids)
    return run


def greedy(requests: list, max_tokens: int) -> list:
    """The requests as quant-check runs them: greedy, ``max_tokens`` each, no stop strings, a
    line's own sampling fields (``kdsa generate``'s format allows them) set aside: with a
    temperature both models sampled, and equal seeds made their answers look alike."""
    for r in requests:
        r.sampling = dataclasses.replace(
            SamplingParams(), max_tokens=max_tokens, temperature=0.0,
            stop_token_ids=r.sampling.stop_token_ids, top_logprobs=r.sampling.top_logprobs)
    return requests


def _generate(load, prompts_path, engine_kw: dict, effort, max_tokens: int, log):
    """Load one model, greedy-generate every prompt; ``(model, requests, completions, deltas,
    engine)``."""
    from kdsa.infer.generate import build_engine, read_requests

    config, model = load()
    engine, fmt = build_engine(model, **engine_kw)
    reqs = greedy(read_requests(prompts_path, engine, fmt, effort=effort, seed=0,
                                defaults={"max_tokens": max_tokens, "temperature": 0.0}),
                  max_tokens)
    deltas: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        if r.images:
            raise ValueError(f"{prompts_path}: request {r.request_id} has images; "
                             f"quant-check compares text prompts only")
        r.on_event = (lambda ev, d=deltas[r.request_id]:
                      d.append(ev.deltas) if ev.token_id is not None else None)
    log(f"quant-check: generating {len(reqs)} prompts (greedy, up to {max_tokens} tokens)")
    comps = engine.generate(reqs)
    return model, reqs, comps, deltas, engine


def run_quant_check(load_reference, load_candidate, prompts_path, *, engine_kw: dict,
                    effort: str | None = None, max_tokens: int = 256, top_k: int = 1024,
                    mesh=None, layout: str = "generate", log=print) -> dict:
    """The report (module docstring). ``load_reference()`` / ``load_candidate()`` return
    ``(config, model)``; the candidate is loaded only after the reference is released."""
    import gc

    model, reqs, comps_a, deltas, engine = _generate(load_reference, prompts_path, engine_kw,
                                                     effort, max_tokens, log)
    tok = engine.tok
    fwd = _forward(model, mesh, layout)
    seqs = {r.request_id: (list(r.prompt), c.token_ids) for r, c in zip(reqs, comps_a)}
    length = -(-max(len(p) + len(g) for p, g in seqs.values()) // 64) * 64
    refs = {rid: reference_tokens(forced_log_probs(fwd, p, g, length), g, top_k)
            for rid, (p, g) in seqs.items() if g}
    efforts = _efforts(prompts_path, effort)
    del model, engine, fwd
    gc.collect()
    log("quant-check: reference done; loading the candidate")
    model, _, comps_b, _, engine = _generate(load_candidate, prompts_path, engine_kw, effort,
                                             max_tokens, log)
    fwd = _forward(model, mesh, layout)
    records = []
    for ca, cb in zip(comps_a, comps_b):
        rid = ca.request_id
        prompt, gen = seqs[rid]
        if gen:
            stats = token_stats(refs[rid], forced_log_probs(fwd, prompt, gen, length), gen)
        else:
            stats = {k: np.zeros(0) for k in ("kl", "agree", "logp_ref", "logp_cand")}
        cats = token_categories(tok, gen, deltas[rid][:len(gen)])
        digits = [has_digit(tok, t) for t in gen]
        records.append(prompt_record(rid, efforts[rid], ca, cb, cats, digits, stats))
    return {"summary": summarize(records), "top_k": top_k, "prompts": records}


def _efforts(prompts_path, effort: str | None) -> dict[str, str | None]:
    """Request id -> effort level of each chat line (``reasoning_effort``, else ``effort``);
    None for raw-text and token-id lines (no thinking budget)."""
    out = {}
    for n, row in read_records(prompts_path):  # the lines read_requests took
        out[str(row.get("id", n))] = (row.get("reasoning_effort", effort)
                                      if "messages" in row else None)
    return out
