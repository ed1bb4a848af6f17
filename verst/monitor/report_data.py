"""What a run report shows, as plain numbers: a run's series, their units, smoothing, constant folding,
the data funnel, the per-step time breakdown and the SFT → RL lineage. No plotting library here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from verst.monitor.run_dir import CONFIG_FILE, SUMMARY_FILE, read_metrics

SCORE_KEYS = ("eval/accuracy", "eval/success")  # held-out score: greedy accuracy, or agent success
# Units by key pattern, first match wins: (regex on the key, unit label, scale applied to the values).
UNITS: tuple[tuple[str, str, float], ...] = (
    (r"tokens_per_s$", "tokens/s", 1.0),
    (r"samples_per_s$", "samples/s", 1.0),
    (r"_per_s$", "/s", 1.0),
    (r"(_s|seconds)$", "s", 1.0),
    (r"(_fraction|_ratio|_rate|_frac|clipfrac|occupancy|accuracy|success)(_before|_after)?$", "%", 100.0),
    (r"bytes$", "MB", 1e-6),
    (r"length(_mean)?$", "tokens", 1.0),
    (r"staleness", "versions", 1.0),
    (r"version(_mean|_before|_after)?$", "version", 1.0),
    (r"(groups|groups_produced|_groups_dropped|dropped_\w+|queue_size|capacity)(_total)?$", "groups", 1.0),
    (r"(samples_produced|in_flight|max_in_flight)(_total)?$", "samples", 1.0),
    (r"prompts$|prompt_too_long$", "prompts", 1.0),
    (r"steps$", "steps", 1.0),
)
EMA_MAX_WEIGHT = 0.95
MAX_POINTS = 2000  # raw points drawn per series; the smoothed line always uses every point


@dataclasses.dataclass
class Series:
    key: str
    steps: list[float]
    values: list[float]
    times: list[float | None]  # seconds since the run's first record, per point

    @property
    def constant(self) -> bool:
        """One point, or the same value at every point: a table row, not a plot."""
        return len(self.values) < 2 or all(v == self.values[0] for v in self.values)

    @property
    def monotonic(self) -> bool:
        """A cumulative counter: smoothing would only lag it."""
        return all(b >= a for a, b in zip(self.values, self.values[1:]))


@dataclasses.dataclass
class Run:
    name: str
    path: Path
    records: list[dict[str, Any]]
    series: dict[str, Series]
    summary: dict[str, Any]
    config: dict[str, Any]

    def get(self, *keys: str) -> Series | None:
        """The first of `keys` this run logged (metric names that changed keep older runs readable)."""
        return next((self.series[k] for k in keys if k in self.series), None)

    @property
    def score_key(self) -> str | None:
        return next((k for k in SCORE_KEYS if k in self.series), None)


def load_run(path: str | Path, name: str | None = None) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
    records = read_metrics(path)
    summary_file, config_file = path / SUMMARY_FILE, path / CONFIG_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.exists() else {}
    return Run(name or path.name, path, records, build_series(records), summary, config)


def build_series(records: list[dict[str, Any]]) -> dict[str, Series]:
    """Every numeric key of the records as a series over step (and over seconds since the first record), in
    step order: a score that arrived late (eval.backend, `verst eval`) is written after later steps' records."""
    t0 = next((r["time"] for r in records if isinstance(r.get("time"), (int, float))), None)
    series: dict[str, Series] = {}
    for rec in sorted(records, key=lambda r: r.get("step") if isinstance(r.get("step"), (int, float)) else 0):
        step, when = rec.get("step"), rec.get("time")
        rel = when - t0 if t0 is not None and isinstance(when, (int, float)) else None
        for key, value in rec.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            s = series.setdefault(key, Series(key, [], [], []))
            s.steps.append(step)
            s.values.append(float(value))
            s.times.append(rel)
    return series


# ---- units and formatting --------------------------------------------------------------------------
def unit_of(key: str) -> tuple[str, float]:
    """(unit label, scale) for a metric key: `_s` seconds, `_fraction`/`_ratio` in %, bytes in MB..."""
    for pattern, label, scale in UNITS:
        if re.search(pattern, key):
            return label, scale
    return "", 1.0


