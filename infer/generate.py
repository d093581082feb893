"""The batch generation job behind ``kdsa generate``, and engine assembly shared with serving.

Input JSONL, one request per line: ``{"messages": [...], ...}`` (a chat-completions body:
``tools``, ``tool_choice``, ``response_format``, ``reasoning_effort`` including ``none``, checked
and rendered as the HTTP API does), ``{"prompt": "text"}`` (raw text, no template) or
``{"prompt_ids": [...]}``; optional ``id`` and sampling fields ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``ignore_eos`` (vLLM's: generate
``max_tokens`` whatever the end-of-sequence tokens), checked as the HTTP API checks them.
With a vision model, user messages may hold images: ``image_url`` parts (data URLs) or
``{"type": "image", "path": "a.png"}`` (relative to the JSONL file; ``docs/vision.md``).
Output JSONL, one line per request in input order: ``id``, ``prompt_tokens``, ``completion_tokens``, ``reasoning_tokens``,
``finish_reason``, ``reasoning``, ``content``, ``tool_calls``, ``token_ids``, ``logprobs``
(model log-probs of the generated tokens, for RL).

A line that cannot be served -- not JSON, an invalid field (``seed`` outside ``[0, 2**32)``,
``top_k`` outside ``[0, 2**31)``, ...), refused by the engine or failed in generation -- is
the record ``{"id", "error"}`` at its place (``read_requests(..., strict=False)`` keeps it as a
:class:`BadLine`); the other lines are served, and ``run_job`` counts the failures
(``kdsa generate`` then exits 1).

Multi-host: every process runs the same command; the engine's schedule depends only on the
inputs and seeds (request seeds default to ``seed + line number``), and sampled tokens are
replicated, so all processes step in lockstep; process 0 alone writes the output and shows the
progress bar.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import get_format
from kdsa.model.vision.inputs import ImageLimits, file_parts, make_image_loader
from kdsa.infer.engine import Engine, EngineDead, Request
from kdsa.infer.jsonl import ResultsFile, read_lines
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import load_tokenizer
from kdsa.progress import Progress

@dataclasses.dataclass
class BadLine:
    """A line of the prompts file that is not a request: its output record is an error."""

    request_id: str
    error: str


def load_checkpoint(path: str | Path, mesh=None, layout: str = "generate"):
    """``kdsa.model.checkpoint.load_model`` -> (config, model) placed by ``layout`` on
    ``mesh``; a clear error when that module is missing."""
    try:
        from kdsa.model.checkpoint import load_model
    except ImportError:
        raise ValueError(f"--checkpoint {path}: checkpoint loading "
                         f"(kdsa.model.checkpoint.load_model) is not available in this build; "
                         f"use --preset for random weights") from None
    from kdsa.sharding.rules import layout_shardings

    return load_model(str(path), layout_shardings(mesh, layout))


def build_engine(model, *, num_slots: int, max_len: int, prefill_chunk: int = 256,
                 tokenizer_path=None, chat_format: str = "xtml", flavor: str | None = None,
                 budgets: BudgetConfig | None = None, mesh=None, layout: str = "generate",
                 seed: int = 0, num_pages: int | None = None, prefix_snapshots: int = 0,
                 prefix_snapshot_every: int = 4,
                 batched_prefill: bool = False) -> tuple[Engine, object]:
    """Runner + tokenizer + chat format + engine for ``model`` -> (engine, chat format)."""
    tok = load_tokenizer(tokenizer_path, vocab_size=model.config.vocab_size,
                         flavor=flavor or ("k2" if chat_format == "k2" else "k3"))
    fmt = get_format(chat_format, tok)
    runner = ModelRunner(model, num_slots=num_slots, max_len=max_len,
                         prefill_chunk=prefill_chunk, mesh=mesh, layout=layout,
                         num_pages=num_pages, num_snapshots=prefix_snapshots,
                         batch_prefill=batched_prefill)
    return Engine(runner, tok, chat_format=fmt, budgets=budgets, seed=seed,
                  prefix_snapshot_every=prefix_snapshot_every), fmt


def prompts_file(path: str | Path) -> Path:
    """``path`` as a prompts file that exists (a ``ValueError`` naming ``--prompts``
    otherwise): the commands check it before they build a model, :func:`read_requests` again."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    return p


