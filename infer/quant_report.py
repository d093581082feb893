"""The optional HTML page of a ``kdsa quant-check`` report: the summary tables and a plot of
the per-token KL along each sequence (matplotlib, embedded as a PNG)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path


def _kl_plot(prompts: list[dict], limit: int = 12) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6), constrained_layout=True)
    worst = sorted(prompts, key=lambda p: -p["kl_mean"])[:limit]
    for p in worst:
        kl = p["tokens"]["kl"]
        if kl:
            ax.plot(range(len(kl)), kl, linewidth=1.0, label=str(p["id"]))
    ax.set_xlabel("generated token (reference's greedy output)")
    ax.set_ylabel("KL(reference || candidate), nats")
    ax.set_title(f"per-token KL along each sequence ({len(worst)} prompts with the highest mean)")
    ax.grid(alpha=0.3)
    if worst:
        ax.legend(fontsize=7, ncol=4)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def write_html(report: dict, path: str | Path, title: str = "kdsa quant-check") -> Path:
    s = report["summary"]
    rows = "".join(
        f"<tr><td>{c}</td><td>{_fmt(v['kl'].get('n'))}</td><td>{_fmt(v['kl'].get('mean'))}</td>"
        f"<td>{_fmt(v['kl'].get('p50'))}</td><td>{_fmt(v['kl'].get('p95'))}</td>"
        f"<td>{_fmt(v['kl'].get('max'))}</td><td>{_fmt(v['top1_agreement'])}</td></tr>"
        for c, v in s["by_category"].items())
    greedy = "".join(f"<tr><td>{k}</td><td>{_fmt(s[k])}</td></tr>" for k in (
        "answer_match", "tool_names_match", "tool_args_match", "identical_outputs"))
    worst = "".join(f"<tr><td>{_fmt(w['id'])}</td><td>{_fmt(w['kl_mean'])}</td>"
                    f"<td>{_fmt(w['first_divergence'])}</td></tr>" for w in s["worst_prompts"])
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 10px;text-align:right}}
table{{border-collapse:collapse;margin-bottom:1.5em}}tr:nth-child(even){{background:#f3f3f3}}</style>
</head><body><h1>{html.escape(title)}</h1>
<p>{s['prompts']} prompts, {s['tokens']} teacher-forced tokens; KL mean {_fmt(s['kl_mean'])},
top-1 agreement {_fmt(s['top1_agreement'])} (KL over the reference's top-{report['top_k']}
tokens plus the rest).</p>
<h2>By category</h2><table><tr><th>category</th><th>tokens</th><th>KL mean</th><th>p50</th>
<th>p95</th><th>max</th><th>top-1 agreement</th></tr>{rows}</table>
<h2>Greedy outputs</h2><table>{greedy}</table>
<h2>Worst prompts</h2><table><tr><th>id</th><th>KL mean</th><th>first divergence</th></tr>
{worst}</table>
<img alt="per-token KL" src="data:image/png;base64,{_kl_plot(report['prompts'])}">
</body></html>"""
    from kdsa.infer.jsonl import write_atomic

    return write_atomic(path, page)
