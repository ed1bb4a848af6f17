"""The scale summary of a simulated run (RUN/scale.json): the control plane's CPU per trajectory and per engine
request, how busy the engines were, the simulated step time, each weight push's time beyond its modelled
transfer, the faults and the accounting of every served group; and its lines for the terminal."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.sim.config import SimConfig

CONTROL = ("driver", "rollout_manager", "router")  # the control plane's parts (the client runs in the manager)


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def scale_summary(cfg: VerstConfig, sim: SimConfig, measured: dict[str, Any], run_dir: Path,
                  accounting: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """`measured`: what the run's recorder took (CPU seconds by part, the engines' window, the faults);
    `accounting(dropped_in_steps)`: the ledger's report."""
    rows = read_rows(run_dir / "metrics.jsonl")
    dropped = sum(r.get("rollout/filtered_groups", 0) + r.get("rollout/failed_groups", 0)
                  + r.get("rollout/aborted_groups", 0) - r.get("rollout/returned_groups", 0) for r in rows)
    ledger = accounting(int(dropped))
    n = cfg.rollout.n_samples_per_prompt
    groups = ledger["trained"] + sum(ledger["discarded"].values()) + ledger["queued"] + ledger["dropped_in_steps"]
    cpu, engines = measured["cpu_s"], measured["engines"]
    control = sum(cpu.get(part, 0.0) for part in CONTROL)
    requests = max(engines["requests"], 1.0)
    # in the window: a single-turn trajectory makes one request; agentic ones are counted as their agents end
    trajectories = max(measured["agent_trajectories"], 1) if sim.agent_turns else requests
    steps = [r["perf/step_time_s"] * sim.speedup for r in rows if "perf/step_time_s" in r]
    return {
        "engines": cfg.cluster.num_engines, "fleet_processes": sim.fleet_processes,
        "trainer_ranks": cfg.cluster.trainer_ranks, "schedule": cfg.schedule, "speedup": sim.speedup,
        "max_in_flight": cfg.rollout.max_in_flight, "agent_turns": sim.agent_turns,
        "trajectories": groups * n, "engine_requests": engines["requests"], "trajectories_in_window": trajectories,
        "cpu_s": cpu, "load_average": measured["load_average"],
        "control_ms_per_trajectory": 1000 * control / trajectories,
        "control_ms_per_request": 1000 * control / requests,
        "cpu_ms_per_request": {part: 1000 * seconds / requests for part, seconds in cpu.items() if part != "wall"},
        "engine_busy_fraction": engines["busy_fraction"], "engine_paused_fraction": engines["paused_fraction"],
        "engine_mean_batch": engines["mean_batch"],
        "step_sim_s": {"median": statistics.median(steps), "max": max(steps)} if steps else None,
        "train_step_sim_s": _median(measured["train_step_sim_s"]),
        "sync": sync_overhead(rows, sim),
        "driver_rss_bytes": measured["driver_rss_bytes"],
        "faults": measured["faults"], "accounting": ledger,
    }


def sync_overhead(rows: list[dict[str, Any]], sim: SimConfig) -> dict[str, Any] | None:
    """Each push's wall seconds beyond its modelled transfer (the engines load their buckets in turn, all
    engines at once: bytes over one engine's link), the median and the worst."""
    pushes = [(r["sync/seconds"], r.get("sync/bytes", 0.0)) for r in rows if "sync/seconds" in r]
    if not pushes:
        return None
    over = [seconds - nbytes / sim.load_bytes_per_s / sim.speedup for seconds, nbytes in pushes]
    return {"pushes": len(pushes), "median_s": statistics.median(s for s, _ in pushes),
            "modelled_transfer_s": pushes[0][1] / sim.load_bytes_per_s / sim.speedup,
            "overhead_median_s": statistics.median(over), "overhead_max_s": max(over)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def scale_lines(summary: dict[str, Any]) -> list[str]:
    """The summary for the terminal, a few lines."""
    acc, faults = summary["accounting"], summary["faults"]
    lines = [
        f"{summary['engines']} simulated engines, {summary['trajectories']} trajectories "
        f"({summary['engine_requests']:.0f} engine requests), speed-up {summary['speedup']:g}",
        f"control plane: {summary['control_ms_per_trajectory']:.2f} ms CPU per trajectory, "
        f"{summary['control_ms_per_request']:.2f} ms per engine request "
        f"(load average {summary['load_average'][0]:.1f} -> {summary['load_average'][1]:.1f})",
        f"engines busy {summary['engine_busy_fraction']:.1%} of the time they could be (paused for weight pushes "
        f"{summary['engine_paused_fraction']:.1%}), mean batch {summary['engine_mean_batch']:.1f}",
    ]
    if summary["step_sim_s"]:
        lines.append(f"step time {summary['step_sim_s']['median']:.1f} s simulated (median)")
    if summary["sync"]:
        sync = summary["sync"]
        lines.append(f"{sync['pushes']} weight pushes: {sync['median_s']:.2f} s wall (median), "
                     f"{sync['overhead_median_s']:.2f} s beyond the modelled transfer")
    struck = {k: v for k, v in faults.items() if k not in ("events", "engine_restarts") and v}
    if struck:
        lines.append(f"faults: {struck}; {faults['engine_restarts']} engine restarts")
    verdict = "exact" if not acc["problems"] else "; ".join(acc["problems"])
    lines.append(f"accounting ({verdict}): {acc['served']} groups served, {acc['trained']} trained, discarded "
                 f"{acc['discarded'] or 'none'}, {acc['returned']} returned, {acc['queued']} queued, "
                 f"{acc['dropped_in_steps']} dropped in rollout steps, {acc['unfinished']} unfinished")
    return lines
