"""SFT rows from environment demonstrations: the rendered conversation, loss on assistant turns.

A demonstration (``Environment.demonstration``) is the list of messages after the task's own:
assistant turns (reasoning, content, tool calls) and tool results. Row = the rendered prompt,
then per assistant turn the ids the format renders for it (generation prompt excluded: those are
prompt tokens) with ``mask = 1``, then the following messages' ids with ``mask = 0``. Built from
prefix differences of ``fmt.render`` so the ids are exactly what the format renders (and what
``rollout.continuation_ids`` produces between turns).
"""

from __future__ import annotations

import numpy as np

from kdsa.train.rl.envs.base import Environment, Task


def demonstration_row(fmt, task: Task, demo, effort: str) -> tuple[list[int], list[float]]:
    """``(ids, mask)`` of one demonstrated conversation; ``mask`` 1 on assistant-turn ids."""
    kw = dict(tools=list(task.tools), effort=effort)
    msgs = list(task.messages)
    ids = fmt.render(msgs, add_generation_prompt=False, **kw)
    mask = [0.0] * len(ids)
    for m in demo:
        full = fmt.render(msgs + [m], add_generation_prompt=False, **kw)
        start = len(ids)
        if m.role == "assistant":  # the generation prompt is prompt, the turn is trained on
            gp = fmt.render(msgs, **kw)
            if gp[:len(ids)] != ids:
                raise ValueError(f"chat format {fmt.name!r}: generation prompt does not extend "
                                 f"the conversation ({task.env} task {task.index})")
            mask += [0.0] * (len(gp) - len(ids))
            start = len(gp)
            ids = gp
        if full[:start] != ids:
            raise ValueError(f"chat format {fmt.name!r} does not render the {task.env} "
                             f"demonstration (task {task.index}) prefix-stably")
        mask += [1.0 if m.role == "assistant" else 0.0] * (len(full) - start)
        ids = full
        msgs.append(m)
    return ids, mask


def sft_batch(fmt, envs: dict[str, Environment], tasks, rows: int,
              seq_len: int) -> dict[str, np.ndarray]:
    """``[rows, seq_len]`` next-token arrays from ``tasks`` ((task, effort) pairs, ``rows`` of
    them); rows longer than ``seq_len + 1`` are an error naming the task."""
    b = {"inputs": np.zeros((rows, seq_len), np.int32),
         "targets": np.zeros((rows, seq_len), np.int32),
         "loss_mask": np.zeros((rows, seq_len), np.float32),
         "sampler_logp": np.zeros((rows, seq_len), np.float32),
         "advantages": np.zeros((rows,), np.float32)}
    for r, (task, effort) in enumerate(tasks[:rows]):
        demo = envs[task.env].demonstration(task)
        if demo is None:
            raise ValueError(f"environment {task.env!r} has no demonstrations for SFT")
        ids, mask = demonstration_row(fmt, task, demo, effort)
        if len(ids) > seq_len + 1:
            raise ValueError(f"SFT row of {task.env} task {task.index} has {len(ids)} tokens; "
                             f"rl.seq_len={seq_len} holds {seq_len + 1}")
        n = len(ids) - 1
        b["inputs"][r, :n], b["targets"][r, :n] = ids[:-1], ids[1:]
        b["loss_mask"][r, :n] = mask[1:]
    return b