def read_requests(path: str | Path, engine: Engine, fmt, *, effort: str | None,
                  defaults: dict, seed: int, strict: bool = True) -> list[Request | BadLine]:
    """One request per non-blank line. ``strict``: a bad line raises ``ValueError`` naming
    ``path:line``; otherwise it becomes a :class:`BadLine` in its place. Request seeds default
    to ``seed + line - 1`` (folded to 32 bits)."""
    p = prompts_file(path)
    reqs, lines = [], []
    for n, line in read_lines(p, f"--prompts {path}"):
        lines.append(n)
        row = None
        try:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError("each line must be a JSON object")
            reqs.append(_request(row, engine, fmt, effort, defaults, (seed + n - 1) % 2**32,
                                 n, p.parent))
        except Exception as e:  # noqa: BLE001 -- strict: raised below; else this line's record
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            if strict:
                raise ValueError(f"{path}:{n}: {msg}") from None
            rid = row.get("id", n) if isinstance(row, dict) else n
            reqs.append(BadLine(str(rid), f"line {n}: {msg}"))
    if not reqs:
        raise ValueError(f"--prompts {path}: no requests")
    where: dict[str, list[int]] = {}
    for r, n in zip(reqs, lines):
        if isinstance(r, Request):
            where.setdefault(r.request_id, []).append(n)
    dup = [f"{i!r} (lines {', '.join(map(str, ns))})" for i, ns in where.items() if len(ns) > 1]
    if dup:
        raise ValueError(f"--prompts {path}: duplicate request ids {'; '.join(dup[:3])}; give "
                         f"each line its own id (a line without one takes its line number)")
    return reqs


def _images(engine, base_dir):
    """Image loader of a vision model (data URLs and files relative to the JSONL), else None."""
    vision = getattr(getattr(engine.runner, "config", None), "vision_config", None)
    return None if vision is None else make_image_loader(vision, ImageLimits(), base_dir)


def _request(row, engine, fmt, effort, defaults, seed, n, base_dir=None) -> Request:
    """One line -> its engine request. Sampling fields are checked as the HTTP API checks them
    (``openai_api.sampling_fields``: a boolean is no number, null means absent, the same
    ranges); a chat line goes through the API's own request path (``parse_chat_request``,
    ``engine_requests``: ``reasoning_effort`` ``none`` and the aliases, ``tools``,
    ``tool_choice``, ``response_format``), with the command's flags as its defaults."""
    from kdsa.infer import openai_api as api

    rid = str(row.get("id", n))
    try:
        fields = api.sampling_fields(row)
        if fields.pop("n", 1) != 1:
            raise ValueError("n must be 1 (kdsa generate writes one record per line)")
        if "messages" in row:
            body = {k: v for k, v in row.items() if k not in ("id", "model", "stream")}
            for k, v in {**defaults, "seed": seed, "reasoning_effort": effort}.items():
                if body.get(k) is None:
                    body[k] = v
            body["messages"] = file_parts(row["messages"]) if isinstance(
                row["messages"], list) else row["messages"]
            job = api.parse_chat_request(
                body, model_name="", chat_format=fmt, max_len=engine.max_request_tokens,
                images=_images(engine, base_dir))
            return api.engine_requests(job, fmt, engine.budgets, request_ids=[rid])[0]
    except api.ApiError as e:
        raise ValueError(str(e)) from None
    sp = SamplingParams(**{**defaults, "seed": seed, **fields})
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError("prompt must be a string")
        return Request(engine.tok.encode(row["prompt"]), sp, request_id=rid)
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            raise ValueError("prompt_ids must be a list of integer token ids")
        return Request(list(ids), sp, request_id=rid)
    raise ValueError("a request needs 'messages', 'prompt' or 'prompt_ids'")


