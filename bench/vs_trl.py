"""verst (sync and fully async) vs TRL's GRPOTrainer: wall time to the same held-out greedy accuracy,
measured in one run. Target: verst fully async >= 3x faster than TRL (start-up included), at equal cores.

Two tasks (--task): `chain_addition` (the default), the long-tailed variant of make demo's task
(recipes/grpo_chain_addition.toml: '12+34+56=' -> '46,102', 80% two terms, 5% 8-12 terms, answers of 2 to
~45 tokens), the workload asynchronous RL is built for; and `addition`, make demo's own (answers of 2-4
tokens: a whole TRL run is a few seconds of training after its start-up, which no multi-process system halves).
All three sides start from the same SFT checkpoint and read the task's RL recipe at run time:
model, prompts (raw text), reward, 16 prompts x 8 samples, one optimizer step per batch, lr and warm-up
(TRL steps with verst's own AdamW and schedule), temperature, max response tokens, no KL. Every side
measures the same 200 held-out prompts greedily every --eval-interval steps (verst through its engines,
TRL with HF `generate`, both scored by verst's reward fn) and stops at the first evaluation after step 0
that reaches the target (default: the SFT checkpoint's accuracy + 15 points), or at --max-steps /
--time-cap ("not reached"). The differences that remain are each system's own: verst's recipe filters
zero-variance groups (DAPO), trains in token-budget micro-batches and, fully async, trains on groups up
to one version stale; TRL trains on every group of each batch, on-policy, padded to the longest
completion, generating with HF `generate` in the training process.
Clock: each side's starts when its process is launched, so imports count on both sides (verst's actors
import torch and transformers too). Cores: each side gets the same --cores (default: all this process may
run on), its processes pinned to them (Ray and its actors included); TRL's single process computes with one
torch thread per core, verst divides them with its core budget (docs/cluster.md).
TRL is pip-installed into this venv when missing, with torch and transformers pinned to the installed
versions (a bench dependency only). The SFT checkpoint (--sft-checkpoint, else the task's last SFT
recipe's run, runs/sft-addition/hf for addition, else the task's SFT stages trained here into
--work-dir) is copied into --work-dir first, so a concurrent `make demo` cannot change it mid-run.

    .venv/bin/python bench/vs_trl.py [--task chain_addition|addition] [--sft-checkpoint DIR] [--target 0.62]
        [--eval-interval 5] [--max-steps 100] [--time-cap 900] [--sides trl,sync,fully_async] [--cores N]
        [--out r.json]

`--model smollm2` (SmolLM2-135M-Instruct; or `--model PATH`, any HF checkpoint directory) compares instead
the seconds per optimizer step on a real model (bench/_step_time.py: single-digit sums through its chat
template, 4 prompts x 8 samples, 8 new tokens), verst fully async against TRL by default, over --steps
steps after --warmup, --repeats times (alternating sides; each run and the spread reported), full
fine-tuning or `--lora` on both sides, with the peak memory of every process (driver, trainer rank, engine,
rollout manager):

    .venv/bin/python bench/vs_trl.py --model smollm2 [--warmup 2] [--steps 5] [--prompts 4] [--samples 8]
        [--max-new-tokens 8] [--sides trl,fully_async] [--lora] [--repeats 3] [--cores N] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' weight-loading bars, here and in the sides
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from _cores import bench_cores, describe, pinned_to  # noqa: E402

# task -> (RL recipe, SFT stages, each starting from the previous stage's export): addition is make demo's
# task (answers of 2-4 tokens); chain_addition its long-tailed variant (answers of 2 to ~45 tokens), the
# workload asynchronous RL is built for, whose warm start first learns 2-term sums.
TASKS = {
    "addition": ("grpo_addition.toml", ("sft_addition.toml",)),
    "chain_addition": ("grpo_chain_addition.toml", ("sft_addition.toml", "sft_chain_addition.toml")),
}
SIDES = ("trl", "sync", "fully_async")
SPEEDUP_TARGET = 3.0  # verst fully async vs TRL, wall time to target with start-up


# ---- pure helpers (tested in tests/unit/test_bench_vs_trl.py) -------------------------------------
def time_to_target(result: dict[str, Any], target: float) -> dict[str, Any]:
    """When a side first reached `target`: steps, wall seconds from its launch (start-up included) and
    from the end of its step-0 evaluation (start-up excluded), plus start-up and seconds per step (the
    evaluations in between included). Step 0 never counts as reaching it."""
    evals = sorted(result["evals"], key=lambda e: e["step"])
    if not evals or evals[0]["step"] != 0:
        raise ValueError(f"a side's evaluations must start at step 0, got steps {[e['step'] for e in evals]}")
    first = evals[0]
    startup = first["time"] - result["started"]
    hit = next((e for e in evals if e["step"] > 0 and e["accuracy"] >= target), None)
    last = hit or evals[-1]
    trained = last["time"] - first["time"]
    out = {
        "accuracy_step0": first["accuracy"], "startup_s": startup, "imports_s": result.get("imports_s"),
        "steps_run": result["steps"],
        "best_accuracy": max(e["accuracy"] for e in evals), "reached": hit is not None,
        "s_per_step": trained / last["step"] if last["step"] else None,
        "eval_s_to_target": sum(e.get("eval_s", 0.0) for e in evals if e["step"] <= last["step"]),
        "steps": None, "wall_s": None, "wall_s_after_startup": None,
    }
    if hit is not None:
        out.update(steps=hit["step"], accuracy=hit["accuracy"], wall_s=hit["time"] - result["started"],
                   wall_s_after_startup=trained)
    return out


def speedups(sides: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """TRL's wall time to target over each verst schedule's (with and without start-up); None when
    either side did not reach the target."""
    trl = sides.get("trl")
    out = {}
    for name in ("sync", "fully_async"):
        if trl is None or name not in sides:
            continue
        out[name] = {key: (trl[key] / sides[name][key] if trl[key] and sides[name][key] else None)
                     for key in ("wall_s", "wall_s_after_startup")}
    return out


def format_table(sides: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float | None]]) -> str:
    """One row per side: accuracy at step 0, steps and accuracy at the target, wall seconds with and
    without start-up, start-up, seconds per step, and TRL's wall time over this side's."""

    def num(value: float | None, fmt: str, suffix: str = "") -> str:
        return "-" if value is None else format(value, fmt) + suffix

    columns = ("side", "acc@0", "steps", "acc", "wall s", "w/o start-up", "start-up s", "s/step",
               "TRL/side", "w/o start-up")
    rows = [columns]
    for name, s in sides.items():
        ratio = ratios.get(name, {})
        rows.append((
            name, num(s["accuracy_step0"], ".1%"),
            str(s["steps"]) if s["reached"] else f">{s['steps_run']}",
            num(s.get("accuracy", s["best_accuracy"]), ".1%"),
            num(s["wall_s"], ".1f") if s["reached"] else "not reached",
            num(s["wall_s_after_startup"], ".1f"), num(s["startup_s"], ".1f"), num(s["s_per_step"], ".2f"),
            num(ratio.get("wall_s"), ".2f", "x"), num(ratio.get("wall_s_after_startup"), ".2f", "x"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def verdict(ratios: dict[str, dict[str, float | None]]) -> str:
    ratio = ratios.get("fully_async", {}).get("wall_s")
    if ratio is None:
        return f"fully async >= {SPEEDUP_TARGET:.0f}x faster than TRL: not measured (a side did not reach the target)"
    met = "met" if ratio >= SPEEDUP_TARGET else "NOT met"
    return f"fully async vs TRL: {ratio:.2f}x (target >= {SPEEDUP_TARGET:.0f}x): {met}"


# ---- set-up ----------------------------------------------------------------------------------------
def ensure_trl(spec: str) -> str:
    """trl's version; installs `spec` into this venv first when trl is missing, keeping torch and
    transformers at their installed versions (fails loudly if they would change)."""
    try:
        import trl

        return trl.__version__
    except ImportError:
        pass
    import torch
    import transformers

    before = {"torch": torch.__version__, "transformers": transformers.__version__}
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write("".join(f"{name}=={version}\n" for name, version in before.items()))
    print(f"[vs_trl] installing {spec} (torch {before['torch']}, transformers {before['transformers']} kept)",
          flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec, "-c", str(ROOT / "constraints.txt"),
                    "-c", pins.name], check=True, cwd=ROOT)
    os.unlink(pins.name)
    probe = "import json, torch, transformers, trl; print(json.dumps([torch.__version__, transformers.__version__, trl.__version__]))"
    torch_v, transformers_v, trl_v = json.loads(subprocess.check_output([sys.executable, "-c", probe], text=True))
    if (torch_v, transformers_v) != (before["torch"], before["transformers"]):
        raise RuntimeError(f"installing {spec} changed torch/transformers: {before} -> {torch_v}, {transformers_v}")
    return trl_v


def recipes(task: str) -> tuple[Path, list[Path]]:
    """The task's RL recipe file and its SFT stages' recipe files, in order."""
    rl, sft = TASKS[task]
    return ROOT / "recipes" / rl, [ROOT / "recipes" / name for name in sft]


def sft_checkpoint(path: str | None, work_dir: Path, task: str) -> Path:
    """A private copy (work_dir/checkpoint) of the SFT export every side starts from: `path`, else the last
    SFT stage's own run (runs/sft-addition/hf for make demo's), else the stages this bench trains into
    work_dir/<stage's run name> (each from the previous one's export, the first from its recipe's model).
    The copy keeps the sides on one checkpoint while `make demo` may rewrite the demo's."""
    from verst.config import load_config

    stages = recipes(task)[1]
    source = Path(path) if path else ROOT / "runs" / load_config(stages[-1]).name / "hf"
    if path is None and not (source / "config.json").exists():
        from examples.demo import make_artifacts
        from verst.schedules.sft import run_sft

        for data in dict.fromkeys(("addition", task)):  # every task's first stage is sft_addition
            make_artifacts(data)
        previous: list[str] = []
        for stage in stages:
            run_dir = work_dir / load_config(stage).name
            if not (run_dir / "hf" / "config.json").exists():
                run_sft(load_config(stage, previous + ["--run-dir", str(run_dir), "--overwrite",
                                                        "--logging.tensorboard", "false"]))
            previous, source = ["--model.path", str(run_dir / "hf")], run_dir / "hf"
    if not (source / "config.json").exists() or not list(source.glob("*.safetensors")):
        raise FileNotFoundError(f"SFT checkpoint {source}: no config.json or *.safetensors (expected an HF export)")
    copy = work_dir / "checkpoint"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source, copy)
    print(f"[vs_trl] SFT checkpoint: {source.resolve()} (copied to {copy})", flush=True)
    return copy


