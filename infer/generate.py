"""The batch generation job behind ``kdsa generate``, and engine assembly shared with serving.

Input JSONL, one request per line: ``{"messages": [...], "tools"?, "reasoning_effort"?}`` (chat,
rendered by the chat format), ``{"prompt": "text"}`` (raw text, no template) or
``{"prompt_ids": [...]}``; optional ``id`` and sampling fields ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``. With a vision model, user messages may
hold images: ``image_url`` parts (data URLs) or ``{"type": "image", "path": "a.png"}`` (relative
to the JSONL file; ``docs/vision.md``). Output JSONL, one line per request in input
order: ``id``, ``prompt_tokens``, ``completion_tokens``, ``reasoning_tokens``,
``finish_reason``, ``reasoning``, ``content``, ``tool_calls``, ``token_ids``, ``logprobs``
(model log-probs of the generated tokens, for RL).

Multi-host: every process runs the same command; the engine's schedule depends only on the
inputs and seeds (request seeds default to ``seed + line number``), and sampled tokens are
replicated, so all processes step in lockstep; process 0 alone writes the output and shows the
progress bar.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kdsa.infer.budget import BudgetConfig, check_effort
from kdsa.infer.chat import get_format, messages_from_openai, tools_from_openai
from kdsa.model.vision.inputs import ImageLimits, file_parts, make_image_loader
from kdsa.infer.engine import Engine, Request
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import load_tokenizer

_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")


def load_checkpoint(path: str | Path, mesh=None, layout: str = "generate"):
    """``kdsa.model.checkpoint.load_model`` -> (config, model) placed by ``layout`` on
    ``mesh``; a clear error when that module is missing."""
    try:
        from kdsa.model.checkpoint import load_model
    except ImportError:
        raise ValueError(f"--checkpoint {path}: checkpoint loading "
                         f"(kdsa.model.checkpoint.load_model) is not available in this build; "
                         f"use --preset for random weights") from None
    return load_model(str(path), mesh=mesh, layout=layout)


def build_engine(model, *, num_slots: int, max_len: int, prefill_chunk: int = 256,
                 tokenizer_path=None, chat_format: str = "xtml", flavor: str | None = None,
                 budgets: BudgetConfig | None = None, mesh=None, layout: str = "generate",
                 seed: int = 0) -> tuple[Engine, object]:
    """Runner + tokenizer + chat format + engine for ``model`` -> (engine, chat format)."""
    tok = load_tokenizer(tokenizer_path, vocab_size=model.config.vocab_size,
                         flavor=flavor or ("k2" if chat_format == "k2" else "k3"))
    fmt = get_format(chat_format, tok)
    runner = ModelRunner(model, num_slots=num_slots, max_len=max_len,
                         prefill_chunk=prefill_chunk, mesh=mesh, layout=layout)
    return Engine(runner, tok, chat_format=fmt, budgets=budgets, seed=seed), fmt


def read_requests(path: str | Path, engine: Engine, fmt, *, effort: str | None,
                  defaults: dict, seed: int) -> list[Request]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    reqs = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        try:
            reqs.append(_request(row, engine, fmt, effort, defaults, seed + n - 1, n, p.parent))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not reqs:
        raise ValueError(f"--prompts {path}: no requests")
    ids = [r.request_id for r in reqs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:3]
        raise ValueError(f"--prompts {path}: duplicate request ids {dup}")
    return reqs


def _images(engine, base_dir):
    """Image loader of a vision model (data URLs and files relative to the JSONL), else None."""
    vision = getattr(getattr(engine.runner, "config", None), "vision_config", None)
    return None if vision is None else make_image_loader(vision, ImageLimits(), base_dir)


def _request(row, engine, fmt, effort, defaults, seed, n, base_dir=None) -> Request:
    sp = {**defaults, "seed": seed, **{k: row[k] for k in _SAMPLING_KEYS if k in row}}
    if isinstance(sp.get("stop"), str):
        sp["stop"] = (sp["stop"],)
    sp["stop"] = tuple(sp.get("stop") or ())
    lvl = check_effort(row.get("reasoning_effort", effort))
    rid = str(row.get("id", n))
    if "messages" in row:
        msgs = messages_from_openai(file_parts(row["messages"]), _images(engine, base_dir))
        prompt = fmt.render(msgs, tools=tools_from_openai(row.get("tools")), effort=lvl)
        calls = sum(len(m.tool_calls) for m in msgs)
        return Request(prompt, SamplingParams(**sp), reasoning_cap=engine.budgets.cap(lvl),
                       in_reasoning=True, parser=fmt.parser(first_call_index=calls),
                       request_id=rid, images=[im for m in msgs for im in m.images])
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError("prompt must be a string")
        return Request(engine.tok.encode(row["prompt"]), SamplingParams(**sp), request_id=rid)
    if "prompt_ids" in row:
        return Request([int(t) for t in row["prompt_ids"]], SamplingParams(**sp),
                       request_id=rid)
    raise ValueError("a request needs 'messages', 'prompt' or 'prompt_ids'")


def result_row(c) -> dict:
    out = c.output
    return {"id": c.request_id, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.token_ids), "reasoning_tokens": c.reasoning_tokens,
            "finish_reason": c.finish_reason,
            "reasoning": out.reasoning if out is not None else None, "content": c.text,
            "tool_calls": [t.to_openai() for t in out.tool_calls] if out is not None else [],
            "token_ids": c.token_ids, "logprobs": c.logprobs}


def run_job(engine: Engine, requests: list[Request], out_path: str | Path, *,
            writer: bool = True, progress: bool = True) -> dict:
    """Generate every request; process 0 (``writer``) writes the JSONL. Returns the summary."""
    bar = None
    if progress and writer:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), unit="req", file=sys.stderr, dynamic_ncols=True)

    def tick(ev):
        if ev.completion is not None and bar is not None:
            bar.update(1)

    for r in requests:
        r.on_event = tick
    t0 = time.perf_counter()
    completions = engine.generate(requests)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if writer:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "w") as f:
            for c in completions:
                f.write(json.dumps(result_row(c), ensure_ascii=False) + "\n")
    gen = sum(len(c.token_ids) for c in completions)
    m = engine.metrics()
    return {"requests": len(completions), "prompt_tokens": sum(c.prompt_tokens
                                                               for c in completions),
            "generated_tokens": gen, "elapsed_s": elapsed,
            "tokens_per_s": gen / elapsed if elapsed > 0 else 0.0,
            "mean_ttft_s": m["mean_ttft_s"], "finish_reasons": m["finish_reasons"]}
