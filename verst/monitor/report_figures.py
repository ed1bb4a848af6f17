"""The report's charts as plotly figure specs (plain dicts, drawn by plotly.js in the page): one list of
panels per section, for one run or several overlaid (a colour per run)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verst.monitor.report_data import (
    Run,
    axis_label,
    ema,
    funnel,
    part_threads,
    samples_per_s,
    stale_drops_by_length,
    startup_phases,
    thin,
    time_breakdown,
    title_of,
    truncated_fraction,
    unit_of,
)

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22")
DASHES = ("solid", "dash", "dot", "dashdot")
TIME_COLOURS = {"generate": "#1f77b4", "wait for data": "#bcbd22", "old logprobs": "#9467bd", "train": "#2ca02c",
                "weight sync": "#d62728", "eval": "#ff7f0e", "other": "#c7c7c7", "train step": "#2ca02c",
                "engine outage": "#000000"}


# Below the plot: the mode bar (zoom, download) takes the top right on hover.
LEGEND = {"orientation": "h", "y": -0.3, "yanchor": "top", "x": 0}


@dataclasses.dataclass
class Panel:
    id: str
    title: str
    figure: dict[str, Any]
    caption: str = ""  # the metric keys behind the panel, or a note on reading it
    wide: bool = False


def rgba(hex_colour: str, alpha: float) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def colour(run_i: int, series_j: int, n_runs: int) -> str:
    """One run: a colour per series. Several: a colour per run (the series differ by dash)."""
    return PALETTE[(series_j if n_runs == 1 else run_i) % len(PALETTE)]


def layout(x_title: str, y_title: str, height: int = 300, **extra: Any) -> dict[str, Any]:
    axis = {"gridcolor": "#eee", "zerolinecolor": "#ccc", "automargin": True}
    return {
        "height": height, "margin": {"l": 60, "r": 15, "t": 10, "b": 40},
        "paper_bgcolor": "white", "plot_bgcolor": "white", "font": {"size": 11},
        "xaxis": {**axis, "title": {"text": x_title}}, "yaxis": {**axis, "title": {"text": y_title}},
        "legend": LEGEND, "hovermode": "x unified",
        **extra,
    }


def lines(runs: list[Run], pick: list[tuple[str, Any]], x: str = "steps", smooth: bool = True,
          mode: str = "lines") -> list[dict[str, Any]]:
    """Traces of (label, key or function Run -> Series | None) for every run: the smoothed line with the
    raw series faint behind it (counters and short series are drawn raw only)."""
    traces = []
    for i, run in enumerate(runs):
        for j, (label, source) in enumerate(pick):
            s = run.series.get(source) if isinstance(source, str) else source(run)
            if s is None or not s.values:
                continue
            xs = s.steps if x == "steps" else s.times
            if x == "times" and any(t is None for t in xs):
                continue
            _, scale = unit_of(s.key)
            ys = [v * scale for v in s.values]
            name = label if len(runs) == 1 else (run.name if len(pick) == 1 else f"{run.name} · {label}")
            style = {"color": colour(i, j, len(runs)), "dash": DASHES[j % len(DASHES)] if len(runs) > 1 else "solid"}
            group = f"{i}-{j}"
            if smooth and len(ys) >= 10 and not s.monotonic:
                rx, ry = thin(xs, ys)
                traces.append({"type": "scatter", "mode": "lines", "x": rx, "y": ry, "name": name, "legendgroup": group,
                               "showlegend": False, "opacity": 0.25, "hoverinfo": "skip",
                               "line": {**style, "width": 1}})
                ys = ema(ys)
            xs, ys = thin(xs, ys)
            traces.append({"type": "scatter", "mode": mode if len(ys) > 1 else "markers", "x": xs, "y": ys,
                           "name": name, "legendgroup": group, "line": {**style, "width": 2}})
    return traces


def _panel(pid: str, title: str, traces: list, y_key: str, x_title: str = "step", caption: str = "",
           y_title: str | None = None) -> Panel | None:
    if not traces:
        return None
    return Panel(pid, title, {"data": traces, "layout": layout(x_title, axis_label(y_key) if y_title is None
                                                               else y_title)}, caption)


def _reward_band(runs: list[Run]) -> list[dict[str, Any]]:
    """Reward mean with its spread: min–max when logged, else mean ± std, as a shaded band per run."""
    traces = []
    for i, run in enumerate(runs):
        mean = run.series.get("rollout/reward_mean")
        if mean is None:
            continue
        lo_s, hi_s, std = run.get("rollout/reward_min"), run.get("rollout/reward_max"), run.get("rollout/reward_std")
        if lo_s is not None and hi_s is not None:
            lo, hi, what = lo_s.values, hi_s.values, "min–max"
        elif std is not None and len(std.values) == len(mean.values):
            lo = [m - s for m, s in zip(mean.values, std.values)]
            hi = [m + s for m, s in zip(mean.values, std.values)]
            what = "± std"
        else:
            lo = hi = None
        c = colour(i, 0, len(runs))
        name = "reward mean" if len(runs) == 1 else run.name
        if lo is not None and len(lo) == len(mean.values):
            traces.append({"type": "scatter", "mode": "lines", "x": mean.steps, "y": hi, "line": {"width": 0},
                           "showlegend": False, "hoverinfo": "skip", "legendgroup": str(i)})
            traces.append({"type": "scatter", "mode": "lines", "x": mean.steps, "y": lo, "line": {"width": 0},
                           "fill": "tonexty", "fillcolor": rgba(c, 0.15), "name": f"{name} {what}",
                           "hoverinfo": "skip", "legendgroup": str(i)})
        traces.append({"type": "scatter", "mode": "lines", "x": mean.steps, "y": mean.values, "name": name,
                       "line": {"color": c, "width": 2}, "legendgroup": str(i)})
    return traces


def overview_panels(runs: list[Run]) -> list[Panel]:
    score = lambda run: run.series.get(run.score_key) if run.score_key else None  # noqa: E731
    panels = [
        _panel("score-steps", "Held-out score over steps", lines(runs, [("held-out score", score)], smooth=False,
               mode="lines+markers"), "eval/accuracy", caption="eval/accuracy or eval/success: greedy, held out"),
        _panel("score-time", "Held-out score over wall-clock time",
               lines(runs, [("held-out score", score)], x="times", smooth=False, mode="lines+markers"),
               "eval/accuracy", x_title="seconds since the first logged step"),
    ]
    if any("rollout/reward_mean" in r.series for r in runs):
        panels.append(_panel("reward", "Reward mean and spread", _reward_band(runs), "rollout/reward_mean",
                             caption="rollout/reward_mean of the samples trained on; band: reward_std (or min–max)",
                             y_title="reward"))
    else:
        panels.append(_panel("loss", "Training loss", lines(runs, [("loss", "train/loss")]), "train/loss",
                             caption="train/loss", y_title="loss"))
    panels.append(_panel("tokens-per-s", "Throughput: tokens/s", lines(
        runs, [("rollout", "perf/rollout_tokens_per_s"), ("train", "perf/train_tokens_per_s")]),
        "perf/rollout_tokens_per_s", caption="perf/rollout_tokens_per_s (generated), perf/train_tokens_per_s"))
    rates = [("rollout", lambda r: samples_per_s(r).get("rollout")), ("train", lambda r: samples_per_s(r).get("train"))]
    panels.append(_panel("samples-per-s", "Throughput: samples/s", lines(runs, rates), "perf/x_samples_per_s",
                         caption="rollout: growth of rollout/samples_produced; train: samples per step / "
                                 "perf/step_time_s"))
    return [p for p in panels if p is not None]


def time_panels(runs: list[Run]) -> list[Panel]:
    panels = []
    breakdowns = [time_breakdown(r) for r in runs]
    if len(runs) == 1 and breakdowns[0]:
        traces, threads = [], part_threads(runs[0])
        for label, per_step in breakdowns[0].items():
            xs = sorted(per_step)
            trace = {"type": "bar", "x": xs, "y": [per_step[x] for x in xs], "name": label,
                     "marker": {"color": TIME_COLOURS.get(label, "#999")}}
            if label in threads:  # the threads that computed this part, on hover and, when fixed, in the legend
                counts = [threads[label].get(x) for x in xs]
                trace["hovertext"] = [f"{label}: {c:.0f} threads" if c is not None else label for c in counts]
                if len(set(counts)) == 1 and counts[0] is not None:
                    trace["name"] = f"{label} ({counts[0]:.0f} threads)"
            traces.append(trace)
        panels.append(Panel("time-steps", "Seconds per step, by part", {"data": traces, "layout": layout(
            "step", "s", barmode="stack", bargap=0.1, legend={**LEGEND, "traceorder": "normal"})},
            "time/rollout_s, perf/trainer_wait_s, time/logprob_s, time/train_s, sync/seconds, time/eval_s; engine "
            "outage: time/engine_outage_s, taken from what it held up (other, generate, weight sync); other: the "
            "rest of perf/step_time_s. Evaluation runs beside the steps in the RL schedules. Threads (CPU): "
            "perf/engine_threads for generation, perf/trainer_threads for the trainer's parts", wide=True))
    labels = list(dict.fromkeys(label for b in breakdowns for label in b))
    if labels:
        names = [r.name for r in runs]
        # Per train step: evaluation, logged every few steps, is spread over all of them.
        n_steps = [max((len(p) for p in b.values()), default=1) for b in breakdowns]
        traces = [{"type": "bar", "orientation": "h", "y": names, "name": label,
                   "x": [sum(b[label].values()) / n if b.get(label) else 0 for b, n in zip(breakdowns, n_steps)],
                   "marker": {"color": TIME_COLOURS.get(label, "#999")}} for label in labels]
        panels.append(Panel("time-mean", "Mean seconds per step", {"data": traces, "layout": layout(
            "s", "", height=120 + 40 * len(runs), barmode="stack", hovermode="closest",
            legend={**LEGEND, "traceorder": "normal"})}, wide=True))
    phases = [startup_phases(r) for r in runs]
    if any(phases):
        order = list(dict.fromkeys(p for ph in phases for p in ph))
        traces = [{"type": "bar", "orientation": "h", "y": order, "x": [ph.get(p) for p in order],
                   "name": run.name, "marker": {"color": colour(i, i, len(runs))},
                   "text": [f"{ph[p]:.1f} s" if p in ph else "" for p in order], "textposition": "auto"}
                  for i, (run, ph) in enumerate(zip(runs, phases)) if ph]
        panels.append(Panel("startup", "Start-up phases", {"data": traces, "layout": layout(
            "s", "", height=120 + 28 * len(order) * len(traces), barmode="group", hovermode="closest",
            showlegend=len(runs) > 1, yaxis={"autorange": "reversed", "automargin": True})},
            "time/startup/*: the phases overlap (the trainer starts beside the engines); total: time/startup_s",
            wide=True))
    return panels


def data_panels(runs: list[Run]) -> list[Panel]:
    panels = []
    funnels = [(r, funnel(r)) for r in runs]
    funnels = [(r, f) for r, f in funnels if f]
    if funnels:
        notes = [f"{r.name}: {t:.1%} of the samples trained on were truncated at max_response_tokens"
                 for r, _ in funnels if (t := truncated_fraction(r))]
        if len(funnels) == 1:
            stages = funnels[0][1]
            measures = ["absolute"] + ["relative"] * (len(stages) - 2) + ["absolute"]
            ys = [n if m == "absolute" else -n for (_, n), m in zip(stages, measures)]
            traces = [{"type": "waterfall", "x": [s for s, _ in stages], "y": ys, "measure": measures,
                       "text": [f"{n:,.0f}" for _, n in stages], "textposition": "outside",
                       "decreasing": {"marker": {"color": "#d62728"}}, "totals": {"marker": {"color": "#2ca02c"}},
                       "increasing": {"marker": {"color": "#1f77b4"}}, "showlegend": False}]
        else:
            stages = list(dict.fromkeys(s for _, f in funnels for s, _ in f))
            traces = [{"type": "bar", "x": stages, "y": [dict(f).get(s, 0) for s in stages], "name": r.name,
                       "marker": {"color": colour(i, i, len(runs))}} for i, (r, f) in enumerate(funnels)]
        panels.append(Panel("funnel", "Groups: produced → trained on", {"data": traces, "layout": layout(
            "", "groups", height=340, hovermode="closest", barmode="group")},
            "; ".join(notes) or "buffer/dropped_* and rollout/*_groups", wide=True))
    by_length = [(i, r, b) for i, r in enumerate(runs) if (b := stale_drops_by_length(r))]
    if by_length:
        traces = [{"type": "bar", "x": [f"≤{n}" for n, _ in b], "y": [g for _, g in b], "name": r.name,
                   "marker": {"color": colour(i, i, len(runs))}} for i, r, b in by_length]
        panels.append(Panel("stale-by-length", "Groups dropped as stale, by longest response (tokens)",
                            {"data": traces, "layout": layout("", "groups", height=300, hovermode="closest",
                                                              barmode="group")},
                            "buffer/dropped_stale_len_le_<tokens>_total"))
    stale = lines(runs, [("mean", "buffer/staleness_mean"), ("max", "buffer/staleness_max")], smooth=False)
    if stale:
        panels.append(_panel("staleness", "Staleness of the groups trained on", stale, "buffer/staleness_mean",
                             caption="versions between the weights that generated a group and the trainer's"))
    return panels


def metric_panel(runs: list[Run], key: str) -> Panel:
    p = _panel("m-" + key.replace("/", "-"), title_of(key), lines(runs, [(title_of(key), key)]), key, caption=key)
    p.figure["layout"]["height"] = 240
    p.figure["layout"]["showlegend"] = len(runs) > 1
    return p
