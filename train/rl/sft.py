"""SFT rows from environment demonstrations: the rendered conversation, loss on assistant turns.

A demonstration (``Environment.demonstration``) is the list of messages after the task's own:
assistant turns (reasoning, content, tool calls) and tool results. Each is one
``train/chat_rows.py`` row with the task's messages as the prompt: loss on every assistant turn
(not its generation prompt), none on the prompt or the tool results.
"""

from __future__ import annotations

import numpy as np

from kdsa.train.chat_rows import conversation_row
from kdsa.train.rl.envs.base import Environment, Task


def demonstration_row(fmt, task: Task, demo, effort: str) -> tuple[list[int], list[float]]:
    """``(ids, mask)`` of one demonstrated conversation; ``mask`` 1 on assistant-turn ids."""
    return conversation_row(fmt, list(task.messages) + list(demo), len(task.messages),
                            where=f"the {task.env} demonstration (task {task.index})",
                            tools=list(task.tools), effort=effort)


def sft_batch(fmt, envs: dict[str, Environment], tasks, rows: int,
              seq_len: int) -> dict[str, np.ndarray]:
    """``[rows, seq_len]`` next-token arrays from ``tasks`` ((task, effort) pairs, ``rows`` of
    them); rows longer than ``seq_len + 1`` are an error naming the task."""
    b = {"inputs": np.zeros((rows, seq_len), np.int32),
         "targets": np.zeros((rows, seq_len), np.int32),
         "loss_mask": np.zeros((rows, seq_len), np.float32),
         "sampler_logp": np.zeros((rows, seq_len), np.float32),
         "advantages": np.zeros((rows,), np.float32),
         "segment_ids": np.zeros((rows, seq_len), np.int32)}  # as RL batches: one compile
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
        b["segment_ids"][r, :n] = 1
    return b
