"""Checkpoints of a sharded trainer: resumable state (DCP shards of model and optimizer, and of PPO's
critic and its optimizer; lr schedules, step, per-rank RNG) and Hugging Face exports gathered on rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from verst.monitor.checkpoint_dirs import mesh_name
from verst.monitor.diagnosis import cause_text, error_text, os_error_in

if TYPE_CHECKING:
    from verst.trainer.critic import Critic

SHARDS_DIR = "dcp"
STATE_FILE = "trainer_state.pt"
COMPLETE_MARKER = "COMPLETE"
DONE_PREFIX, FAILED_PREFIX = "done_rank", "failed_rank"  # a background write's end, per rank
ERRNO_MARK = ".errno"  # failed_rank<R>.errno<N>: the record of a rank that could not write its error's text
log = logging.getLogger(__name__)
# Files of a Hugging Face checkpoint that export_hf writes itself; everything else (tokenizer,
# chat template, generation config, remote code) is copied from the source model directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once, under their first name) and persistent buffers, in HF names."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


@dataclasses.dataclass(frozen=True)
class BackgroundSave:
    """A save running in threads: `staged` once the shards are copied (the model and optimizer may change
    again), `written` once they are on disk (and `done_rank<R>` or `failed_rank<R>` is recorded)."""

    staged: Future
    written: Future


def background_stager() -> DefaultStager:
    """The copy of the shards in a thread of its own (plain CPU memory: no pinned or shared buffers, which
    need an accelerator or /dev/shm room); `close()` it when done."""
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=False))


def save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, *,
         background_group: dist.ProcessGroup | None = None,
         stager: DefaultStager | None = None, critic: Critic | None = None,
         extra: dict | None = None, tensor_parallel_size: int = 1,
         context_parallel_size: int = 1) -> BackgroundSave | None:
    """Collective. `directory/COMPLETE` is written last, so a half-written checkpoint is never loaded.

    With `background_group` (a process group used for nothing else) and `stager` (`background_stager()`)
    the shards are copied and written by background threads (`torch.distributed.checkpoint.async_save`):
    the call returns at once; the model and optimizer must not change before `staged` is done. Each rank
    writes `done_rank<R>` (or `failed_rank<R>` with the error) when its write has ended; whoever waits for
    those writes COMPLETE (`mark_complete`). `critic`: PPO's value model, saved in the same shards.
    `tensor_parallel_size`, `context_parallel_size`: the mesh's tp and cp axes, recorded with the world size (a
    load on another mesh reshards)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = _trained_state(model, optimizer)
    torch.save(_rng_state(), directory / f"rng_rank{rank}.pt")
    if rank == 0:
        state = {"step": step, "scheduler": scheduler.state_dict(), "world_size": world_size,
                 "tensor_parallel_size": tensor_parallel_size, "context_parallel_size": context_parallel_size,
                 "extra": extra or {}}
        if critic is not None:
            state["critic_scheduler"] = critic.scheduler.state_dict()
        torch.save(state, directory / STATE_FILE)
    shards = {"model": model_state, "optimizer": optim_state}
    if critic is not None:
        shards["critic"], shards["critic_optimizer"] = _trained_state(critic.model, critic.optimizer)
    if background_group is not None:
        response = dcp.async_save(shards, checkpoint_id=directory / SHARDS_DIR, process_group=background_group,
                                  async_stager=stager or background_stager())
        response.upload_completion.add_done_callback(functools.partial(_record_write, directory, rank))
        return BackgroundSave(response.staging_completion, response.upload_completion)
    dcp.save(shards, checkpoint_id=directory / SHARDS_DIR)
    dist.barrier()
    if rank == 0:
        mark_complete(directory, step)
    return None


