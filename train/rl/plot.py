"""The reward-curve figure of an RL run, drawn with matplotlib (headless ``Agg`` backend).

Two panels over the RL steps: the rollout score per environment (and their mean) with the
held-out reward before and after RL as dashed lines, and the rollout score per effort level.
Each line is a running mean over ``smooth`` steps (rollout scores of one step are noisy: 8
groups); the raw values are drawn faintly behind it. Read from the per-step metrics
(``score/<env>``, ``effort_score/<level>``, ``score``), so the figure can be redrawn from
``metrics.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _running_mean(values: np.ndarray, window: int) -> np.ndarray:
    out = np.full(values.shape, np.nan)
    for i in range(len(values)):
        seg = values[max(0, i - window + 1):i + 1]
        seg = seg[~np.isnan(seg)]
        if seg.size:
            out[i] = seg.mean()
    return out


def _series(metrics: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if m.get(key) is None else m[key] for m in metrics], float)


def reward_curve(path: str | Path, steps: list[int], metrics: list[dict], *, envs: list[str],
                 efforts: list[str], heldout_before: float | None = None,
                 heldout_after: float | None = None, smooth: int = 5) -> Path:
    """Write the figure to ``path`` (PNG); ``metrics[i]`` are the metrics of RL step
    ``steps[i]``."""
    if len(steps) != len(metrics):
        raise ValueError(f"reward_curve: {len(steps)} steps but {len(metrics)} metric rows")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    x = np.asarray(steps, float)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True,
                                      constrained_layout=True)
    panels = ((left, [(f"score/{e}", e) for e in envs] + [("score", "mean")],
               "rollout score per environment"),
              (right, [(f"effort_score/{e}", f"effort {e}") for e in efforts],
               "rollout score per effort level"))
    for ax, lines, title in panels:
        for i, (key, label) in enumerate(lines):
            y = _series(metrics, key)
            if np.all(np.isnan(y)):
                continue
            color = "black" if label == "mean" else f"C{i}"
            ax.plot(x, y, color=color, alpha=0.15, linewidth=0.8)
            ax.plot(x, _running_mean(y, smooth), color=color, label=label,
                    linewidth=2.2 if label == "mean" else 1.5)
        ax.set_title(f"{title} (mean of {smooth} steps)")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.02, 1.02)
    for value, label, style in ((heldout_before, "held-out before RL", ":"),
                                (heldout_after, "held-out after RL", "--")):
        if value is not None:
            left.axhline(value, color="gray", linestyle=style, linewidth=1.5,
                         label=f"{label} ({value:.3f})")
    left.set_ylabel("score (reward before penalties)")
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