def side_config(side: str, checkpoint: Path, args: argparse.Namespace):
    """The GRPO recipe with the bench's overrides: checkpoint, schedule, run dir, eval interval, step cap."""
    from verst.config import batch_plan, load_config

    overrides = ["--model.path", str(checkpoint), "--eval.interval", str(args.eval_interval),
                 "--logging.progress", "false", "--logging.tensorboard", "false"]
    rl_recipe = recipes(args.task)[0]
    cfg = load_config(rl_recipe, overrides)
    per_rollout = batch_plan(cfg).train_steps_per_rollout
    if args.max_steps % per_rollout:
        raise ValueError(f"--max-steps {args.max_steps} is not a multiple of the recipe's {per_rollout} train "
                         "steps per rollout")
    schedule = side if side != "trl" else cfg.schedule
    run_dir = Path(args.work_dir).resolve() / side
    return load_config(rl_recipe, overrides + [
        "--schedule", schedule, "--name", f"vs-trl-{side}", "--run-dir", str(run_dir),
        "--rollout.num-rollouts", str(args.max_steps // per_rollout)])


def measure_accuracy(checkpoint: Path, args: argparse.Namespace) -> float:
    """The checkpoint's held-out greedy accuracy, scored as every side scores it."""
    import torch

    from verst.data import load_prompts_from_config
    from verst.eval import evaluate_greedy, hf_greedy_generate
    from verst.models import load_model, load_tokenizer

    torch.set_num_threads(1)
    cfg = side_config("trl", checkpoint, args)
    tokenizer, model = load_tokenizer(str(checkpoint)), load_model(str(checkpoint))
    test = load_prompts_from_config(cfg.data.model_copy(update={"test_path": cfg.eval.path or cfg.data.test_path}),
                                    "test")[: cfg.eval.max_prompts]
    max_new = cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens
    generate = hf_greedy_generate(model, tokenizer, max_new, cfg.eval.batch_size)
    return evaluate_greedy(test, generate, tokenizer, cfg.reward, cfg.data, max_new)["eval/accuracy"]


# ---- the sides, each in its own process --------------------------------------------------------------
def run_side(side: str, checkpoint: Path, target: float, args: argparse.Namespace) -> dict[str, Any]:
    """Run one side in a child process (its own threads, Ray and clean exit); returns its timed evals."""
    out = Path(args.work_dir).resolve() / f"{side}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(len(args.cores)), "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore::FutureWarning"}
    cmd = [sys.executable, __file__, "--side", side, "--side-out", str(out), "--sft-checkpoint", str(checkpoint),
           "--target", str(target), "--eval-interval", str(args.eval_interval), "--max-steps", str(args.max_steps),
           "--time-cap", str(args.time_cap), "--cores", str(len(args.cores)), "--work-dir", args.work_dir,
           "--task", args.task]
    if args.model:  # the real-model mode: the resolved checkpoint and the step counts and batch shape
        cmd += ["--model", str(checkpoint), "--warmup", str(args.warmup), "--steps", str(args.steps), "--prompts",
                str(args.prompts), "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)]
        cmd += ["--lora"] if args.lora else []
    load = os.getloadavg()[0]
    log = out.with_suffix(".log")
    print(f"[vs_trl] == {side} (load average {load:.2f}; log {log})", flush=True)
    launched = time.time()  # every side's clock starts at its launch: imports count, on both sides
    with open(log, "w") as sink:
        # Both sides on the same cores: the child and everything it starts (Ray, the actors) run on them.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=pinned_to(args.cores))
        # A last resort for a side that hangs past its own time cap (e.g. in teardown).
        watchdog = threading.Timer(args.time_cap + 600, proc.kill)
        watchdog.start()
        for line in proc.stdout:  # the log keeps everything; the console only the sides' own lines
            sink.write(line)
            if line.startswith(("[trl]", f"[{side}]", "[vs_trl]")):
                print("  " + line, end="", flush=True)
        code = proc.wait()
        watchdog.cancel()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"side {side} exited with {code}; last lines of {log}:\n{tail}")
    result = json.loads(out.read_text())
    result["imports_s"], result["started"] = result["started"] - launched, launched
    result["load_before"], result["load_after"] = load, os.getloadavg()[0]
    return result


def side_main(args: argparse.Namespace) -> int:
    """Child process: run `args.side` and write its result JSON."""
    checkpoint = Path(args.sft_checkpoint)
    if args.model:
        from _step_time import side_main as step_time_side

        Path(args.side_out).write_text(json.dumps(step_time_side(args, args.side, checkpoint), indent=1) + "\n")
        return 0
    cfg = side_config(args.side, checkpoint, args)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # metrics.jsonl appends: start from an empty run directory
    if args.side == "trl":
        import trl
        from _trl_side import run_trl

        result = run_trl(cfg, target=args.target, max_steps=args.max_steps, time_cap_s=args.time_cap,
                         eval_interval=args.eval_interval, threads=len(args.cores), out_dir=cfg.run_dir)
        result["version"] = f"trl {trl.__version__}"
    else:
        from _verst_side import run_verst

        result = run_verst(cfg, target=args.target, time_cap_s=args.time_cap)
        result["version"] = f"verst {cfg.schedule}"
    Path(args.side_out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="verst (sync, fully async) vs TRL's GRPOTrainer: wall time to "
                                     "the same held-out greedy accuracy from the same SFT checkpoint")
    parser.add_argument("--sft-checkpoint", help="HF export dir of the SFT model (default: the task's last SFT "
                        "recipe's export, runs/<its name>/hf, if present, else its SFT stages trained into WORK_DIR)")
    parser.add_argument("--target", type=float, help="held-out greedy accuracy to reach (default: SFT + 0.15)")
    parser.add_argument("--eval-interval", type=int, default=5, help="evaluate every N optimizer steps")
    parser.add_argument("--max-steps", type=int, default=100, help="step cap of each side")
    parser.add_argument("--time-cap", type=float, help="wall-time cap of each side in seconds (default 900; "
                        "with --model 3600)")
    parser.add_argument("--sides", help="comma-separated subset of " + ",".join(SIDES) + " (default: all; with "
                        "--model: trl,fully_async)")
    parser.add_argument("--cores", type=int, default=None, help="CPU cores each side gets (default: all this "
                        "process may run on): TRL one torch thread per core in its process, verst its core budget "
                        "over them; each side's processes pinned to them")
    parser.add_argument("--trl-spec", default="trl", help="pip requirement installed when trl is missing")
    parser.add_argument("--task", choices=sorted(TASKS), default="chain_addition",
                        help="chain_addition: the long-tailed variant of make demo's task (2 to ~45 answer tokens); "
                        "addition: make demo's task (2-4 answer tokens)")
    parser.add_argument("--work-dir", help="run directories of the sides (default: runs/vs-trl/TASK)")
    parser.add_argument("--out", help="write the measurements as JSON here")
    parser.add_argument("--model", help="seconds per step on a real model instead: smollm2 or a checkpoint dir")
    parser.add_argument("--warmup", type=int, default=2, help="--model: untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="--model: timed steps")
    parser.add_argument("--prompts", type=int, default=4, help="--model: prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="--model: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="--model: response limit")
    parser.add_argument("--lora", action="store_true", help="--model: both sides train LoRA adapters (rank 8, "
                        "alpha 16, every linear layer) instead of every weight")
    parser.add_argument("--repeats", type=int, default=1, help="--model: run every side this many times, "
                        "alternating, and report each run and the spread")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # child-process mode
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.cores = bench_cores(args.cores)
    args.work_dir = args.work_dir or str(ROOT / "runs" / "vs-trl" / (Path(args.model).name if args.model else args.task))
    args.sides = args.sides or ("trl,fully_async" if args.model else ",".join(SIDES))
    if args.time_cap is None:
        args.time_cap = 3600.0 if args.model else 900.0
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown:
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from {list(SIDES)}")
    if args.model and (args.warmup < 1 or args.steps < 1 or args.repeats < 1):
        parser.error(f"--warmup ({args.warmup}), --steps ({args.steps}) and --repeats ({args.repeats}) must be >= 1")
    if (args.lora or args.repeats > 1) and not args.model:
        parser.error("--lora and --repeats go with --model (seconds per step on a real model)")
    if args.eval_interval < 1 or args.max_steps < 1:
        parser.error(f"--eval-interval ({args.eval_interval}) and --max-steps ({args.max_steps}) must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)  # the recipes' data and model paths are relative to the repository root
    if args.side:
        return side_main(args)
    if args.model:
        return model_main(args)
    started = time.time()
    sides = args.sides.split(",")
    trl_version = ensure_trl(args.trl_spec) if "trl" in sides else None
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = sft_checkpoint(args.sft_checkpoint, work_dir, args.task)
    sft_accuracy = measure_accuracy(checkpoint, args)
    target = args.target if args.target is not None else sft_accuracy + 0.15
    print(f"[vs_trl] SFT held-out greedy accuracy {sft_accuracy:.1%}; target {target:.1%}", flush=True)
    raw = {side: run_side(side, checkpoint, target, args) for side in sides}
    summary = {side: time_to_target(result, target) for side, result in raw.items()}
    ratios = speedups(summary)
    cfg = side_config("trl", checkpoint, args)
    r = cfg.rollout
    print(f"\nverst vs TRL on {recipes(args.task)[0].name}: {r.batch_size} prompts x {r.n_samples_per_prompt} samples, "
          f"lr {cfg.trainer.lr:g} (warm-up {cfg.trainer.warmup_steps}), max {r.max_response_tokens} response tokens; "
          f"target {target:.1%} held-out greedy accuracy (SFT {sft_accuracy:.1%}), eval every {args.eval_interval} "
          f"steps, caps {args.max_steps} steps / {args.time_cap:.0f} s; {trl_version and 'trl ' + trl_version}")
    print(f"cores: each side on {describe(args.cores)}: TRL one process with {len(args.cores)} torch threads; verst "
          "its core budget (sync: trainer and engine each alone on all; fully async: split); load average per side: "
          + ", ".join(f"{s} {raw[s]['load_before']:.2f}->{raw[s]['load_after']:.2f}" for s in sides))
    print(format_table(summary, ratios))
    print(verdict(ratios))
    print(f"[vs_trl] finished in {time.time() - started:.0f} s")
    if args.out:
        report = {"target": target, "sft_accuracy": sft_accuracy, "checkpoint": str(checkpoint),
                  "trl_version": trl_version, "cores": list(args.cores), "eval_interval": args.eval_interval,
                  "max_steps": args.max_steps, "time_cap_s": args.time_cap, "sides": summary,
                  "speedup_trl_over": ratios, "raw": raw, "cpu_count": os.cpu_count()}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def model_main(args: argparse.Namespace) -> int:
    """`--model`: seconds per step of each side on the same GRPO batches of a real model."""
    from _models import resolve_model
    from _step_time import report

    started = time.time()
    sides = args.sides.split(",")
    trl_version = ensure_trl(args.trl_spec) if "trl" in sides else None
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model).resolve()
    runs = [{side: run_side(side, model_path, float("inf"), args) for side in sides} for _ in range(args.repeats)]
    summary = report(runs, args, model_path)
    print(f"[vs_trl] {trl_version and 'trl ' + trl_version}; {describe(args.cores)}; load average per side: "
          + "; ".join(", ".join(f"{s} {raw[s]['load_before']:.2f}->{raw[s]['load_after']:.2f}" for s in sides)
                      for raw in runs)
          + f"; finished in {time.time() - started:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "runs": runs, "trl_version": trl_version,
                                              "cores": list(args.cores)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    sys.exit(report_peaks(main))
