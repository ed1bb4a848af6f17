"""The HTML report of a run: summary table, PNG plots of every metric by namespace, the config.

Written by `verst report RUN_DIR` and at the end of training; reads only files in the run directory.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path

from verst.monitor.run_dir import CONFIG_FILE, SUMMARY_FILE, read_metrics

REPORT_FILE = "report.html"
# Plots a reader looks for first, in this order, when the run logged them.
HEADLINE = ("rollout/reward_mean", "eval/accuracy", "buffer/staleness_mean", "buffer/queue_size", "perf/rollout_tokens_per_s")
MAX_PANELS = 12


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    records = read_metrics(run_dir)
    series = _series(records)
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    images = []
    headline = [k for k in HEADLINE if k in series]
    if headline:
        images.append(_plot(series, headline, plots_dir / "headline.png", "headline"))
    by_namespace: dict[str, list[str]] = defaultdict(list)
    for key in series:
        by_namespace[key.split("/", 1)[0]].append(key)
    for namespace, keys in sorted(by_namespace.items()):
        for i in range(0, len(keys), MAX_PANELS):
            chunk = sorted(keys)[i : i + MAX_PANELS]
            suffix = f"_{i // MAX_PANELS}" if len(keys) > MAX_PANELS else ""
            images.append(_plot(series, chunk, plots_dir / f"{namespace}{suffix}.png", namespace))
    out = run_dir / REPORT_FILE
    out.write_text(_html(run_dir, records, images))
    return out


def _series(records: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    series: dict[str, tuple[list[float], list[float]]] = {}
    for rec in records:
        step = rec.get("step")
        for key, value in rec.items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(step)
            ys.append(value)
    return series


def _plot(series, keys: list[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(keys))
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        xs, ys = series[key]
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _html(run_dir: Path, records: list[dict], images: list[Path]) -> str:
    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    config_file = run_dir / CONFIG_FILE
    config = config_file.read_text() if config_file.exists() else "(no config.yaml)"
    rows = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in sorted(summary.items())
    )
    imgs = "".join(f'<img src="{p.relative_to(run_dir)}" alt="{p.stem}">' for p in images)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>verst run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse}}
td{{border:1px solid #ccc;padding:2px 8px}}img{{max-width:100%;display:block;margin:1em 0}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style></head><body>
<h1>verst run: {html.escape(run_dir.name)}</h1>
<p>{len(records)} metric records in metrics.jsonl.</p>
<h2>Summary</h2><table>{rows or "<tr><td>(no summary.json yet)</td></tr>"}</table>
<h2>Metrics</h2>{imgs or "<p>(no metrics logged)</p>"}
<h2>Config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
