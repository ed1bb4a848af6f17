"""Tensor parallelism for the dense Llama / Qwen causal LMs (verst's native model and transformers'): the
Megatron column/row plan applied with torch's `parallelize_module` over the mesh's "tp" axis, before FSDP2
shards the result over "dp".

Per decoder layer, q/k/v and gate/up split their output features (whole heads, whole MLP columns) and
o/down split their input features, so attention and the MLP each cost one all-reduce forward and one
backward. The embedding and LM head split the vocabulary (tied or not: a tied head is the embedding's one sharded
parameter): a lookup sums its partial rows over "tp", the logits stay a DTensor sharded over the vocabulary and
`vocab_parallel_logprobs` reduces them without any rank holding a full row. Norms are replicated over "tp" (FSDP2
still shards them over "dp"); Qwen3's per-head q/k norms see only their rank's heads, so `sum_norm_grads` adds
their gradients over "tp" after backward.

With sequence parallelism (`SEQUENCE_PARALLEL_PLAN`) the residual stream between the regions is split over "tp"
along the sequence (`verst.models.sequence_parallel`; around transformers' decoder stack, `TransformersRows`):
attention and the MLP each all-gather their normed input once and end in a reduce-scatter instead of the
all-reduce; the norms then see their rank's positions only, so their gradients are summed over "tp" too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from verst.models.scoring import token_logprobs
from verst.models.sequence_parallel import SequenceShard
from verst.trainer.batching import takes_logit_masks
from verst.trainer.distributed import data_by

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}

# The same, the residual stream split over the sequence between the regions: each region's input (the normed
# share) gathered once, DTensor [batch, seq, hidden] replicated for q/k/v or gate/up, whose input gradients (partial
# over "tp") the gather's backward reduce-scatters; o/down reduce-scatter their output onto the shares.
# Attention.forward(x, cos, sin, mask, shard): only x is laid out.
SEQUENCE_PARALLEL_PLAN = {
    **LAYER_PLAN,
    "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                    desired_input_layouts=(Replicate(), None, None, None, None)),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}

# transformers' attention takes its input as the keyword `hidden_states`.
TRANSFORMERS_SEQUENCE_PARALLEL_PLAN = {
    **SEQUENCE_PARALLEL_PLAN,
    "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
}


# Models whose layers carry the plan's names and count heads from the projections' widths (transformers' reshape
# by -1, as the native model's): the dense Llama / Qwen2 / Qwen3 families.
PLANNED_MODELS = frozenset({"NativeCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def trainer_mesh(device_type: str, world_size: int, tp: int) -> DeviceMesh:
    """All ranks on one axis (FSDP2 alone), or [dp, tp] named ("dp", "tp"): a tensor-parallel group holds
    consecutive ranks, which see the same micro-batches."""
    if tp == 1:
        return init_device_mesh(device_type, (world_size,))
    return data_by("tp", tp, "trainer.tensor_parallel_size", device_type, world_size)


def check_divisible(config: object, tp: int) -> None:
    """Whole heads and whole MLP columns on each rank; the message names the count that does not split. (The
    vocabulary need not divide: its rows are chunked as `torch.chunk` does, the first ranks holding one more.)"""
    counts = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
              "intermediate_size": config.intermediate_size}
    for name, count in counts.items():
        if count % tp:
            raise ValueError(f"trainer.tensor_parallel_size = {tp} does not divide the model's {name} = {count}")


def parallelize(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> bool:
    """Apply the plan to `model` (one of `PLANNED_MODELS`) in place, with `sequence_parallel` the residual stream
    split over the sequence between the regions. Returns whether the embedding and LM head are vocabulary-parallel
    (`parallelize_vocabulary`): always but in transformers' releases without a boolean `logits_to_keep`."""
    name = type(model).__name__
    if name not in PLANNED_MODELS:
        raise ValueError(f"trainer.tensor_parallel_size > 1 has a plan for {sorted(PLANNED_MODELS)}, not {name}")
    check_divisible(model.config, tp_mesh.size())
    native = name == "NativeCausalLM"
    plan = LAYER_PLAN
    if sequence_parallel:
        plan = SEQUENCE_PARALLEL_PLAN if native else TRANSFORMERS_SEQUENCE_PARALLEL_PLAN
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel and native:
        model.sequence_parallel_enable(SequenceShard(tp_mesh))
    elif sequence_parallel:
        TransformersRows(SequenceShard(tp_mesh)).hook(model)
    # before transformers took a boolean `logits_to_keep`, its model returned every position's logits, cut by a
    # boolean index afterwards (`kept_outputs`), which a DTensor does not take: embedding and head replicated there
    vocab_parallel = native or takes_logit_masks(model)
    if vocab_parallel:
        # transformers' model builds its mask from the whole embedding output, split entering the first layer
        parallelize_vocabulary(model, tp_mesh, scatter=sequence_parallel and native)
    return vocab_parallel


def parallelize_vocabulary(model: torch.nn.Module, tp_mesh: DeviceMesh, scatter: bool) -> None:
    """The embedding and the LM head split over the vocabulary: `Shard(0)` of their [vocab, hidden] weights. A lookup
    masks the ids outside this rank's rows and sums the partial rows over "tp" (with `scatter` reduce-scatters them
    onto this rank's positions, sequence parallelism's split); the head takes [kept, hidden] replicated and returns
    [kept, vocab] sharded over the vocabulary (a DTensor). A tied head is pointed at the embedding's sharded
    parameter again (the plan distributes each module's weight anew): one parameter, which FSDP2 then shards over
    "dp"."""
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1) if scatter else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    })
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


