"""Engine recovery: an RL run (sync schedule, tiny model, two engines behind the router, disk weight
transport) has one engine killed (SIGKILL of its server) after a few steps; the run restarts it in place.

Reported: seconds from the kill until the engine is back behind the router serving the current weight
version, against the engines' own start-up in the same run (`time/startup/engines_s`); target ≤ 1.5×.

    .venv/bin/python bench/recovery.py [--rollouts 8] [--kill-after-step 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

TARGET_RATIO = 1.5


def config(work: Path, model: Path, data: Path, rollouts: int):
    from verst.config import load_config

    return load_config(None, [
        "--name", "recovery", "--run-dir", str(work / "run"), "--overwrite", "true",
        "--model.path", str(model), "--data.train-path", str(data / "train.jsonl"),
        "--data.test-path", str(data / "test.jsonl"), "--data.apply-chat-template", "false",
        "--schedule", "sync", "--cluster.placement", "disaggregated", "--cluster.num-engines", "2",
        "--sync.transport", "disk", "--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4",
        "--rollout.num-rollouts", str(rollouts), "--rollout.max-response-tokens", "4", "--trainer.lr", "1e-4",
        "--eval.max-prompts", "8", "--logging.tensorboard", "false", "--logging.progress", "false",
        "--fault.health-interval-s", "0.5",
    ])


def processes(run_dir: Path) -> dict[str, dict]:
    return {entry["name"].split(" (")[0]: entry for entry in json.loads((run_dir / "processes.json").read_text())}


def url_of(entry: dict) -> str:
    return entry["name"].split("(", 1)[1].rstrip(")")


def trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((r["step"] for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r), default=0)


def measure_recovery(router: str, engine: str, pid: int, running: threading.Thread) -> dict[str, float] | None:
    """Kill the engine's server; poll the router's worker list until it is gone and back, and the engine
    until it answers with a weight version at least the one served at the kill. None when the run ended."""
    version = httpx.get(f"{engine}/get_weight_version", timeout=10).json()["weight_version"]
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    removed = serving = admitted = None
    while admitted is None and time.perf_counter() - killed < 300:
        if not running.is_alive():
            return None
        now = time.perf_counter() - killed
        try:
            workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
        except httpx.HTTPError:
            continue
        listed = {w.get("url", "").rstrip("/") for w in workers}
        if removed is None and engine not in listed:
            removed = now
        if serving is None:
            try:
                served = httpx.get(f"{engine}/get_weight_version", timeout=1).json()["weight_version"]
                serving = now if int(served) >= int(version) else None
            except httpx.HTTPError:
                pass
        if removed is not None and engine in listed and serving is not None:
            admitted = now
        time.sleep(0.05)
    if admitted is None:
        raise RuntimeError("the killed engine was not admitted again within 300 s")
    return {"version_at_kill": float(version), "removed_s": removed, "serving_s": serving, "admitted_s": admitted}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--kill-after-step", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from verst.data import make_splits, write_jsonl
    from verst.models import init_model
    from verst.monitor import read_metrics
    from verst.schedules import SCHEDULES

    with tempfile.TemporaryDirectory(prefix="verst-recovery-") as tmp:
        work = args.workdir or Path(tmp)
        model = init_model("qwen3", "tiny", work / "model", seed=0)
        train, test = make_splits("addition", n_train=2000, n_test=100, seed=0)
        write_jsonl(train, work / "data" / "train.jsonl")
        write_jsonl(test, work / "data" / "test.jsonl")
        cfg = config(work, model, work / "data", args.rollouts)
        run_dir, outcome = Path(cfg.run_dir), {}

        def run() -> None:
            try:
                outcome["summary"] = asyncio.run(SCHEDULES[cfg.schedule](cfg))
            except BaseException as error:  # reported below
                outcome["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while trained_steps(run_dir) < args.kill_after_step and thread.is_alive():
            time.sleep(0.2)
        if not thread.is_alive():
            raise RuntimeError(f"the run ended before step {args.kill_after_step}: {outcome.get('error')!r}")
        found = processes(run_dir)
        times = measure_recovery(url_of(found["router"]), url_of(found["engine 1"]), found["engine 1"]["pid"], thread)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        assert times is not None
        records = read_metrics(run_dir)
        startup = next(r["time/startup/engines_s"] for r in records if "time/startup/engines_s" in r)
        recovery = [r["fault/recovery_seconds"] for r in records if "fault/recovery_seconds" in r]
        retried = max((r.get("fault/requests_retried_total", 0) for r in records), default=0)
    print(f"steps trained: {outcome['summary']['train/steps']} of {args.rollouts}; engine 1 killed at weight "
          f"version {times['version_at_kill']:.0f}")
    print(f"engines' start-up in this run (two at once): {startup:.1f} s")
    print(f"kill -> out of the router: {times['removed_s']:.1f} s; -> serving the current version: "
          f"{times['serving_s']:.1f} s; -> back behind the router: {times['admitted_s']:.1f} s")
    print(f"the run's own fault/recovery_seconds (removal to re-admission): {recovery[0]:.1f} s; "
          f"generations sent again: {retried:.0f}")
    ratio = times["admitted_s"] / startup
    print(f"recovery / start-up: {ratio:.2f}x (target <= {TARGET_RATIO}x): {'met' if ratio <= TARGET_RATIO else 'missed'}")
    return 0


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    sys.exit(report_peaks(main))
