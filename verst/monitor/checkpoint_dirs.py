"""A run's checkpoint directory: layout, atomic commit with a `latest` pointer, pruning, what
`checkpoint.load` names, and the resume rules for a changed config (torch-free)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.monitor.diagnosis import NO_SPACE_ERRNOS, cause_text, is_out_of_space
from verst.monitor.run_dir import CONFIG_FILE, METRICS_FILE

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
TRAINER_DIR = "trainer"
TMP_PREFIX = ".tmp-"
# The trainer's files (verst.trainer.persistence, which imports torch): its completion marker and the
# per-rank records of a background write (`failed_rank<R>.errno<N>`: a rank that could not write its error).
TRAINER_COMPLETE, DONE_PREFIX, FAILED_PREFIX, ERRNO_MARK = "COMPLETE", "done_rank", "failed_rank", ".errno"
FORMAT = 1
# Fields a resumed run may change: they do not touch what the checkpoint restores (sequence parallelism splits
# activations only; the parameters' layout is the tensor-parallel plan's either way).
SAFE_PREFIXES = ("logging.", "eval.", "checkpoint.", "name", "run_dir", "overwrite", "rollout.num_rollouts",
                 "sft.num_steps", "sft.eval_interval", "trainer.sequence_parallel")
# The trainer's data x tensor- or context-parallel mesh: a resumed run may change it, the trainer's DCP shards are resharded
# onto the new one (weights and optimizer state exact; see `MESH_CHANGE`).
MESH_FIELDS = ("cluster.trainer_ranks", "trainer.tensor_parallel_size", "trainer.context_parallel_size")
MESH_CHANGE = ("the weights, optimizer state, lr schedule and step are resharded exactly (DCP); the per-rank RNG "
               "states are not restored (each rank keeps its seed, trainer.seed + rank), and the train step's "
               "float32 sums run in the new mesh's order, so its results differ from the old mesh's in the last "
               "bits (docs/checkpoints.md#another-trainer-mesh)")


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked; the message names the path or the field."""


class CheckpointNotSaved(CheckpointError):
    """A save failed before its commit: `step_dir` was not written, `latest` (None: no checkpoint yet) is
    still the run's latest checkpoint, `cause` is the error's one line (the OS error behind it, if any)."""

    def __init__(self, step_dir: Path, latest: Path | None, cause: str, out_of_space: bool):
        kept = f"{latest} is still the latest checkpoint" if latest is not None else "the run has no earlier checkpoint"
        super().__init__(f"checkpoint {step_dir} not saved: {cause}; {kept}")
        self.step_dir, self.latest, self.cause, self.out_of_space = step_dir, latest, cause, out_of_space


class TrainerWriteError(CheckpointError):
    """A trainer rank's background write of its shards failed; the message names each rank and its error."""

    def __init__(self, message: str, out_of_space: bool):
        super().__init__(message)
        self.out_of_space = out_of_space


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"step_{step}"


# ---- writing ------------------------------------------------------------------------------------
def new_tmp_dir(run_dir: Path, step: int) -> Path:
    """An empty temporary directory beside the step directories (one left by a crash is replaced)."""
    tmp = checkpoints_dir(run_dir) / f"{TMP_PREFIX}{step_dir_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, manifest: dict[str, Any], keep_last: int | None = None) -> Path:
    """Write the manifest, fsync every file and directory, rename `tmp` to its step directory, move
    `latest` to it, then prune to `keep_last`. A crash at any point leaves the previous checkpoint
    (and `latest`) as they were, or the new one complete."""
    final = tmp.parent / tmp.name.removeprefix(TMP_PREFIX)
    manifest = {"format": FORMAT, "saved_at": time.time(), **manifest}
    try:
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _fsync_tree(tmp)  # a full disk often shows only here, when the delayed writes reach it
    except OSError as error:
        raise not_saved(final, tmp, error) from error
    if final.exists():  # a step saved again (e.g. the final save of a run resumed at its last step)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    write_latest(final)
    if keep_last:
        prune(final.parent, keep_last)
    return final