class Saves:
    """A backend's saves, one at a time: `save` in the foreground, or with `background` copied now and written by
    a thread (its own gloo group and stager, made at the first such save: collective, every rank saves at once).
    `wait` waits for the write (its error is raised there); `wait_staged` for the copy, before the model changes."""

    def __init__(self) -> None:
        self.writing: BackgroundSave | None = None  # a background save in progress
        self._group: dist.ProcessGroup | None = None  # the write's collectives run in a thread, on a group of their own
        self._stager: DefaultStager | None = None

    def save(self, directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, *, background: bool = False,
             **options) -> None:
        """`persistence.save` (its `options`: critic, extra, the parallel sizes) after the previous save's write."""
        self.wait()
        if background and self._group is None:
            self._group, self._stager = dist.new_group(backend="gloo"), background_stager()
        self.writing = save(Path(directory), model, optimizer, scheduler, step,
                            background_group=self._group if background else None, stager=self._stager, **options)

    def wait(self) -> None:
        writing, self.writing = self.writing, None
        if writing is not None:
            writing.written.result()

    def wait_staged(self) -> None:
        """A failed copy shows in its write."""
        if self.writing is not None:
            wait_futures([self.writing.staged])


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts without the frozen parameters (a LoRA model's base, under each
    of its names: a tied head too), which are the source checkpoint's, read at start-up."""
    model_state, optim_state = get_state_dict(model, optimizer)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


def mark_complete(directory: Path, step: int) -> None:
    (directory / COMPLETE_MARKER).write_text(f"step {step}\n")


def _record_write(directory: Path, rank: int, writing: Future) -> None:
    """Record the end of rank `rank`'s background write for the driver, which waits for it: `done_rank<R>`,
    or `failed_rank<R>` holding the error's one line (the OS error behind it, when there is one). Never
    raises: it runs as a future's callback, where an error would only be printed."""
    error = writing.exception()
    if error is None:
        record, text = directory / f"{DONE_PREFIX}{rank}", ""
    else:
        record, text = directory / f"{FAILED_PREFIX}{rank}", cause_text(error)
        log.error("trainer rank %d: the checkpoint write into %s failed: %s", rank, directory, text)
    written = directory / f".{record.name}.tmp"  # renamed when whole: the driver never reads half a record
    try:
        written.write_text(text)
        written.rename(record)
    except OSError as failed:
        # A full disk may refuse the record's text too; the errno goes into its name, which needs no data block.
        found = os_error_in(error) if error is not None else failed
        code = found.errno if found is not None else failed.errno
        log.error("trainer rank %d: could not record the end of its checkpoint write in %s: %s", rank, directory,
                  error_text(failed))
        try:
            written.rename(directory / f"{FAILED_PREFIX}{rank}{ERRNO_MARK}{code}")
        except OSError:
            (directory / f"{FAILED_PREFIX}{rank}{ERRNO_MARK}{code}").touch()


