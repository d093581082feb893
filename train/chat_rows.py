"""The one chat-SFT row builder: a rendered conversation and its loss mask.

``conversation_row(fmt, messages, num_prompt)``: the first ``num_prompt`` messages are the
prompt; every assistant turn after them is trained on (mask 1), everything else (the prompt,
each assistant turn's generation prompt, tool results and later user turns) is not (mask 0).
Built from prefix differences of ``fmt.render`` so the ids are exactly what the format renders
(and what the engine produces between turns); a format that does not render a conversation
prefix-stably is an error. ``kdsa train --data chat.jsonl`` trains the last assistant turn of
each example (``num_prompt = len(messages) - 1``, ``train/vision_data.py``); RL's SFT warm-up
trains every demonstrated turn (``train/rl/sft.py``).
"""

from __future__ import annotations


def conversation_row(fmt, messages, num_prompt: int, *, where: str = "the conversation",
                     **render_kw) -> tuple[list[int], list[float]]:
    """``(ids, mask)``; ``render_kw`` go to every ``fmt.render`` (``tools``, ``effort``,
    ``thinking``); ``where`` names the example in errors."""
    msgs = list(messages[:num_prompt])
    ids = fmt.render(msgs, add_generation_prompt=False, **render_kw)
    mask = [0.0] * len(ids)
    for m in messages[num_prompt:]:
        full = fmt.render(msgs + [m], add_generation_prompt=False, **render_kw)
        start = len(ids)
        if m.role == "assistant":  # the generation prompt is prompt, the turn is trained on
            gp = fmt.render(msgs, **render_kw)
            if gp[:len(ids)] != ids:
                raise ValueError(f"chat format {fmt.name!r}: generation prompt does not extend "
                                 f"the conversation ({where})")
            mask += [0.0] * (len(gp) - len(ids))
            start = len(gp)
            ids = gp
        if full[:start] != ids:
            raise ValueError(
                f"chat format {fmt.name!r} does not render {where} prefix-stably"
                + ("; K2 drops the reasoning of a final answer once a later message follows it "
                   "(its history rule), so only the last answer of a conversation with "
                   "reasoning can be trained in K2" if fmt.name == "k2" else ""))
        mask += [1.0 if m.role == "assistant" else 0.0] * (len(full) - start)
        ids = full
        msgs.append(m)
    return ids, mask