def not_saved(final: Path, tmp: Path, error: BaseException, what: str | None = None) -> CheckpointNotSaved:
    """The error of a save that failed before its rename: it names the checkpoint, the part that failed
    (`what`), the cause (the OS error behind it, whole) and the checkpoint `latest` still names; the temporary
    directory is removed (a full disk gets its space back)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(error, CheckpointNotSaved):  # a part of the save told it already
        return error
    if isinstance(error, TrainerWriteError):
        cause, out_of_space = str(error), error.out_of_space
    else:
        cause, out_of_space = cause_text(error), is_out_of_space(error)
    if what is not None:
        cause = f"{what} failed: {cause}"
    return CheckpointNotSaved(final, read_latest(final.parent.parent), cause, out_of_space)


def wait_trainer_writes(trainer_dir: Path, ranks: int, step: int, timeout_s: float = 1800.0,
                        abandoned: threading.Event | None = None) -> None:
    """Wait until every rank's background write of `trainer_dir` has ended, then write its COMPLETE
    marker; a rank's failure is raised with its error, and so is `abandoned` being set (the run failed).
    Nothing to wait for after a synchronous save."""
    marker = trainer_dir / TRAINER_COMPLETE
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if abandoned is not None and abandoned.is_set():
            raise CheckpointError(f"{trainer_dir}: not committed, the run stopped before the trainer's write ended")
        failed = sorted(trainer_dir.glob(f"{FAILED_PREFIX}*"))
        if failed:
            causes = [_rank_failure(path) for path in failed]
            raise TrainerWriteError("; ".join(text for text, _ in causes), any(full for _, full in causes))
        if all((trainer_dir / f"{DONE_PREFIX}{rank}").exists() for rank in range(ranks)):
            marker.write_text(f"step {step}\n")
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"{trainer_dir}: the trainer ranks did not finish writing within {timeout_s:g} s")
        time.sleep(0.02)


def write_latest(step_dir: Path) -> None:
    """Atomically point `latest` at `step_dir` (write beside, fsync, replace, fsync the directory)."""
    parent = step_dir.parent
    tmp = parent / f"{TMP_PREFIX}{LATEST_FILE}"
    with open(tmp, "w") as f:
        f.write(step_dir.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, parent / LATEST_FILE)
    _fsync_dir(parent)


def prune(directory: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` step directories (never the one `latest` names)."""
    latest = read_latest(directory.parent)
    steps = sorted(_step_dirs(directory), key=lambda p: _step_of(p))
    doomed = [p for p in steps[: max(0, len(steps) - keep_last)] if p != latest]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_tmp_dirs(run_dir: Path) -> None:
    """Temporary directories a crash left behind (never a complete checkpoint)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for path in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _rank_failure(record: Path) -> tuple[str, bool]:
    """A rank's `failed_rank<R>` record as ("trainer rank R's write failed: <error>", out of space)."""
    rank, _, code = record.name[len(FAILED_PREFIX):].partition(ERRNO_MARK)
    text = record.read_text().strip() if not code else ""
    if code.isdigit():  # the rank could not write its error's text: the errno is in the record's name
        text = f"OSError: [Errno {code}] {os.strerror(int(code))}"
    full = code.isdigit() and int(code) in NO_SPACE_ERRNOS or any(os.strerror(n) in text for n in NO_SPACE_ERRNOS)
    return f"trainer rank {rank}'s write failed: {text or '(the rank recorded no error text)'}", full


