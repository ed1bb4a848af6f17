"""The HTML report of one run, or of several overlaid: one self-contained page (plotly.js inline, no network)
with an overview, where the time and the data go, sample generations and every other metric by namespace.

Written by `verst report RUN_DIR [RUN_DIR ...]` and at the end of training; reads only the run directories.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from pathlib import Path
from typing import Any

from verst.monitor import report_figures as figs
from verst.monitor.image_grid import data_uri, eval_grids
from verst.monitor.report_data import (
    Run,
    by_namespace,
    child_run_dirs,
    format_value,
    load_run,
    parent_run_dir,
    split_constant,
)
from verst.monitor.samples import examples, pick_steps, read_samples

REPORT_FILE = "report.html"
MAX_GRIDS = 8  # held-out image grids shown
COMPARE_FILE = "report-compare.html"
# Keys the first three sections draw (and train/loss, in place of the reward, for SFT runs);
# "everything else" shows the rest.
SHOWN_PREFIXES = ("time/startup/", "buffer/dropped_")
SHOWN_KEYS = frozenset({
    "eval/accuracy", "eval/success", "rollout/reward_mean", "rollout/reward_std", "rollout/reward_min",
    "rollout/reward_max", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "time/rollout_s",
    "perf/trainer_wait_s", "time/logprob_s", "time/train_s", "sync/seconds", "time/eval_s", "perf/step_time_s",
    "time/startup_s", "rollout/groups_produced", "rollout/groups_produced_total", "rollout/launched_groups",
    "rollout/kept_groups", "rollout/filtered_groups", "rollout/failed_groups", "rollout/aborted_groups",
    "buffer/staleness_mean", "buffer/staleness_max", "time/engine_outage_s",
})
STYLE = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#fff;border-bottom:1px solid #ddd;padding:14px 28px;position:sticky;top:0;z-index:10}
h1{font-size:20px;margin:0 0 4px}.meta{color:#666;font-size:13px;margin:0}
nav a{margin-right:14px;font-size:13px;color:#1f77b4;text-decoration:none}
main{padding:0 28px 40px;max-width:1500px}h2{margin:28px 0 8px;font-size:18px;border-bottom:2px solid #1f77b4}
h3{font-size:14px;margin:18px 0 6px;color:#444}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:12px}
.grid.small{grid-template-columns:repeat(auto-fill,minmax(340px,1fr))}
.panel{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px 10px}.panel.wide{grid-column:1/-1}
.panel h4{margin:0;font-size:13px}.caption{color:#888;font-size:11px;margin:2px 0 0}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.card{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px 14px;min-width:150px}
.card b{display:block;font-size:20px}.card span{color:#666;font-size:12px}
table{border-collapse:collapse;background:#fff;font-size:13px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 9px;text-align:left;vertical-align:top}th{background:#f3f3f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}.sample pre{white-space:pre-wrap;margin:0;font-size:12px}
pre.config{background:#fff;border:1px solid #ddd;padding:1em;overflow:auto;font-size:12px}
.links{font-size:14px;margin:10px 0}"""
# Draw the overview at once and the other charts as they scroll near: a long report opens fast.
DRAW_JS = """(function(){var F=JSON.parse(document.getElementById('verst-figures').textContent);
var C={displaylogo:false,responsive:true,displayModeBar:'hover'};function draw(el){var f=F[el.id];Plotly.newPlot(el,f.data,f.layout,C);}
var io='IntersectionObserver' in window?new IntersectionObserver(function(es){es.forEach(function(e){
if(e.isIntersecting){io.unobserve(e.target);draw(e.target);}});},{rootMargin:'800px'}):null;
document.querySelectorAll('.fig').forEach(function(el){if(io&&!el.closest('#overview'))io.observe(el);else draw(el);});
})();"""