def format_value(key: str, value: Any) -> str:
    """A value with its unit: 0.885 for eval/accuracy is '88.5 %', 39.8 for time/total_s is '39.8 s'."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    label, scale = unit_of(key)
    v = value * scale
    if float(v).is_integer() and abs(v) < 1e15:
        text = f"{int(v):,}"
    elif abs(v) >= 1000:
        text = f"{v:,.0f}"
    else:
        text = f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return f"{text} {label}".rstrip()


def title_of(key: str) -> str:
    """'rollout/reward_mean' -> 'reward mean': the words a panel is titled with (the key shows beside)."""
    return key.split("/", 1)[-1].replace("/", " · ").replace("_", " ")


def axis_label(key: str) -> str:
    label, _ = unit_of(key)
    return label


# ---- smoothing and folding -------------------------------------------------------------------------
def ema(values: list[float], weight: float | None = None) -> list[float]:
    """Exponential moving average, debiased as TensorBoard's smoothing is (no pull towards 0 at the start).
    The default weight grows with the length: ~0.8 at 50 points, 0.95 from 200."""
    if weight is None:
        weight = 0.0 if len(values) < 10 else min(EMA_MAX_WEIGHT, 1 - 10 / len(values))
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = weight * last + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(last / norm if norm else v)
    return out


def thin(xs: list, ys: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """At most `limit` evenly spaced points, always keeping the last."""
    if len(xs) <= limit:
        return xs, ys
    stride = math.ceil(len(xs) / limit)
    idx = list(range(0, len(xs), stride))
    if idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def split_constant(runs: list[Run], keys: list[str]) -> tuple[list[str], list[str]]:
    """(keys to plot, keys folded into the constants table): a key is folded when it is constant in
    every run that logged it."""
    plotted, folded = [], []
    for key in keys:
        logged = [r.series[key] for r in runs if key in r.series]
        (folded if all(s.constant for s in logged) else plotted).append(key)
    return plotted, folded


def by_namespace(keys: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        groups.setdefault(key.split("/", 1)[0] if "/" in key else "other", []).append(key)
    return groups


# ---- where the time and the data go ----------------------------------------------------------------
# Per-step time components, in stacking order: (label, keys, first found wins).
TIME_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("generate", ("time/rollout_s",)),
    ("wait for data", ("perf/trainer_wait_s",)),
    ("old logprobs", ("time/logprob_s",)),
    ("train", ("time/train_s",)),
    ("weight sync", ("sync/seconds",)),
    ("eval", ("time/eval_s",)),
)
STEP_TIME_KEY = "perf/step_time_s"
OUTAGE_KEY = "time/engine_outage_s"  # seconds of a step while an engine was out (dead or hung, until it served again)
# What an engine outage holds up, first to last: the step's unexplained rest, generation, the weight sync.
OUTAGE_HOLDS = ("other", "generate", "weight sync")


def time_breakdown(run: Run) -> dict[str, dict[float, float]]:
    """Seconds per step of each component of TIME_PARTS the run logged, plus 'engine outage' (the step's
    seconds while an engine was out, taken from what it held up: the unexplained rest of the step, then
    generation, then the weight sync) and 'other' (the step time not covered by them). `time/train_s`
    includes the old-logprob pass, so 'train' is the rest of it."""
    parts: dict[str, dict[float, float]] = {}
    for label, keys in TIME_PARTS:
        s = run.get(*keys)
        if s is not None:
            parts[label] = dict(zip(s.steps, s.values))
    if "train" in parts and "old logprobs" in parts:
        old = parts["old logprobs"]
        parts["train"] = {k: max(0.0, v - old.get(k, 0.0)) for k, v in parts["train"].items()}
    total = run.get(STEP_TIME_KEY)
    if total is not None:
        # Evaluation runs beside the train steps in the RL schedules, so it is not part of a step's time.
        within = [p for label, p in parts.items() if label != "eval"]
        other = {k: t - sum(p.get(k, 0.0) for p in within) for k, t in zip(total.steps, total.values)}
        outage = run.get(OUTAGE_KEY)
        if outage is not None:
            parts["other"] = other
            parts["engine outage"] = _carve(parts, dict(zip(outage.steps, outage.values)), OUTAGE_HOLDS)
            other = parts.pop("other")
        if any(v > 1e-3 for v in other.values()):
            # Without a logged generate, wait or train part (SFT), the rest of the step is the train step.
            rest = "other" if {"generate", "wait for data", "train"} & set(parts) else "train step"
            parts[rest] = {k: max(0.0, v) for k, v in other.items()}
    return parts


# Whose threads compute each part of a step (the core budget's perf/*_threads, CPU runs).
PART_THREADS = {"generate": "perf/engine_threads", "wait for data": "perf/engine_threads",
                "old logprobs": "perf/trainer_threads", "train": "perf/trainer_threads"}


def part_threads(run: Run) -> dict[str, dict[float, float]]:
    """Per part of `time_breakdown`, the torch threads that computed it at each step (where logged)."""
    out = {}
    for label, key in PART_THREADS.items():
        s = run.get(key)
        if s is not None:
            out[label] = dict(zip(s.steps, s.values))
    return out


def _carve(parts: dict[str, dict[float, float]], seconds: dict[float, float],
           order: tuple[str, ...]) -> dict[float, float]:
    """Per step, up to `seconds` taken from the parts named in `order` (the first first), which shrink by it."""
    carved = {}
    for step, want in seconds.items():
        taken = 0.0
        for label in order:
            part = parts.get(label)
            if part is None or taken >= want:
                continue
            share = min(max(0.0, part.get(step, 0.0)), want - taken)
            part[step] = part.get(step, 0.0) - share
            taken += share
        carved[step] = taken
    return carved


def startup_phases(run: Run) -> dict[str, float]:
    """`time/startup/<phase>_s` as {phase: seconds}, plus 'total' (`time/startup_s`) when logged."""
    out = {k.removeprefix("time/startup/").removesuffix("_s"): s.values[-1]
           for k, s in run.series.items() if k.startswith("time/startup/")}
    if out and "time/startup_s" in run.series:
        out["total"] = run.series["time/startup_s"].values[-1]
    return out


def _last(run: Run, *keys: str) -> float:
    s = run.get(*keys)
    return s.values[-1] if s is not None else 0.0


def _sum(run: Run, *keys: str) -> float:
    s = run.get(*keys)
    return sum(s.values) if s is not None else 0.0


STALE_BY_LENGTH = re.compile(r"^buffer/dropped_stale_len_le_(\d+)_total$")


def stale_drops_by_length(run: Run) -> list[tuple[int, float]]:
    """Groups dropped as stale per length bucket, [(longest response at most, groups)], shortest first;
    a length bias from staleness (long trajectories going stale first) shows as weight on the right."""
    buckets = [(int(m.group(1)), s.values[-1]) for k, s in run.series.items() if (m := STALE_BY_LENGTH.match(k))]
    return sorted(buckets)


def funnel(run: Run) -> list[tuple[str, float]] | None:
    """Groups produced, each drop by reason, and groups trained on: [(stage, groups)], first the number
    produced, last the number trained; None when the run logged no rollout counts (SFT)."""
    zero_var = "dropped: zero-variance" if run.config.get("rollout", {}).get("dynamic_filter") == "zero_std" \
        else "dropped: filtered"
    if "rollout/groups_produced" in run.series or "rollout/groups_produced_total" in run.series:
        # Fully async: the producer's and the buffer's counters accumulate over the run.
        produced = _last(run, "rollout/groups_produced_total", "rollout/groups_produced")
        drops = [(zero_var, _last(run, "buffer/dropped_filtered_total", "buffer/dropped_filtered")),
                 ("dropped: stale", _last(run, "buffer/dropped_stale_total", "buffer/dropped_stale")),
                 ("dropped: aborted", _last(run, "buffer/dropped_aborted_total", "buffer/dropped_aborted")),
                 ("left in the buffer", _last(run, "buffer/queue_size"))]
    elif "rollout/launched_groups" in run.series:
        # Sync and one-step-off: per-step counts of the groups each rollout step launched.
        produced = _sum(run, "rollout/launched_groups")
        drops = [(zero_var, _sum(run, "rollout/filtered_groups")),
                 ("dropped: failed", _sum(run, "rollout/failed_groups")),
                 ("dropped: aborted or surplus", _sum(run, "rollout/aborted_groups"))]
    else:
        return None
    drops = [(label, n) for label, n in drops if n]
    trained = (_sum(run, "rollout/kept_groups") if "rollout/kept_groups" in run.series
               else produced - sum(n for _, n in drops))
    return [("produced", produced), *drops, ("trained on", trained)]


def truncated_fraction(run: Run) -> float | None:
    """Mean share of trained samples cut at max_response_tokens (trained on, but never finished)."""
    s = run.get("rollout/truncated_ratio")
    return sum(s.values) / len(s.values) if s is not None and s.values else None


# ---- lineage: the SFT run an RL run started from ---------------------------------------------------
def parent_run_dir(run_dir: Path, config: dict[str, Any]) -> Path | None:
    """The run directory whose `hf` export is this run's model.path, if it still holds a run: a sibling
    directory of that name first (runs copied or moved together), else the path itself."""
    model = Path(str((config.get("model") or {}).get("path") or ""))
    if model.name != "hf":
        return None
    for candidate in (run_dir.parent / model.parent.name, model.parent):
        if (candidate / CONFIG_FILE).exists() and candidate.resolve() != run_dir.resolve():
            return candidate
    return None


def child_run_dirs(run_dir: Path) -> list[Path]:
    """Sibling run directories whose model is this run's `hf` export."""
    children = []
    for config_file in sorted(run_dir.parent.glob(f"*/{CONFIG_FILE}")):
        other = config_file.parent
        if other.resolve() == run_dir.resolve():
            continue
        try:
            config = yaml.safe_load(config_file.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        parent = parent_run_dir(other, config if isinstance(config, dict) else {})
        if parent is not None and parent.resolve() == run_dir.resolve():
            children.append(other)
    return children


# ---- throughput ------------------------------------------------------------------------------------
def samples_per_train_step(run: Run) -> int | None:
    """Samples one optimizer step consumes, from the config: sft.batch_size in SFT runs, else the RL
    global batch (trainer.global_batch_size, or rollout.batch_size × n_samples_per_prompt)."""
    cfg = run.config
    if not cfg:
        return None
    if "rollout/reward_mean" not in run.series and "sft" in cfg:
        return (cfg.get("sft") or {}).get("batch_size")
    rollout, trainer = cfg.get("rollout") or {}, cfg.get("trainer") or {}
    if trainer.get("global_batch_size"):
        return trainer["global_batch_size"]
    if rollout.get("batch_size") and rollout.get("n_samples_per_prompt"):
        return rollout["batch_size"] * rollout["n_samples_per_prompt"]
    return None


def samples_per_s(run: Run) -> dict[str, Series]:
    """Samples/s, per step: 'train' (samples per optimizer step / step time) and 'rollout' (the growth of
    the producer's cumulative sample count over wall-clock time, or samples per rollout / rollout time)."""
    out: dict[str, Series] = {}
    step_time, per_step = run.get(STEP_TIME_KEY), samples_per_train_step(run)
    if step_time is not None and per_step:
        pairs = [(x, per_step / t, w) for x, t, w in zip(step_time.steps, step_time.values, step_time.times) if t > 0]
        out["train"] = Series("perf/train_samples_per_s", *map(list, zip(*pairs))) if pairs else None
    produced = run.get("rollout/samples_produced_total", "rollout/samples_produced")
    rollout_time = run.get("time/rollout_s")
    if produced is not None:
        pts = list(zip(produced.steps, produced.values, produced.times))
        rates = [(b[0], (b[1] - a[1]) / (b[2] - a[2]), b[2]) for a, b in zip(pts, pts[1:])
                 if a[2] is not None and b[2] is not None and b[2] > a[2]]
        out["rollout"] = Series("perf/rollout_samples_per_s", *map(list, zip(*rates))) if rates else None
    elif rollout_time is not None and "rollout/launched_groups" in run.series:
        n = (run.config.get("rollout") or {}).get("n_samples_per_prompt") or 1
        launched = dict(zip(run.series["rollout/launched_groups"].steps, run.series["rollout/launched_groups"].values))
        pairs = [(x, launched.get(x, 0) * n / t, w)
                 for x, t, w in zip(rollout_time.steps, rollout_time.values, rollout_time.times) if t > 0]
        out["rollout"] = Series("perf/rollout_samples_per_s", *map(list, zip(*pairs))) if pairs else None
    return {k: v for k, v in out.items() if v is not None}
