"""The FSDP2 train backend: a causal LM (verst's native one for dense Llama-family checkpoints on CPU,
else transformers'), optionally with LoRA adapters, sharded with `fully_shard` over all ranks of the
default process group; dynamic micro-batches, AdamW, clipping, an optional frozen reference.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from verst.config.adapters import adapter_lora_configs
from verst.config.schema import CriticConfig, LoraConfig, ModelConfig, TrainerConfig
from verst.trainer import lora as lora_mod
from verst.trainer import persistence
from verst.trainer.backend import Batch
from verst.trainer.batching import (
    ForwardOutputs,
    MicroBatch,
    balance_across_ranks,
    collate,
    dummy_micro_batch,
    kept_outputs,
    pack_micro_batches,
    pad_right,
    split_to_count,
)
from verst.trainer.context_parallel import context_shard, native_model, pad_to_chunks, sharded_logprobs
from verst.trainer.critic import Critic, check_same_vocabulary, critic_optimizer, value_forward
from verst.trainer.distributed import gather_objects, join_ranks
from verst.trainer.expert_parallel import expert_mesh
from verst.trainer.items import TrainItem, as_items
from verst.trainer.losses import LossFn, Normalizer, combine_metric, count_policy_tokens, train_namespaced
from verst.trainer.optim import build_optimizer
from verst.trainer.routing import ROUTING_MODES, RoutingReplay, mismatch_rate
from verst.trainer.sharding import build_sharded, clip_grad_norm_across_meshes, full_buckets
from verst.trainer.tensor_parallel import (
    logprobs_and_entropy,
    sum_norm_grads,
    trainer_mesh,
)
from verst.types import WeightBucket


class FSDP2Backend:
    """A `TrainBackend` over every rank of the default process group (one rank works in-process).

    Parameters stay float32 (master weights); `model.dtype` other than float32 becomes the FSDP2
    compute dtype, with gradients reduced in float32. `temperature` divides the logits before
    log-softmax, so recomputed logprobs match what the engine sampled from. `packing` puts a whole
    micro-batch in one row (see `batching`); by default only under flash-attention, whose cost does
    not grow with the square of the row.

    With `lora` enabled, PEFT's adapters sit on the model and only they train (gradients, optimizer state,
    checkpoints); `named_weights` gives the merged weights under the base's names, `synced_weights` what
    weight sync pushes (with `lora.sync = "adapter"` the adapter alone), and a reference at the
    model's own path is the same model with its adapters disabled (no second copy of the weights).

    With `critic` (PPO), a value model (`verst.trainer.critic`) is sharded next to the policy on the same
    ranks, initialised from `critic.model_path` or the policy's checkpoint, with full weights whatever
    `lora` says; `values` and `train_critic` run it, checkpoints hold it, exports and weight sync leave it out.

    `per_sequence` (`algorithm.true_on_policy`) runs every sequence alone in its own micro-batch, without
    padding: each logprob then comes from the same forward, shapes and reduction order as the engine's
    scoring pass (`verst.models.scoring.sequence_logprobs`), bit for bit.

    `routing` (`algorithm.routing_replay`, MoE): "measure" counts the policy routers' disagreements with the
    items' `routed_experts` (`train/routing_mismatch_rate`), "replay" also routes every recorded token to
    the recorded experts (`verst.trainer.routing`), before an expert-parallel layer sends each token to the rank
    of its experts (`trainer.expert_parallel_size`, `verst.trainer.expert_parallel`).
    With `trainer.context_parallel_size` > 1 each rank computes a share of every row (`verst.trainer.context_parallel`).
    """

    def __init__(
        self,
        model: ModelConfig,
        trainer: TrainerConfig,
        *,
        total_steps: int | None = None,
        ref_model_path: str | None = None,
        temperature: float = 1.0,
        packing: bool | None = None,
        device: str = "auto",
        lora: LoraConfig | None = None,
        critic: CriticConfig | None = None,
        per_sequence: bool = False,
        routing: str = "off",
        adapter_steps: dict[str, int | None] | None = None,
    ):
        if temperature <= 0:
            raise ValueError(f"logprob temperature must be positive, got {temperature}")
        self.model_config, self.config, self.temperature = model, trainer, temperature
        self.lora = lora if lora is not None and lora.enabled else None
        # Multi-LoRA (`lora.adapters`): one PEFT adapter per name, each with its own optimizer state, lr and
        # schedule (`adapter_steps`: its total optimizer steps); `use_adapter` picks the one trained and synced.
        self.adapters = adapter_lora_configs(self.lora) if self.lora else {}
        self.active_adapter = next(iter(self.adapters), lora_mod.ADAPTER)
        self.adapter_step = dict.fromkeys(self.adapters, 0)
        self.device, self.rank, self.world_size = join_ranks(device, trainer.seed)
        self._step = 0
        self._saves = persistence.Saves()  # a background save's copy and write run in threads
        # ranks [dp, tp]: a tensor-parallel group holds consecutive ranks and sees the same micro-batches
        self.tp = trainer.tensor_parallel_size
        self.mesh = trainer_mesh(self.device.type, self.world_size, self.tp)
        # experts over [dp, ep] (or None): an expert-parallel group's ranks keep their own micro-batches, so stay in dp
        self.experts_mesh = expert_mesh(self.device.type, self.world_size, trainer.expert_parallel_size, self.tp)
        # rows split over [dp, cp] (or None): a group's ranks see the same micro-batches; FSDP2 shards over dp x cp
        self.cp = trainer.context_parallel_size
        self.context = context_shard(self.device.type, self.world_size, self.cp, self.tp)
        if self.context is not None:
            model = self.model_config = native_model(model, self.cp)
        self.dp, self.dp_rank = self.world_size // (self.tp * self.cp), self.rank // (self.tp * self.cp)
        # Python objects (metrics, logprob dicts) travel over gloo even when tensors use NCCL.
        self._object_group = dist.new_group(backend="gloo") if self.device.type == "cuda" else None
        self.model = self._build(model.path, trainable=True)
        # With LoRA, the reference at the model's own path is the base: the adapters disabled (`_reference`).
        self.ref_model = None
        if ref_model_path and not (self.lora and _same_path(ref_model_path, model.path)):
            self.ref_model = self._build(ref_model_path, trainable=False)
        self._base_is_reference = bool(ref_model_path) and self.ref_model is None
        if self.adapters:
            self.optimizer, self.scheduler, self._adapter_group = lora_mod.build_adapter_optimizer(
                self.model, self._adapter_trainers(), adapter_steps or {}, self.adapter_step)
        else:
            self.optimizer, self.scheduler = build_optimizer(self.model, trainer, total_steps)
        self.critic: Critic | None = None
        if critic is not None:
            value_model = self._build(critic.model_path or model.path, trainable=True, value_head=True)
            check_same_vocabulary(value_model, self.model, critic.model_path or model.path)
            self.critic = critic_optimizer(value_model, trainer, critic, total_steps)
        if packing is None:
            packing = self.model.config._attn_implementation.startswith("flash_attention")
        self.packed = packing
        if per_sequence and packing:
            raise ValueError("per_sequence micro-batches hold one sequence each; they cannot be packed")
        self.per_sequence = per_sequence
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {list(ROUTING_MODES)}, got {routing!r}")
        self._routing = None if routing == "off" else RoutingReplay(self.model, replay=routing == "replay")

    # ---- model construction ------------------------------------------------------------
    def _build(self, path: str, trainable: bool, value_head: bool = False) -> torch.nn.Module:
        return build_sharded(path, self.model_config, self.mesh, trainable=trainable, value_head=value_head,
                             gradient_checkpointing=self.config.gradient_checkpointing,
                             lora=self.lora if trainable and not value_head else None, adapters=self.adapters,
                             experts_mesh=self.experts_mesh, sequence_parallel=self.config.sequence_parallel)

    @property
    def step(self) -> int:
        return self._step

    # ---- multi-LoRA ----------------------------------------------------------------------
    def _adapter_trainers(self) -> dict[str, TrainerConfig]:
        """Each adapter's optimizer settings: the run's, with its own lr where it sets one."""
        lrs = {adapter.name: adapter.lr for adapter in self.lora.adapters}
        return {name: self.config.model_copy(update={"lr": lrs[name] or self.config.lr}) for name in self.adapters}

    def use_adapter(self, name: str) -> None:
        """Multi-LoRA: the adapter the next forwards apply, the next train step trains and weight sync pushes;
        the others are untouched (no gradient, so their optimizer state and lr schedule do not move)."""
        if name not in self.adapters:
            raise ValueError(f"use_adapter: no adapter {name!r}; this trainer has {sorted(self.adapters)}")
        lora_mod.activate(self.model, name)
        self.active_adapter = name

    # ---- batching ------------------------------------------------------------------------
    def _my_micro_batches(self, items: list[TrainItem]) -> list[list[int]]:
        """This rank's share in micro-batches; every rank ends with the same number of them."""
        lengths = [it.length for it in items]
        share = balance_across_ranks(lengths, self.dp)[self.dp_rank]
        if self.per_sequence:  # each sequence alone, unpadded: the forward the engine scores with
            bins = [[index] for index in share]
        else:
            bins = pack_micro_batches(share, lengths, self.config.max_tokens_per_micro_batch, self.packed)
        count = torch.tensor([len(bins)], dtype=torch.long)
        if self.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._object_group)
        return split_to_count(bins, int(count.item()))

    def _micro_batch(self, items: list[TrainItem], indices: list[int]) -> MicroBatch:
        batch = collate(items, indices, self.packed) if indices else dummy_micro_batch(items[0])
        return (pad_to_chunks(batch, self.cp) if self.context is not None else batch).to(self.device)

    def _forward(self, model: torch.nn.Module, batch: MicroBatch, with_entropy: bool) -> ForwardOutputs:
        routing = self._routing.forward(batch.routed_experts) if self._routing and model is self.model \
            else contextlib.nullcontext()
        if self.context is not None:  # [n_resp_tokens] each, the whole rows gathered from the group's shares
            chosen, entropy = sharded_logprobs(model, batch, self.context, self.temperature, with_entropy)
        else:  # [n_resp_tokens] each; the logits a DTensor where the LM head is vocabulary-parallel
            with routing:
                logits = kept_outputs(model, batch)  # [n_resp_tokens, vocab]
            chosen, entropy = logprobs_and_entropy(logits, batch.targets, self.temperature, with_entropy)
        entropy = batch.pad_responses(entropy) if entropy is not None else None
        return ForwardOutputs(logprobs=batch.pad_responses(chosen), entropy=entropy)

    # ---- forward-only logprobs -----------------------------------------------------------
    @torch.no_grad()
    def logprobs(
        self, batch: Batch, *, reference: bool = False, with_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        if reference and self.ref_model is None and not self._base_is_reference:
            raise ValueError("logprobs(reference=True) but the backend was built without ref_model_path")
        model = self.ref_model if reference and self.ref_model is not None else self.model
        with self.model.disable_adapter() if reference and self._base_is_reference else contextlib.nullcontext():
            return self._logprobs(model, as_items(batch), with_entropy)

    def _logprobs(
        self, model: torch.nn.Module, items: list[TrainItem], with_entropy: bool
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        self._check_routed(items)
        model.eval()
        fields = ("logprobs", "entropy") if with_entropy else ("logprobs",)
        rows = self._per_item(items, functools.partial(self._forward, model, with_entropy=with_entropy), fields)
        logprobs = [row[0] for row in rows]
        if with_entropy:
            return logprobs, [row[1] for row in rows]
        return logprobs

    @torch.no_grad()
    def values(self, batch: Batch) -> list[torch.Tensor]:
        """Forward-only: PPO's value model's V(s_t) per item, `[response_length]` each, in batch order."""
        critic = self._require_critic("values")
        critic.model.eval()
        rows = self._per_item(as_items(batch), functools.partial(value_forward, critic.model), ("values",))
        return [row[0] for row in rows]

    def _per_item(self, items: list[TrainItem], forward: Callable[[MicroBatch], ForwardOutputs],
                  fields: tuple[str, ...]) -> list[tuple[torch.Tensor, ...]]:
        """`fields` of `forward`'s outputs cut to each item's response, gathered from every rank, by item."""
        mine: dict[int, tuple[torch.Tensor, ...]] = {}
        for indices in self._my_micro_batches(items):
            micro = self._micro_batch(items, indices)
            outputs = forward(micro)
            for row, index in enumerate(micro.indices):
                n = items[index].response_length
                mine[index] = tuple(getattr(outputs, name)[row, :n].cpu() for name in fields)
        merged = {k: v for part in gather_objects(self._object_group, mine) for k, v in part.items()}
        return [merged[i] for i in range(len(items))]

    def _require_critic(self, what: str) -> Critic:
        if self.critic is None:
            raise ValueError(f"{what}() needs PPO's value model, but the backend was built without a critic")
        return self.critic

    # ---- training ------------------------------------------------------------------------
    def train_step(
        self,
        batch: Batch,
        loss_fn: LossFn,
        *,
        normalizer: Normalizer = count_policy_tokens,
        with_entropy: bool = False,
    ) -> dict[str, float]:
        items = as_items(batch)
        self._check_routed(items)
        if self._routing is not None:
            self._routing.take_counts()  # this step's forwards only
        forward = functools.partial(self._forward, self.model, with_entropy=with_entropy)
        metrics = self._optimizer_step(self.model, self.optimizer, self.scheduler, self.config.grad_clip,
                                       items, loss_fn, normalizer, forward, policy=True)
        self._step += 1
        return metrics | self._routing_metrics()

    def train_critic(self, batch: Batch, loss_fn: LossFn, *, normalizer: Normalizer = count_policy_tokens
                     ) -> dict[str, float]:
        """One optimizer step of PPO's value model; `loss_fn` gets `ForwardOutputs.values`. Returns the loss
        fn's metrics (`train/value_loss`, ...) and `train/value_grad_norm`, `train/value_lr`."""
        critic = self._require_critic("train_critic")
        metrics = self._optimizer_step(critic.model, critic.optimizer, critic.scheduler, critic.grad_clip,
                                       as_items(batch), loss_fn, normalizer,
                                       functools.partial(value_forward, critic.model), policy=False)
        step_keys = ("train/loss", "train/grad_norm", "train/lr", "perf/train_tokens_per_s")
        return {**{k: v for k, v in metrics.items() if k not in step_keys},
                "train/value_grad_norm": metrics["train/grad_norm"], "train/value_lr": metrics["train/lr"]}

    def _optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip: float, items: list[TrainItem],
                        loss_fn: LossFn, normalizer: Normalizer,
                        forward: Callable[[MicroBatch], ForwardOutputs], *, policy: bool) -> dict[str, float]:
        """One optimizer step of `model` over the global batch: the policy's (multi-LoRA: the active
        adapter's lr group and step count) or the critic's."""
        start = time.perf_counter()
        self._saves.wait_staged()  # a background save's copy of the weights and optimizer state is made first
        total = float(normalizer(pad_right([it.loss_mask for it in items])))
        if not total > 0:
            raise ValueError(f"the global batch's normaliser is {total}: no policy tokens (loss_mask all 0)")
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        metric_sums: dict[str, float] = {}
        for indices in self._my_micro_batches(items):
            micro = self._micro_batch(items, indices)
            outputs = forward(micro)
            if not indices:  # a dummy keeps this rank in step with the collectives
                (_any_output(outputs).sum() * 0.0).backward()
                continue
            loss, metrics = loss_fn(outputs, micro, total)
            # FSDP averages gradients over the data-parallel ranks (and cp, whose equal losses the gathered logprobs'
            # backward sums); the losses are global sums, so undo it. A vocabulary-parallel head's: loss_parallel.
            with loss_parallel() if self.tp > 1 else contextlib.nullcontext():
                (loss * self.dp).backward()
            loss_sum += loss.detach()
            weight = float(normalizer(micro.loss_mask)) / total
            for key, value in metrics.items():
                combine_metric(metric_sums, key, float(value), weight)
        if self.tp > 1:
            sum_norm_grads(model, self.mesh["tp"], self.config.sequence_parallel)
        grad_norm = self._clip_gradients(model, grad_clip)
        lr = scheduler.get_last_lr()[self._active_group() if policy else 0]
        optimizer.step()  # parameters without a gradient (inactive adapters) are left as they are
        if policy and self.adapters:
            self.adapter_step[self.active_adapter] += 1  # the schedules' lambdas read it
        scheduler.step()
        # The summed micro-batch losses are the global loss, whatever a loss fn reports as its own.
        local = {**train_namespaced(metric_sums), "train/loss": float(loss_sum.item())}
        parts = gather_objects(self._object_group, (local, time.perf_counter() - start))
        metrics: dict[str, float] = {}
        for part, _ in parts[::self.tp * self.cp]:  # one rank per tensor- or context-parallel group: the others' are the same
            for key, value in part.items():
                combine_metric(metrics, key, value, 1.0)  # each rank's part is already weighted
        tokens_per_s = sum(it.length for it in items) / max(elapsed for _, elapsed in parts)
        return {**metrics, "train/grad_norm": grad_norm, "train/lr": lr, "perf/train_tokens_per_s": tokens_per_s}

    def _check_routed(self, items: list[TrainItem]) -> None:
        if self._routing is not None:
            self._routing.check_items(items)

    def _routing_metrics(self) -> dict[str, float]:
        """`train/routing_mismatch_rate` over all ranks (collective; one rank per group that shares micro-batches)."""
        if self._routing is None:
            return {}
        return mismatch_rate(gather_objects(self._object_group, self._routing.take_counts())[::self.tp * self.cp])

    def _active_group(self) -> int:
        """The optimizer's first param group of the active adapter (multi-LoRA: one lr per adapter)."""
        return self._adapter_group[self.active_adapter] if self.adapters else 0

    def _clip_gradients(self, model: torch.nn.Module, grad_clip: float) -> float:
        trained = [p for p in model.parameters() if p.requires_grad]
        if self.tp == 1 and self.experts_mesh is None:
            norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip)
        else:  # parameters on several meshes
            norm = clip_grad_norm_across_meshes(trained, grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        value = float(norm.item())
        if not math.isfinite(value):
            raise FloatingPointError(f"gradient norm is {value} at train step {self._step}; the step is refused")
        return value

    # ---- weights and checkpoints -----------------------------------------------------------
    def named_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Collective: every rank gathers every tensor in the same order (tied weights appear once). With
        LoRA: the merged weights, under the base's names (the model itself is not changed)."""
        if self.adapters:
            raise ValueError("named_weights: a multi-LoRA model has no one merged policy; sync its adapters by name")
        tensors = lora_mod.merged_tensors(self.model) if self.lora else persistence.named_tensors(self.model)
        yield from full_buckets(tensors, bucket_bytes)

    @property
    def sync_adapter(self) -> tuple[str, dict] | None:
        """With LoRA's adapter sync (`lora.sync = "adapter"`): the adapter's served name and its
        adapter_config.json content, which every push carries; None when weight sync sends full weights."""
        if self.lora is None or self.lora.served_adapter is None:
            return None
        if self.adapters:  # multi-LoRA: the active adapter, under its own name
            return self.active_adapter, lora_mod.adapter_config(self.model, self.model_config.path, self.active_adapter)
        return self.lora.served_adapter, lora_mod.adapter_config(self.model, self.model_config.path)

    def synced_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Collective: what weight sync pushes. With LoRA's adapter sync, the adapter's tensors under PEFT's
        names (one bucket per `bucket_bytes`); otherwise `named_weights`."""
        if self.lora is None or self.lora.served_adapter is None:
            yield from self.named_weights(bucket_bytes)
            return
        yield from full_buckets(lora_mod.adapter_tensors(self.model, self.active_adapter), bucket_bytes)

    def save(self, directory: str | Path, *, background: bool = False) -> None:
        """With `background`, the shards are copied now and written by a thread; the directory is complete
        once every rank's `done_rank<R>` is there and COMPLETE is written (`persistence.save`)."""
        self._saves.save(directory, self.model, self.optimizer, self.scheduler, self._step, background=background,
                         critic=self.critic, extra={"adapter_step": dict(self.adapter_step)},
                         tensor_parallel_size=self.tp, context_parallel_size=self.cp)

    def wait_saves(self) -> None:
        """Wait for a background save's write (its error is raised here)."""
        self._saves.wait()

    def load(self, directory: str | Path) -> None:
        self.wait_saves()
        self._step = persistence.load(Path(directory), self.model, self.optimizer, self.scheduler, self.critic, self.tp,
                                      self.cp)
        if self.adapters:
            saved = persistence.saved_extra(Path(directory)).get("adapter_step", {})
            if set(saved) != set(self.adapters):
                raise ValueError(f"checkpoint {directory} holds the adapters {sorted(saved)}, this run trains "
                                 f"{sorted(self.adapters)} (lora.adapters)")
            self.adapter_step.update(saved)  # the optimizer's param groups came back with their lrs

    def export_hf(self, directory: str | Path, *, merge_lora: bool = False) -> None:
        """A Hugging Face checkpoint; with LoRA, the PEFT adapter directory, and with `merge_lora` the merged
        model in its `merged/` (`lora.export`)."""
        if self.lora:
            lora_mod.export(Path(directory), self.model, self.model_config.path, self.model_config.dtype, merge_lora,
                            list(self.adapters) or None)
        else:
            persistence.export_hf(Path(directory), self.model, self.model_config.path, self.model_config.dtype)


def _same_path(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _any_output(outputs: ForwardOutputs) -> torch.Tensor:
    """A tensor of the forward's graph (a dummy micro-batch's zero loss reaches every parameter through it)."""
    return outputs.logprobs if outputs.logprobs is not None else outputs.values
