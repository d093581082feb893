"""The engine's tokens (mixed into :class:`~kdsa.infer.engine.Engine`): sampling a batch of
rows, each with its own parameters and random stream (``sampling.py``), and applying each
sampled token to its request.

Per token the engine applies, in order: forced tokens (thinking-budget close, ``budget.py``;
``Request.answer_prefix``, forced once the answer starts: the tool-call opening of
``tool_choice``; when the model ends its reasoning by opening a tool call itself, a format's
exit token such as K2's section opener, the rest of that opening),
banned tokens (``Request.banned_token_ids``: masked to ``-inf`` in the jitted sampler, a fixed
``[slots, max_banned_tokens]`` array so nothing recompiles; ``tool_choice: "none"`` bans the
format's call opener; with bans or a prefix the engine also forces the format's answer opening
after the model's own end of thinking, as forced tokens are exempt from the ban),
the chat parser (events ``reasoning`` / ``content`` / ``tool_call``; without a parser raw text
events), stop token ids (the format's end of message unless ``ignore_eos``), stop strings
(matched on the content, or the raw text without a parser; the text is cut before the stop and
content is held back by ``len(stop) - 1`` characters so a stream never shows a partial stop),
``max_tokens`` and the context (``max_len``). Events go to ``Request.on_event`` from the engine
thread.

The methods use the engine's state (``runner``, ``tok``, ``slots``, ``stats``, ``_sample``,
``num_top``, ``max_banned``, ``after_reasoning_ids``) and its ``_note`` / ``_fail`` /
``_finish``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kdsa.infer.requests import Event, _Active

log = logging.getLogger("kdsa.engine")


class TokenStep:
    """Tokens of :class:`Engine`: sample the rows, apply each token to its request."""

    def _sample_and_apply(self, pairs: list[tuple[int, int]], logits) -> None:
        """Sample every (logits row, slot) pair and apply the tokens. A row that cannot be
        packed, parsed or delivered fails alone; a failing sampler fails every row."""
        n, vocab = logits.shape[0], min(self.runner.vocab_size, self.tok.vocab_size)
        if logits.shape[-1] > vocab:  # a padded embedding: ids the tokenizer lacks are never
            logits = logits[:, :vocab]  # sampled (log-probs over the tokenizer's ids)
        temp, top_p, min_p = (np.ones(n, np.float32), np.ones(n, np.float32),
                              np.zeros(n, np.float32))
        top_k, seeds, counters = (np.zeros(n, np.int32), np.zeros(n, np.uint32),
                                  np.zeros(n, np.int32))
        forced = np.full(n, -1, np.int32)
        tempered = np.zeros(n, bool)
        banned = np.full((n, self.max_banned), -1, np.int32)
        ok = []
        for r, i in pairs:
            a, sp = self.slots[i], self.slots[i].req.sampling
            try:  # top_k past the vocabulary keeps every token: clamped so it fits int32
                temp[r], top_k[r], top_p[r], min_p[r] = (sp.temperature, min(sp.top_k, vocab),
                                                         sp.top_p, sp.min_p)
                seeds[r], counters[r] = a.seed, len(a.tokens)
                tempered[r] = sp.tempered_logprobs
                ban = a.req.banned_token_ids
                banned[r, :len(ban)] = ban
            except Exception as e:  # noqa: BLE001 -- e.g. a value the arrays cannot hold
                log.exception("sampling parameters of %s rejected; aborted", a.req.request_id)
                self._fail(i, a, e)
                continue
            if a.forced:
                forced[r] = a.forced.popleft()
            ok.append((r, i))
        if not ok:
            return
        try:
            out = self._sample(logits, temp, top_k, top_p, min_p, seeds, counters, forced,
                               banned, tempered, num_top=self.num_top)
            tok, lp, top_ids, top_lp = (np.asarray(x) for x in out)
            self._note("sample")
        except Exception as e:  # noqa: BLE001 -- shared by the rows: they all fail
            log.exception("sampling failed; %d requests aborted", len(ok))
            self._note("sample", e)
            for _, i in ok:
                self._fail(i, self.slots[i], e)
            return
        for r, i in ok:
            a = self.slots[i]
            try:
                self._apply(i, int(tok[r]), float(lp[r]), top_ids[r], top_lp[r])
            except Exception as e:  # noqa: BLE001 -- its parser or on_event: this one fails
                log.exception("applying a token to %s failed; aborted", a.req.request_id)
                self._fail(i, a, e)

    def _apply(self, i: int, token: int, logprob: float, top_ids, top_lp) -> None:
        a = self.slots[i]
        req, sp = a.req, a.req.sampling
        now = time.perf_counter()
        if a.metrics.first_token is None:
            a.metrics.first_token = now
        a.tokens.append(token)
        a.logprobs.append(logprob)
        k = sp.top_logprobs
        top = [(int(t), float(v)) for t, v in zip(top_ids[:k], top_lp[:k])]
        a.top.append(top)
        self.stats["generated_tokens"] += 1
        piece = "" if self.tok.is_special(token) else a.raw.decode(self.tok.token_bytes(token))
        if a.budget is not None:  # (partial: the decoder holds bytes of an unfinished char)
            a.forced.extend(a.budget.observe(token, piece, partial=bool(a.raw.getstate()[0])))
            if a.open_answer and not a.budget.in_reasoning:  # reasoning closed: open the answer
                if not a.budget.exited:
                    a.forced.extend((() if a.budget.forced_close else self.after_reasoning_ids)
                                    + a.prefix)
                elif a.prefix[:1] == (token,):  # the model opened the tool call itself (an
                    a.forced.extend(a.prefix[1:])  # exit token): tool_choice's rest follows
                a.prefix, a.open_answer = (), False
        deltas: list[tuple[str, object]] = []
        if req.parser is not None:
            for kind, value in req.parser.feed(token):
                if kind == "content":
                    a.text += value
                    continue
                if a.sent < len(a.text):  # text held back for a stop string came first: it
                    deltas.append(("content", a.text[a.sent:]))  # goes out before the call
                    a.sent = len(a.text)  # (a stop string never spans a tool call)
                deltas.append((kind, value))
        else:
            a.text += piece
        reason = None
        if token in a.stop_ids:
            reason = "stop"
        cut = self._find_stop(a)
        if cut is not None:
            a.text, reason = a.text[:cut], "stop"
        elif len(a.tokens) >= sp.max_tokens or len(req.prompt) + len(a.tokens) >= \
                self.runner.max_len:
            reason = reason or "length"
        if reason is not None and req.parser is not None:
            for kind, value in req.parser.flush():
                if kind == "content" and cut is None:
                    a.text += value
                elif kind != "content":
                    deltas.append((kind, value))
        upto = len(a.text) if reason else max(a.sent, len(a.text) - a.hold)
        if upto > a.sent:
            deltas.append(("content" if req.parser is not None else "text", a.text[a.sent:upto]))
            a.sent = upto
        ev = Event(req.request_id, token, logprob, top, deltas)
        if reason is not None:
            ev.completion = self._finish(i, a, reason, emit=False)
        if req.on_event is not None:
            req.on_event(ev)

    def _find_stop(self, a: _Active) -> int | None:
        stops = a.req.sampling.stop
        if not stops:
            return None
        lo = a.sent  # text before it was checked on earlier tokens
        hits = [j for j in (a.text.find(s, lo) for s in stops) if j >= 0]
        return min(hits) if hits else None