# ---- reading ------------------------------------------------------------------------------------
def read_latest(run_dir: Path) -> Path | None:
    pointer = checkpoints_dir(run_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    return checkpoints_dir(run_dir) / pointer.read_text().strip()


def resolve(path: str | Path) -> Path:
    """The step directory `checkpoint.load` names: a step directory, or a run directory (its `latest`);
    refused unless it exists and is complete (its manifest and trainer state written)."""
    path = Path(path)
    step_dir = path
    if (path / CHECKPOINTS_DIR).is_dir() or (path / CONFIG_FILE).is_file():
        step_dir = read_latest(path)
        if step_dir is None:
            raise CheckpointError(f"checkpoint.load = {str(path)!r}: the run directory has no complete checkpoint "
                                  f"({CHECKPOINTS_DIR}/{LATEST_FILE} is missing)")
    if not step_dir.is_dir():
        raise CheckpointError(f"checkpoint.load = {str(path)!r}: {str(step_dir)!r} does not exist")
    missing = [name for name in (MANIFEST_FILE, f"{TRAINER_DIR}/{TRAINER_COMPLETE}") if not (step_dir / name).exists()]
    if missing:
        raise CheckpointError(f"checkpoint.load = {str(path)!r}: {str(step_dir)!r} is not a complete checkpoint "
                              f"(missing {', '.join(missing)})")
    return step_dir


def read_manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((Path(step_dir) / MANIFEST_FILE).read_text())


def run_dir_of_checkpoint(step_dir: Path) -> Path:
    return Path(step_dir).resolve().parent.parent


def base_config_file(run_dir: str | Path) -> Path:
    """`--resume RUN_DIR`: the run's resolved config, the base of the resumed run's."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"--resume {str(run_dir)!r}: no {CONFIG_FILE} there; is it a run directory?")
    return path


# ---- resume rules ---------------------------------------------------------------------------------
def changed_fields(saved: dict[str, Any], current: VerstConfig) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, new value) of every field that differs and may not change on resume."""
    old, new = _flatten(saved), _flatten(current.model_dump(mode="json"))
    out = []
    for key in sorted(old.keys() | new.keys()):
        if not _same(old.get(key), new.get(key)) and not key.startswith(SAFE_PREFIXES) and key not in MESH_FIELDS:
            out.append((key, old.get(key), new.get(key)))
    return out


def check_resume_config(step_dir: Path, current: VerstConfig) -> dict[str, Any]:
    """The checkpoint's manifest; a changed field that is not safe to change is refused by name."""
    manifest = read_manifest(step_dir)
    changed = changed_fields(manifest["config"], current)
    if changed:
        lines = "\n  ".join(f"{key}: checkpoint {old!r}, now {new!r}" for key, old, new in changed)
        raise CheckpointError(f"resuming from {str(step_dir)!r} with a config that changes fields a resumed run "
                              f"must keep (safe to change: logging.*, eval.*, checkpoint.*, the number of steps, "
                              f"name, run_dir, overwrite, trainer.sequence_parallel, and the trainer mesh: {', '.join(MESH_FIELDS)}):\n  {lines}")
    return manifest


def mesh_change(saved: dict[str, Any], current: VerstConfig) -> str | None:
    """"dp 2 x tp 2 -> dp 1 x tp 1" when the resumed run's trainer mesh (`MESH_FIELDS`) is not the one the
    checkpoint's config (`saved`) was trained on; None when it is the same."""
    old, new = _flatten(saved), _flatten(current.model_dump(mode="json"))
    meshes = [mesh_name(flat["cluster.trainer_ranks"], flat.get("trainer.tensor_parallel_size", 1),
                    flat.get("trainer.context_parallel_size", 1)) for flat in (old, new)]
    return None if meshes[0] == meshes[1] else " -> ".join(meshes)


def trim_metrics(run_dir: Path, step: int, drop_eval_at_step: bool = False) -> None:
    """Keep the metrics rows up to `step` (rows a killed run logged after its checkpoint go); with
    `drop_eval_at_step`, also the evaluation rows of `step`, which the resumed run measures again."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # cut short by a stop (or a full disk) while it was written
                continue
            raise
        is_eval = any(k.startswith("eval/") for k in row)
        if row["step"] < step or (row["step"] == step and not (drop_eval_at_step and is_eval)):
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


# ---- internals ------------------------------------------------------------------------------------
def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def mesh_name(ranks: int, tensor_parallel_size: int, context_parallel_size: int) -> str:
    """The trainer mesh as logs name it: "dp 2 x tp 2", "dp 1 x tp 1 x cp 2"."""
    mesh = f"dp {ranks // (tensor_parallel_size * context_parallel_size)} x tp {tensor_parallel_size}"
    return f"{mesh} x cp {context_parallel_size}" if context_parallel_size > 1 else mesh


def _same(old: Any, new: Any) -> bool:
    """Equal values, or the same file path written relative and absolute."""
    if old == new:
        return True
    return isinstance(old, str) and isinstance(new, str) and os.path.abspath(old) == os.path.abspath(new)


def _step_dirs(directory: Path) -> list[Path]:
    return [p for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]


def _step_of(path: Path) -> int:
    return int(path.name[5:])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