class TransformersRows:
    """Sequence parallelism's split and gathers around transformers' decoder stack, where the native model's forward
    has them: the rows widened to split evenly (`SequenceShard.pad`), split entering the first decoder layer (the
    mask and rotary embeddings are built from the whole embedding output before it), gathered after the final norm
    and cut to their own width before the head."""

    def __init__(self, shard: SequenceShard):
        self.shard, self.width = shard, 0  # the width of the rows in the forward under way

    def hook(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self.widen, with_kwargs=True)
        model.model.layers[0].register_forward_pre_hook(self.split)
        model.model.norm.register_forward_hook(self.gather)

    def widen(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rows = kwargs["input_ids"]  # [batch, width]
        self.width = rows.shape[1]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(self.width, device=rows.device)[None].expand_as(rows)
        kwargs["input_ids"], kwargs["position_ids"] = self.shard.pad(rows, positions)
        return args, kwargs

    def split(self, module: torch.nn.Module, args: tuple) -> tuple:
        return (self.shard.split(args[0]), *args[1:])

    def gather(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.shard.gather(output)[:, :self.width]


HEAD_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")
SEQUENCE_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight")


def sum_norm_grads(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """The per-head norms' gradients (each rank saw a share of the heads) and, with `sequence_parallel`, the
    layer and final norms' (each rank saw a share of the positions) summed over the tensor-parallel ranks; after
    FSDP2's reduction over "dp", on each rank's data-parallel shard."""
    partial = HEAD_NORMS + SEQUENCE_NORMS if sequence_parallel else HEAD_NORMS
    for name, param in model.named_parameters():
        if name.endswith(partial) and param.grad is not None:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=tp_mesh.get_group())


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                         with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) [n] and, if asked, the entropy [n] from `logits` [n, vocab]: a whole row per rank, or a
    DTensor sharded over the vocabulary (`vocab_parallel_logprobs`)."""
    if isinstance(logits, DTensor):
        return vocab_parallel_logprobs(logits, targets, temperature, with_entropy)
    chosen, log_probs = token_logprobs(logits, targets, temperature)  # [n], [n, vocab]
    return chosen, -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None


def vocab_parallel_logprobs(logits: DTensor, targets: torch.Tensor, temperature: float,
                            with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) [n] and, if asked, the entropy [n] from `logits` [n, vocab] sharded over the vocabulary,
    never a whole row on one rank. Without the entropy: torch's `loss_parallel` log-softmax. With it: both from
    one log-sum-exp (`_vocab_parallel_both`), two reductions for the two."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if with_entropy:
        return _vocab_parallel_both(logits, targets)
    with loss_parallel():
        log_probs = torch.log_softmax(logits, dim=-1)  # DTensor [n, vocab], sharded over the vocabulary
        chosen = -torch.nn.functional.nll_loss(log_probs, targets, reduction="none")
    return (chosen.full_tensor() if isinstance(chosen, DTensor) else chosen), None


def _vocab_parallel_both(logits: DTensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(target) = z_target − L and the entropy L − Σ p z, with L = log Σ e^z and Σ p z = Σ e^z z / Σ e^z,
    from each rank's shard of `logits` [n, vocab] and two reductions over the group: the max, then one sum of
    Σ e^z, Σ e^z z and the target's logit (which only the rank whose shard holds it adds). Every rank computes
    the same loss from the sums, so their backward hands each rank the sums' gradient as its part's
    (`_SumOverGroup`); nothing downstream of a sum uses a rank's own part, so each shard's gradient is the single
    rank's."""
    local, mesh = logits.to_local(), logits.device_mesh
    group, vocab, width = mesh.get_group(), logits.shape[-1], local.shape[-1]
    chunk = -(-vocab // mesh.size())  # DTensor's Shard: chunks of ceil(vocab / ranks), the last ones shorter
    start = mesh.get_local_rank() * chunk
    expected = max(0, min(chunk, vocab - start))
    if width != expected:
        raise RuntimeError(f"vocabulary shard of rank {mesh.get_local_rank()}: {width} logits where chunks of "
                           f"{chunk} over {vocab} give {expected}")
    peak = local.detach().amax(-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # [n, 1]: a shift, no gradient
    exps = (local - peak).exp()
    held = (targets >= start) & (targets < start + width)
    target_logit = local.gather(-1, (targets - start).clamp(0, width - 1)[:, None]).squeeze(-1) * held
    parts = torch.stack((exps.sum(-1), (exps * local).sum(-1), target_logit), dim=-1)  # [n, 3]
    total, weighted, chosen_logit = _SumOverGroup.apply(parts, group).unbind(-1)
    log_total = peak.squeeze(-1) + total.log()
    return chosen_logit - log_total, log_total - weighted / total


class _SumOverGroup(torch.autograd.Function):
    """A sum over the ranks of `group` whose result every rank uses alike: forward all-reduces, backward hands each
    rank the result's gradient as its part's (Megatron's reduce-from-model-parallel-region)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