def load(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, critic: Critic | None = None,
         tensor_parallel_size: int = 1, context_parallel_size: int = 1) -> int:
    """Collective. Restores everything `save` wrote and returns the step; with `critic`, also PPO's value
    model and its optimizer (a checkpoint without them is refused). Saved on another data x tensor- or
    context-parallel mesh (another world size, `tensor_parallel_size` or `context_parallel_size`), DCP reshards the state onto this one: every value
    comes back exactly. The per-rank RNG states are restored on the same mesh only; on another, rank R of the
    new mesh is not rank R of the old one, and each rank keeps the state it was seeded with."""
    if not (directory / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"{directory} is not a complete trainer checkpoint (no {COMPLETE_MARKER} file)")
    state = torch.load(directory / STATE_FILE, weights_only=False)
    world_size = dist.get_world_size()
    saved_mesh = mesh_name(state["world_size"], state.get("tensor_parallel_size", 1), state.get("context_parallel_size", 1))
    mesh = mesh_name(world_size, tensor_parallel_size, context_parallel_size)
    resharded = saved_mesh != mesh
    if resharded and dist.get_rank() == 0:
        log.warning("checkpoint %s was saved on %s, this trainer is %s: weights and optimizer state are resharded "
                    "(exact), each rank keeps its own seeded RNG state instead of the saved ones", directory,
                    saved_mesh, mesh)
    if critic is not None and "critic_scheduler" not in state:
        raise ValueError(f"checkpoint {directory} holds no value model (it was not saved by a PPO run); "
                         "algorithm.advantage_estimator = 'ppo' resumes only from a PPO run's checkpoint")
    model_state, optim_state = _trained_state(model, optimizer)
    shards = {"model": model_state, "optimizer": optim_state}
    if critic is not None:
        shards["critic"], shards["critic_optimizer"] = _trained_state(critic.model, critic.optimizer)
    dcp.load(shards, checkpoint_id=directory / SHARDS_DIR)
    # Not strict about the frozen parameters `_trained_state` leaves out; dcp.load has checked the rest.
    frozen = any(not p.requires_grad for p in model.parameters())
    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"],
                   options=StateDictOptions(strict=not frozen))
    scheduler.load_state_dict(state["scheduler"])
    if critic is not None:
        set_state_dict(critic.model, critic.optimizer, model_state_dict=shards["critic"],
                       optim_state_dict=shards["critic_optimizer"])
        critic.scheduler.load_state_dict(state["critic_scheduler"])
    if not resharded:
        _set_rng_state(torch.load(directory / f"rng_rank{dist.get_rank()}.pt", weights_only=False))
    dist.barrier()
    return int(state["step"])


def saved_extra(directory: Path) -> dict:
    """The `extra` a trainer checkpoint was saved with (a backend's own counters); {} when none."""
    return torch.load(directory / STATE_FILE, weights_only=False).get("extra", {})


def export_hf(directory: Path, model: torch.nn.Module, source_path: str, dtype: str) -> None:
    """Collective. Rank 0 writes `save_pretrained` output in `dtype` plus the source's other files (a
    native model: its safetensors in the same layout, with the source's config.json)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    write_hf(directory, model, full, source_path, dtype)


def write_hf(directory: Path, model: torch.nn.Module, full: dict[str, torch.Tensor], source_path: str,
             dtype: str) -> None:
    """Collective (a barrier). Rank 0 writes `full`, the gathered state of `model`'s class, as `export_hf` does."""
    from verst.models.native import NativeCausalLM

    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if isinstance(model, NativeCausalLM):
            _save_native(directory, model, full, Path(source_path), dtype)
        else:
            _save_transformers(directory, model, full, dtype)
        copy_side_files(Path(source_path), directory)
    dist.barrier()


def _save_transformers(directory: Path, model: torch.nn.Module, full: dict[str, torch.Tensor], dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    # A fresh model of the same config: the sharded one's class is an FSDP subclass, whose name would end up
    # in config.json's "architectures".
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(model.config)
    clean.load_state_dict(full, assign=True, strict=False)
    # A tied head is the embedding's again: merged LoRA weights name it once, and a state gathered from several
    # ranks names it twice as two copies, which `assign` would otherwise save as two tensors.
    clean.tie_weights()
    missing = [n for n, p in clean.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"export_hf: parameters missing from the gathered state: {missing[:5]}")
    clean.to(getattr(torch, dtype)).save_pretrained(directory)


def _save_native(directory: Path, model: torch.nn.Module, full: dict[str, torch.Tensor], source: Path,
                 dtype: str) -> None:
    """What `save_pretrained` writes for these families: one safetensors file (a tied lm_head left out) and
    config.json, the source's with the new dtype."""
    import json

    from safetensors.torch import save_file

    if model.config.tie_word_embeddings:
        full = {name: t for name, t in full.items() if name != "lm_head.weight"}
    save_file({name: t.to(getattr(torch, dtype)).contiguous() for name, t in full.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def copy_side_files(source: Path, target: Path) -> None:
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, target / path.name)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