def write_report(run_dir: str | Path, out: str | Path | None = None, refresh_parent: bool = True) -> Path:
    """RUN_DIR/report.html (or `out`). The report of the SFT run this run started from is written again
    too, so that it links forward to this run."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else run.path / REPORT_FILE
    _write_whole(out, render([run], out))
    parent = parent_run_dir(run.path, run.config)
    if refresh_parent and parent is not None and (parent / REPORT_FILE).exists():
        try:
            write_report(parent, refresh_parent=False)
        except OSError:
            pass  # a read-only parent keeps its report; this run's own report is written
    return out


def write_compare_report(run_dirs: list[str | Path], out: str | Path = COMPARE_FILE) -> Path:
    """One report overlaying several runs, a colour each, named by their directories."""
    paths = [Path(p) for p in run_dirs]
    names = [p.name for p in paths]
    if len(set(names)) < len(names):  # same directory name in different places: add the parent's
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    runs = [load_run(p, n) for p, n in zip(paths, names)]
    out = Path(out)
    _write_whole(out, render(runs, out))
    return out


def _write_whole(out: Path, text: str) -> None:
    """`out` whole or not at all: a full disk leaves no half report (nor its space taken)."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def render(runs: list[Run], out: Path) -> str:
    from plotly.offline import get_plotlyjs  # the report writer alone needs plotly

    figures: dict[str, Any] = {}
    sections = [
        ("overview", "Overview", _overview(runs, figures)),
        ("time", "Where the time goes", _panels(figs.time_panels(runs), figures)),
        ("data", "Where the data goes", _panels(figs.data_panels(runs), figures)),
        ("samples", "Sample generations", _samples(runs[0]) if len(runs) == 1 else ""),
        ("images", "Held-out images", _images(runs[0]) if len(runs) == 1 else ""),
        ("metrics", "Everything else", _everything_else(runs, figures)),
        ("config", "Config", _config(runs)),
    ]
    sections = [(sid, title, body) for sid, title, body in sections if body]
    nav = "".join(f'<a href="#{sid}">{title}</a>' for sid, title, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{title}</h2>{content}</section>' for sid, title, content in sections)
    title = runs[0].name if len(runs) == 1 else " vs ".join(r.name for r in runs)
    data = json.dumps(figures, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>verst · {html.escape(title)}</title>'
            f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body>"
            f"<header><h1>verst {'run' if len(runs) == 1 else 'runs'}: {html.escape(title)}</h1>"
            f'<p class="meta">{html.escape(_meta(runs))}</p><nav>{nav}</nav></header>'
            f"<main>{_links(runs, out)}{body}</main>"
            f'<script type="application/json" id="verst-figures">{data}</script><script>{DRAW_JS}</script>'
            "</body></html>")


def _meta(runs: list[Run]) -> str:
    def one(run: Run) -> str:
        kind = run.summary.get("schedule") or ("sft" if "rollout/reward_mean" not in run.series else "rl")
        model = (run.config.get("model") or {}).get("path", "?")
        return f"{run.name}: {kind}, model {model}, {len(run.records)} records"

    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return " · ".join(one(r) for r in runs) + f" · written {when}"


def _links(runs: list[Run], out: Path) -> str:
    """Runs overlaid (with their own reports), the SFT run a run started from, the RL runs started from it."""
    def link(run_dir: Path, text: str) -> str:
        target = run_dir / REPORT_FILE
        href = os.path.relpath(target.resolve(), out.resolve().parent)
        return f'<a href="{html.escape(href)}">{html.escape(text)}</a>' if target.exists() else html.escape(text)

    parts = []
    if len(runs) > 1:
        parts.append("Runs: " + ", ".join(link(r.path, r.name) for r in runs))
    for run in runs:
        parent = parent_run_dir(run.path, run.config)
        if parent is not None:
            parts.append(f"{html.escape(run.name)} started from the model of SFT run {link(parent, parent.name)}")
        if len(runs) == 1:
            children = child_run_dirs(run.path)
            if children:
                parts.append("RL runs started from this run's model: "
                             + ", ".join(link(c, c.name) for c in children))
    return "".join(f'<p class="links">{p}</p>' for p in parts)


def _panels(panels: list[figs.Panel], figures: dict[str, Any], grid: str = "grid") -> str:
    cells = []
    for p in panels:
        figures[p.id] = p.figure
        caption = f'<p class="caption">{html.escape(p.caption)}</p>' if p.caption else ""
        cells.append(f'<div class="panel{" wide" if p.wide else ""}"><h4>{html.escape(p.title)}</h4>{caption}'
                     f'<div class="fig" id="{html.escape(p.id)}"></div></div>')
    return f'<div class="{grid}">{"".join(cells)}</div>' if cells else ""


def _overview(runs: list[Run], figures: dict[str, Any]) -> str:
    panels = _panels(figs.overview_panels(runs), figures, "grid small")
    return _cards(runs[0]) + panels + _summary_table(runs) if len(runs) == 1 else panels + _summary_table(runs)


def _cards(run: Run) -> str:
    cards, s = [], run.summary
    key = run.score_key or "eval/accuracy"
    before, after = s.get(f"{key}_before"), s.get(f"{key}_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        cards.append((f"{before:.1%} → {after:.1%}", f"held-out {key[5:]} ({(after - before) * 100:+.1f} points)"))
    if isinstance(s.get("time/total_s"), (int, float)):
        start = run.series.get("time/startup_s")
        extra = f" (start-up {start.values[-1]:.0f} s)" if start else ""
        segments = s.get("segments") or []
        if len(segments) > 1:  # a resumed or restarted run: the total is over every segment
            extra = f" over {len(segments)} segments: " + ", ".join(
                f"{seg['seconds']:.0f} s (steps {seg['from_step']}–{seg['to_step']}, {seg['end'].split(':')[0]})"
                for seg in segments)
        cards.append((format_value("time/total_s", s["time/total_s"]), f"wall-clock{extra}"))
    if isinstance(s.get("stopped"), str):
        cards.append(("stopped early", s["stopped"]))
    if "train/steps" in s:
        cards.append((f"{s['train/steps']:,}", "train steps"))
    for key, what in (("perf/rollout_tokens_per_s", "rollout tokens/s (mean)"),
                      ("perf/train_tokens_per_s", "train tokens/s (mean)")):
        if key in run.series:
            values = run.series[key].values
            cards.append((f"{sum(values) / len(values):,.0f}", what))
    html_cards = "".join(f"<div class=card><b>{html.escape(v)}</b><span>{html.escape(w)}</span></div>"
                         for v, w in cards)
    return f'<div class="cards">{html_cards}</div>' if cards else ""


def _summary_table(runs: list[Run]) -> str:
    keys = sorted({k for r in runs for k in r.summary} - {"segments"})  # segments: the wall-clock card
    if not keys:
        return ""
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs) if len(runs) > 1 else "<th>value</th>"
    rows = "".join(f"<tr><td>{html.escape(k)}</td>" + "".join(
        f'<td class="num">{html.escape(format_value(k, r.summary[k])) if k in r.summary else ""}</td>' for r in runs)
        + "</tr>" for k in keys)
    return f"<h3>Summary (summary.json)</h3><table><tr><th>key</th>{head}</tr>{rows}</table>"


def _samples(run: Run) -> str:
    dump_dir = (run.config.get("rollout") or {}).get("dump_dir")
    by_step = read_samples(run.path, dump_dir)
    if not by_step:
        return ""
    parts = []
    for step in pick_steps(sorted(by_step)):
        rows = []
        for ex in examples(by_step[step]):
            responses = "".join(
                f"<tr><td><pre>{html.escape(r['response'])}</pre>{_outcome(r)}</td>"
                f"<td class=num>{html.escape(_reward(r))}</td>"
                f"<td>{html.escape(str(r.get('status') or ''))}</td></tr>" for r in ex["responses"])
            label = "" if ex["label"] is None else f"<br><small>label: {html.escape(str(ex['label']))}</small>"
            rows.append(f'<tr class="sample"><td rowspan="{len(ex["responses"]) + 1}"><pre>'
                        f"{html.escape(ex['prompt'])}</pre>{label}</td></tr>{responses}")
        parts.append(f"<h3>Step {step}</h3><table><tr><th>prompt</th><th>response</th><th>reward</th>"
                     f"<th>status</th></tr>{''.join(rows)}</table>")
    return "".join(parts)


def _images(run: Run) -> str:
    """An image run's held-out grids (the same prompts and seeds at every evaluation: a row per prompt), with the
    step's score; at most MAX_GRIDS steps, the first and the last among them."""
    grids = eval_grids(run.path)
    if not grids:
        return ""
    steps = list(grids)
    if len(steps) > MAX_GRIDS:
        steps = sorted({steps[round(i * (len(steps) - 1) / (MAX_GRIDS - 1))] for i in range(MAX_GRIDS)})
    scores = {int(r["step"]): r["eval/accuracy"] for r in run.records if "eval/accuracy" in r and "step" in r}
    figures = "".join(
        f'<figure class="panel"><img src="{data_uri(grids[step])}" alt="step {step}" style="image-rendering:pixelated">'
        f"<figcaption>step {step}" + (f" · eval/accuracy {scores[step]:.3f}" if step in scores else "")
        + "</figcaption></figure>" for step in steps)
    return ('<p class="caption">The same held-out prompts and seeds at each evaluation: a row per prompt '
            f'(diffusion.eval_images_per_prompt images each).</p><div class="grid small">{figures}</div>')


def _outcome(response: dict[str, Any]) -> str:
    """What an agent episode ended with (its `outcome`), under the response."""
    return f"<small>outcome</small><pre>{html.escape(response['outcome'])}</pre>" if response.get("outcome") else ""


def _reward(record: dict[str, Any]) -> str:
    reward = record.get("reward")
    if isinstance(reward, dict):
        return ", ".join(f"{k}={v:.3g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in reward.items())
    return f"{reward:.3g}" if isinstance(reward, (int, float)) else str(reward)


def _everything_else(runs: list[Run], figures: dict[str, Any]) -> str:
    shown = SHOWN_KEYS if any("rollout/reward_mean" in r.series for r in runs) else SHOWN_KEYS | {"train/loss"}
    keys = sorted({k for r in runs for k in r.series if k not in shown and not k.startswith(SHOWN_PREFIXES)})
    plotted, folded = split_constant(runs, keys)
    parts = [f"<h3>{html.escape(ns)}</h3>" + _panels([figs.metric_panel(runs, k) for k in ns_keys], figures,
                                                     "grid small")
             for ns, ns_keys in by_namespace(plotted).items()]
    if folded:
        head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs) if len(runs) > 1 else "<th>value</th>"
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td>" + "".join(
                f'<td class="num">{html.escape(format_value(k, r.series[k].values[-1])) if k in r.series else ""}'
                "</td>" for r in runs) + "</tr>" for k in folded)
        parts.append(f"<h3>Constant over the run (or logged once)</h3><table><tr><th>key</th>{head}</tr>{rows}</table>")
    return "".join(parts)


def _config(runs: list[Run]) -> str:
    blocks = []
    for run in runs:
        config_file = run.path / "config.yaml"
        if config_file.exists():
            blocks.append(f"<details><summary>{html.escape(run.name)}: config.yaml</summary>"
                          f'<pre class="config">{html.escape(config_file.read_text())}</pre></details>')
    return "".join(blocks)
