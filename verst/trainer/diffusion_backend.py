"""The diffusion train backend: a flow-matching denoiser (diffusers' UNet2DModel) sharded with `fully_shard` over
all ranks of the default process group, trained with Flow-GRPO's per-step logprobs in the RL step's loss fns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import UNet2DModel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from verst.config.schema import DiffusionConfig, ModelConfig, TrainerConfig
from verst.models import diffusion as denoiser
from verst.trainer import persistence
from verst.trainer.backend import Batch
from verst.trainer.batching import ForwardOutputs, MicroBatch, balance_across_ranks, collate, pad_right, split_to_count
from verst.trainer.distributed import gather_objects, join_ranks
from verst.trainer.items import TrainItem, as_items
from verst.trainer.losses import LossFn, Normalizer, combine_metric, count_policy_tokens, train_namespaced
from verst.trainer.optim import build_optimizer
from verst.trainer.sharding import full_buckets
from verst.types import WeightBucket


class DiffusionBackend:
    """A `TrainBackend` for image trajectories over every rank of the default process group (one rank works
    in-process).

    An item is one image: its prompt token the class id, its response the denoising steps, its `latents` the
    recorded trajectory; its per-step logprobs are `diffusion.step_logprobs` under `diffusion`'s guidance and
    noise level, what the engine sampled with. The denoiser stays float32 and is sharded over one
    data-parallel axis (no tensor, context or expert parallelism). An optional frozen reference sits on the
    same ranks. There is no entropy term and no critic: those calls raise, naming the setting.
    """

    def __init__(self, model: ModelConfig, trainer: TrainerConfig, diffusion: DiffusionConfig, *,
                 total_steps: int | None = None, ref_model_path: str | None = None, device: str = "auto"):
        for field in ("tensor_parallel_size", "context_parallel_size", "expert_parallel_size"):
            if getattr(trainer, field) > 1:
                raise ValueError(f"trainer.{field} = {getattr(trainer, field)}: the diffusion backend shards the "
                                 "denoiser over data-parallel ranks only; set it to 1")
        if model.dtype != "float32":
            raise ValueError(f"model.dtype = {model.dtype!r}: the diffusion backend trains the denoiser in float32, "
                             "the dtype its recomputed step logprobs match the engine's in; set it to 'float32'")
        self.model_config, self.config, self.sampler = model, trainer, diffusion
        self.device, self.rank, self.world_size = join_ranks(device, trainer.seed)
        self._step = 0
        self._saves = persistence.Saves()  # a background save's copy and write run in threads
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Python objects (metrics, logprob dicts) travel over gloo even when tensors use NCCL.
        self._object_group = dist.new_group(backend="gloo") if self.device.type == "cuda" else None
        self.model = self._build(model.path, trainable=True)
        self.ref_model = self._build(ref_model_path, trainable=False) if ref_model_path else None
        self.optimizer, self.scheduler = build_optimizer(self.model, trainer, total_steps)

    def _build(self, path: str, trainable: bool) -> torch.nn.Module:
        """The denoiser at `path`, read on every rank; each block, then the whole model, sharded over the mesh."""
        model = denoiser.load(path).float()
        for block in [*model.down_blocks, model.mid_block, *model.up_blocks]:
            if block is not None:
                fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)  # also moves the shards to the mesh device
        if trainable:
            model.train()
        else:
            model.requires_grad_(False)
            model.eval()
        return model

    @property
    def step(self) -> int:
        return self._step

    # ---- batching ------------------------------------------------------------------------
    def _my_micro_batches(self, items: list[TrainItem]) -> list[list[int]]:
        """This rank's share in micro-batches of up to `max_tokens_per_micro_batch // (steps + 1)` images; every
        rank gets as many as the busiest one (empty ones run a dummy forward: FSDP's collectives)."""
        size = max(1, self.config.max_tokens_per_micro_batch // (items[0].response_length + 1))
        shares = balance_across_ranks([it.length for it in items], self.world_size)
        bins = [[share[i:i + size] for i in range(0, len(share), size)] for share in shares]
        return split_to_count(bins[self.rank], max(len(b) for b in bins))

    def _forward(self, model: torch.nn.Module, items: list[TrainItem], indices: list[int]) -> ForwardOutputs:
        """Per-step logprobs [n_seq, steps] of the items at `indices` (a dummy: the first item's, unused)."""
        chosen = [items[i] for i in indices] or items[:1]
        latents = torch.stack([it.latents for it in chosen]).to(self.device)  # [n, steps + 1, C, H, W]
        labels = torch.tensor([int(it.tokens[0]) for it in chosen], device=self.device)
        logprobs = denoiser.step_logprobs(model, latents, labels, guidance=self.sampler.guidance_scale,
                                           noise_level=self.sampler.noise_level)
        return ForwardOutputs(logprobs=logprobs)

    def _micro_batch(self, items: list[TrainItem], indices: list[int]) -> MicroBatch:
        return collate(items, indices, packed=False).to(self.device)

    # ---- forward-only logprobs -----------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: Batch, *, reference: bool = False, with_entropy: bool = False) -> list[torch.Tensor]:
        _refuse_entropy(with_entropy)
        if reference and self.ref_model is None:
            raise ValueError("logprobs(reference=True) but the backend was built without ref_model_path")
        model = self.ref_model if reference else self.model
        items = _image_items(batch)
        model.eval()
        mine: dict[int, torch.Tensor] = {}
        for indices in self._my_micro_batches(items):
            logprobs = self._forward(model, items, indices).logprobs
            mine.update({index: logprobs[row].cpu() for row, index in enumerate(indices)})
        merged = {k: v for part in gather_objects(self._object_group, mine) for k, v in part.items()}
        return [merged[i] for i in range(len(items))]

    def values(self, batch: Batch) -> list[torch.Tensor]:
        raise ValueError("values(): an image policy has no value model; algorithm.advantage_estimator = 'ppo' does "
                         "not apply to model.kind = 'diffusion' (use a critic-free estimator such as 'grpo')")

    def train_critic(self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer = count_policy_tokens
                     ) -> dict[str, float]:
        return self.values(batch)  # raises

    # ---- training ------------------------------------------------------------------------
    def train_step(self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer = count_policy_tokens,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over the global batch; the loss fn gets each micro-batch's per-step logprobs."""
        _refuse_entropy(with_entropy)
        start = time.perf_counter()
        items = _image_items(batch)
        self._saves.wait_staged()  # a background save's copy of the weights and optimizer state is made first
        total = float(normalizer(pad_right([it.loss_mask for it in items])))
        if not total > 0:
            raise ValueError(f"the global batch's normaliser is {total}: no policy steps (loss_mask all 0)")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        metric_sums: dict[str, float] = {}
        for indices in self._my_micro_batches(items):
            outputs = self._forward(self.model, items, indices)
            if not indices:  # a dummy keeps this rank in step with the collectives
                (outputs.logprobs.sum() * 0.0).backward()
                continue
            micro = self._micro_batch(items, indices)
            loss, metrics = loss_fn(outputs, micro, total)
            # FSDP averages gradients over the ranks; the losses are shares of the global sum, so undo it.
            (loss * self.world_size).backward()
            loss_sum += loss.detach()
            weight = float(normalizer(micro.loss_mask)) / total
            for key, value in metrics.items():
                combine_metric(metric_sums, key, float(value), weight)
        grad_norm = self._clip_gradients()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self._step += 1
        # The summed micro-batch losses are the global loss, whatever a loss fn reports as its own.
        local = {**train_namespaced(metric_sums), "train/loss": float(loss_sum.item())}
        parts = gather_objects(self._object_group, (local, time.perf_counter() - start))
        out: dict[str, float] = {}
        for part, _ in parts:
            for key, value in part.items():
                combine_metric(out, key, value, 1.0)  # each rank's part is already weighted
        # a denoising step is an image trajectory's token
        steps_per_s = sum(it.response_length for it in items) / max(elapsed for _, elapsed in parts)
        return {**out, "train/grad_norm": grad_norm, "train/lr": lr, "perf/train_tokens_per_s": steps_per_s}

    def _clip_gradients(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                              self.config.grad_clip)
        value = float((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        if not math.isfinite(value):
            raise FloatingPointError(f"gradient norm is {value} at train step {self._step}; the step is refused")
        return value

    # ---- weights and checkpoints -----------------------------------------------------------
    def named_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Collective: full tensors under diffusers' state-dict names (`fully_shard` keeps them), every rank in
        the same order."""
        yield from full_buckets(persistence.named_tensors(self.model), bucket_bytes)

    def synced_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        yield from self.named_weights(bucket_bytes)

    @property
    def sync_adapter(self) -> None:
        return None

    def save(self, directory: str | Path, *, background: bool = False) -> None:
        """Model, optimizer, lr schedule, RNG state and step (`persistence.save`); with `background`, written by
        a thread, complete once every rank's `done_rank<R>` is there and COMPLETE is written."""
        self._saves.save(directory, self.model, self.optimizer, self.scheduler, self._step, background=background)

    def wait_saves(self) -> None:
        """Wait for a background save's write (its error is raised here)."""
        self._saves.wait()

    def load(self, directory: str | Path) -> None:
        self.wait_saves()
        self._step = persistence.load(Path(directory), self.model, self.optimizer, self.scheduler)

    def export_hf(self, directory: str | Path, *, merge_lora: bool = False) -> None:
        """Collective. Rank 0 writes the full weights in diffusers' format (config.json + safetensors), which
        `verst.models.diffusion.load` reads."""
        if merge_lora:
            raise ValueError("export_hf(merge_lora=True): the diffusion backend trains no LoRA adapters "
                             "(lora.export applies to language models)")
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            # A fresh model of the same config: the sharded one's class is FSDP's subclass, whose name
            # save_pretrained would write into config.json.
            clean = UNet2DModel.from_config(self.model.config)
            clean.load_state_dict(full)
            denoiser.save(clean, directory)
        dist.barrier()


def _image_items(batch: Batch) -> list[TrainItem]:
    """The batch as items, each an image trajectory of the same steps and latent shape (every rank must run
    the same forwards: FSDP's collectives)."""
    items = as_items(batch)
    missing = [it.index for it in items if it.latents is None]
    if missing:
        raise ValueError(f"train items {missing[:8]} carry no latents: the diffusion backend trains on image "
                         "trajectories (model.kind = 'diffusion', sampled by cluster.engine = 'diffusion')")
    shapes = {tuple(it.latents.shape) for it in items}
    if len(shapes) > 1:
        raise ValueError(f"the batch's latents have the shapes {sorted(shapes)}; a train batch needs one "
                         "(diffusion.num_inference_steps and the image size the same for every sample)")
    return items


def _refuse_entropy(with_entropy: bool) -> None:
    if with_entropy:
        raise ValueError("with_entropy: an image policy has no entropy term (its steps are Gaussians of fixed "
                         "spread); set algorithm.entropy_coef = 0 for model.kind = 'diffusion'")