def result_row(c) -> dict:
    out = c.output
    return {"id": c.request_id, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.token_ids), "reasoning_tokens": c.reasoning_tokens,
            "finish_reason": c.finish_reason,
            "reasoning": out.reasoning if out is not None else None, "content": c.text,
            "tool_calls": [t.to_openai() for t in out.tool_calls] if out is not None else [],
            "token_ids": c.token_ids, "logprobs": c.logprobs}


def run_job(engine: Engine, requests: list[Request | BadLine], out_path: str | Path, *,
            writer: bool = True, progress: bool = True, resume: bool = False) -> dict:
    """Generate every request; process 0 (``writer``) writes the JSONL, one record per item in
    order: a result row, or ``{"id", "error"}`` for a :class:`BadLine`, a request the engine
    refused or one that failed. Records are written as they finish, in order
    (``infer/jsonl.py : ResultsFile``: ``OUT.partial``, renamed to ``OUT`` at the end), so an
    interrupted job loses only the records not yet finished; ``resume`` takes the records an
    interrupted job left, checks that their ids are the first lines' ids, and generates the
    rest. Returns the summary (``failed``: error records, ``errors``: their first few;
    ``resumed``: records kept from the interrupted job)."""
    from kdsa.sharding.agreement import from_first_process

    results = ResultsFile(out_path, resume=resume, enabled=writer)
    skip = from_first_process(len(results.done))  # every process submits the same requests
    if skip > len(requests):
        raise ValueError(f"--resume: {results.partial} holds {skip} records but --prompts has "
                         f"{len(requests)} lines: not this prompts file")
    bad = next((i for i, (rec, r) in enumerate(zip(results.done, requests))
                if rec.get("id") != r.request_id), -1)
    if from_first_process(bad) >= 0:  # (only process 0 reads the records: all stop with it)
        raise ValueError(
            f"--resume: record {bad + 1} of {results.partial} is for id "
            f"{results.done[bad].get('id')!r}, but line {bad + 1} of --prompts has id "
            f"{requests[bad].request_id!r}: not this prompts file" if bad >= 0 else
            "--resume: process 0 found records of another prompts file")
    bar = Progress(len(requests), unit="req", enabled=progress and writer)
    bar.advance_to(skip)
    done: dict[str, object] = {}

    def tick(ev):
        if ev.completion is not None:
            done[ev.request_id] = ev.completion
            bar.update(1)

    records: list = []  # a Request (its completion comes later) or an error record
    rows = list(results.done) + [{}] * (skip - len(results.done))  # (only process 0 reads them)
    t0 = time.perf_counter()
    for r in requests[skip:]:
        if isinstance(r, BadLine):
            records.append({"id": r.request_id, "error": r.error})
            continue
        r.on_event = tick
        try:
            engine.submit(r)
            records.append(r)
        except (ValueError, EngineDead) as e:  # refused (e.g. too long) or the engine died
            records.append({"id": r.request_id, "error": str(e)})

    def write_finished() -> None:  # the records whose turn has come, in input order
        while len(rows) - skip < len(records):
            r = records[len(rows) - skip]
            if isinstance(r, Request):
                c = done.get(r.request_id)
                if c is None and engine.has_work():
                    return
                r = (result_row(c) if c is not None and c.error is None else
                     {"id": r.request_id, "error": c.error if c else "not generated"})
            results.write(r)
            rows.append(r)

    write_finished()
    while engine.has_work():
        engine.step()
        write_finished()
    write_finished()
    results.finish()
    elapsed = time.perf_counter() - t0
    bar.advance_to(len(requests))
    bar.close()
    ok = [c for c in done.values() if c.error is None]
    errors = [f"{r['id']}: {r['error']}" for r in rows if "error" in r]
    gen = sum(len(c.token_ids) for c in ok)
    m = engine.metrics()
    return {"requests": len(rows), "served": len(rows) - len(errors), "failed": len(errors),
            "errors": errors[:3], "resumed": skip,
            "prompt_tokens": sum(c.prompt_tokens for c in ok),
            "generated_tokens": gen, "elapsed_s": elapsed,
            "tokens_per_s": gen / elapsed if elapsed > 0 else 0.0,
            "mean_ttft_s": m["mean_ttft_s"], "finish_reasons": m["finish_reasons"]}
