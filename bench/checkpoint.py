"""Checkpoint cost of the trainer state: save and load time of the FSDP2 backend's state (model,
optimizer, schedule, RNG) for the tiny and small models, and the pause a save causes as a fraction
of one train step. Target: the pause <= 10% of a step.

`save`: a synchronous save and commit (SFT's). `pause`: what an RL run waits for, the synchronous part of
a background save (the state-dict views, the RNG and schedule files); `copy`: until its thread has copied
the shards, which the next train step waits for (in an RL run generation usually covers it: the pause is
then all a save costs; a train step that follows at once waits for the copy too); `bg`: the rest, written
by threads while training goes on (the shards, then the fsync, rename and `latest`). The step is a train
step of 16 RL-shaped sequences alone, without generation, so the fractions are upper bounds of an RL step's.

    .venv/bin/python bench/checkpoint.py [--arch qwen3] [--steps 4] [--saves 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_throughput import make_batch  # noqa: E402
from verst.config.schema import ModelConfig, TrainerConfig  # noqa: E402
from verst.models.factory import init_model  # noqa: E402
from verst.monitor import checkpoint_dirs as layout  # noqa: E402
from verst.trainer import FSDP2Backend, sft_loss_fn  # noqa: E402


def measure(arch: str, size: str, steps: int, saves: int, work: Path) -> dict[str, float]:
    model_dir = init_model(arch, size, work / f"{arch}-{size}", seed=0)
    backend = FSDP2Backend(ModelConfig(path=str(model_dir)), TrainerConfig(lr=1e-4), device="cpu")
    items = make_batch(16, seed=0, vocab=backend.model.config.vocab_size)
    backend.train_step(items, sft_loss_fn)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        backend.train_step(items, sft_loss_fn)
    step_s = (time.perf_counter() - start) / steps
    run_dir = work / f"run-{size}"
    out: dict[str, list[float]] = {"save_s": [], "pause_s": [], "copy_s": [], "background_s": [], "load_s": []}
    for i in range(saves):
        tmp = layout.new_tmp_dir(run_dir, 2 * i)
        t0 = time.perf_counter()
        backend.save(tmp / layout.TRAINER_DIR)  # synchronous: SFT's save
        t1 = time.perf_counter()
        final = layout.commit(tmp, {"step": i}, keep_last=1)
        t2 = time.perf_counter()
        backend.load(final / layout.TRAINER_DIR)
        t3 = time.perf_counter()
        tmp = layout.new_tmp_dir(run_dir, 2 * i + 1)
        t4 = time.perf_counter()
        backend.save(tmp / layout.TRAINER_DIR, background=True)  # an RL run's: the pause ends here
        t5 = time.perf_counter()
        backend._wait_staged()  # what a train step started at once would wait for
        t_copy = time.perf_counter()
        backend.wait_saves()
        layout.wait_trainer_writes(tmp / layout.TRAINER_DIR, ranks=1, step=i)
        layout.commit(tmp, {"step": i}, keep_last=1)
        t6 = time.perf_counter()
        out["save_s"].append(t1 - t0 + t2 - t1)
        out["load_s"].append(t3 - t2)
        out["pause_s"].append(t5 - t4)
        out["copy_s"].append(t_copy - t4)
        out["background_s"].append(t6 - t5)
    latest = layout.read_latest(run_dir) / layout.TRAINER_DIR
    size_mb = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file()) / 2**20
    params = sum(p.numel() for p in backend.model.parameters())
    return {"params": params, "step_s": step_s, "size_mb": size_mb, **{k: min(v) for k, v in out.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="verst-bench-ckpt-") as work:
        rows = {size: measure(args.arch, size, args.steps, args.saves, Path(work)) for size in ("tiny", "small")}
    print(f"{'model':<8}{'params':>10}{'state MB':>10}{'step s':>8}{'save s':>8}{'load s':>8}{'pause s':>9}"
          f"{'copy s':>8}{'bg s':>7}{'save/step':>11}{'pause/step':>12}{'copy/step':>11}{'load/step':>11}")
    for size, r in rows.items():
        print(f"{size:<8}{r['params']:>10,}{r['size_mb']:>10.1f}{r['step_s']:>8.3f}{r['save_s']:>8.3f}"
              f"{r['load_s']:>8.3f}{r['pause_s']:>9.3f}{r['copy_s']:>8.3f}{r['background_s']:>7.3f}"
              f"{r['save_s'] / r['step_s']:>11.2f}{r['pause_s'] / r['step_s']:>12.2f}"
              f"{r['copy_s'] / r['step_s']:>11.2f}{r['load_s'] / r['step_s']:>11.2f}")
    worst = max(r["pause_s"] / r["step_s"] for r in rows.values())
    print(f"pause of a background save / train step, worst: {worst:.2f} (target <= 0.10)")


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    report_peaks(main)
