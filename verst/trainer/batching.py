"""Dynamic batching: balance a global batch across ranks by tokens, split each rank's share into
micro-batches under a token budget, and collate one micro-batch into model inputs.

Layout: a micro-batch is `[rows, width]` with no attention mask. Each row holds whole sequences
back to back, their position ids restarting at 0, then right padding that is just one more
segment (positions restart too). transformers turns restarting position ids into a block-diagonal
causal mask (flash-attention into varlen boundaries), so a sequence sees only itself and padding is
never attended to. `packed=False` puts one sequence per row (cheapest for dense CPU attention, whose
cost grows with the square of the row); `packed=True` puts the whole micro-batch in one row.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import torch

from verst.trainer.items import TrainItem


@dataclasses.dataclass
class MicroBatch:
    """One packed micro-batch of whole sequences; what a loss fn receives as `batch`.

    Per-token training tensors are response-aligned and right-padded: `[n_seq, max_resp]`, zero on
    padding. `batch["advantages"]` reads an extra; `loss_mask` is 0 on padding and env tokens.
    """

    indices: list[int]  # positions of these sequences in the global batch
    input_ids: torch.Tensor  # [rows, width] sequences back to back, then padding
    position_ids: torch.Tensor  # [rows, width] restart at 0 per sequence and for the padding
    logits_to_keep: torch.Tensor  # [rows, width] bool: positions whose logits predict a response token
    targets: torch.Tensor  # [n_resp_tokens] those response tokens, in row-major order
    response_lengths: torch.Tensor  # [n_seq] int64
    loss_mask: torch.Tensor  # [n_seq, max_resp] float32
    extras: dict[str, torch.Tensor]  # each [n_seq, max_resp] float32
    # MoE: the engine's expert choices aligned with input_ids, -1 where none (padding, last tokens)
    routed_experts: torch.Tensor | None = None  # [rows, width, moe_layers, top_k] int64

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.extras:
            raise KeyError(f"micro-batch has no extra {name!r}; it carries {sorted(self.extras)}")
        return self.extras[name]

    @property
    def num_tokens(self) -> int:
        """Tokens fed to the model, padding included."""
        return int(self.input_ids.numel())

    def pad_responses(self, flat: torch.Tensor) -> torch.Tensor:
        """[n_resp_tokens, ...] in packed order -> [n_seq, max_resp, ...], zero-padded."""
        columns = torch.arange(self.loss_mask.shape[1], device=flat.device)
        valid = columns[None] < self.response_lengths[:, None]  # [n_seq, max_resp]
        out = flat.new_zeros((*self.loss_mask.shape, *flat.shape[1:]))
        out[valid] = flat
        return out

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        moved["extras"] = {k: v.to(device, non_blocking=True) for k, v in self.extras.items()}
        if self.routed_experts is not None:
            moved["routed_experts"] = self.routed_experts.to(device, non_blocking=True)
        return MicroBatch(**moved)


@dataclasses.dataclass
class ForwardOutputs:
    """What a loss fn receives as `outputs`: response-aligned like the micro-batch's tensors. The policy's
    forward fills `logprobs` (and `entropy`), PPO's value model's forward `values`."""

    logprobs: torch.Tensor | None = None  # [n_seq, max_resp] log π(response token), 0 on padding
    entropy: torch.Tensor | None = None  # [n_seq, max_resp] when asked for
    values: torch.Tensor | None = None  # [n_seq, max_resp] the critic's V(s_t), 0 on padding


def balance_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Split item indices into `world_size` lists with near-equal token sums (greedy LPT).

    Deterministic: every rank computes the same split from the same lengths.
    """
    loads = [(0, rank) for rank in range(world_size)]  # (tokens, rank) min-heap
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, rank = heapq.heappop(loads)
        shares[rank].append(index)
        heapq.heappush(loads, (tokens + lengths[index], rank))
    return [sorted(share) for share in shares]


MAX_PADDED_WIDTH = 2  # padded micro-batches: a row's width is at most this many times its length (see below)


def pack_micro_batches(indices: list[int], lengths: list[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """First-fit-decreasing split of whole sequences into micro-batches of <= max_tokens tokens.

    The budget counts what the model sees: the sum of lengths when packed, rows × longest row
    otherwise (sequences arrive longest first, so a micro-batch's first sequence sets its width).
    Padded, a sequence joins only a micro-batch at most `MAX_PADDED_WIDTH` times its own length: under
    long-tailed lengths one long response would otherwise pad every short row to its width (a 4-token
    row at 134 costs 33 times its compute), while this adds at most log2(longest / shortest) micro-batches.
    """
    bins: list[list[int]] = []
    used: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        if n > max_tokens:
            raise ValueError(
                f"train item {index} has {n} tokens, more than trainer.max_tokens_per_micro_batch = "
                f"{max_tokens}; raise the budget (sequences are never split)"
            )
        for b, members in enumerate(bins):
            width = lengths[members[0]]
            cost = used[b] + n if packed else (len(members) + 1) * width
            if cost <= max_tokens and (packed or width <= MAX_PADDED_WIDTH * n):
                members.append(index)
                used[b] += n
                break
        else:
            bins.append([index])
            used.append(n)
    return [sorted(b) for b in bins]


def split_to_count(bins: list[list[int]], count: int) -> list[list[int]]:
    """Grow `bins` to exactly `count` micro-batches by halving the fullest; empty ones when out.

    Every rank must run the same number of forward/backward passes (FSDP collectives), so a rank
    with less work splits its micro-batches or, with too few sequences, runs empty (dummy) ones.
    """
    if count < len(bins):
        raise ValueError(f"cannot shrink {len(bins)} micro-batches to {count}")
    bins = [list(b) for b in bins]
    while len(bins) < count:
        widest = max(range(len(bins)), key=lambda b: len(bins[b])) if bins else None
        if widest is None or len(bins[widest]) < 2:
            bins.append([])
            continue
        seqs = bins.pop(widest)
        bins += [seqs[0::2], seqs[1::2]]
    return bins


def collate(items: list[TrainItem], indices: list[int], packed: bool) -> MicroBatch:
    """The items at `indices` as one micro-batch; see the module docstring for the layout."""
    rows = [list(indices)] if packed else [[i] for i in indices]
    width = max(sum(items[i].length for i in row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # padding id 0 is never attended to
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    targets = []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            item = items[i]
            input_ids[r, offset : offset + item.length] = item.tokens
            position_ids[r, offset : offset + item.length] = torch.arange(item.length)
            # The logits at position p predict token p + 1: response token j of a sequence is
            # predicted at its position prompt_length - 1 + j.
            first = offset + item.prompt_length - 1
            keep[r, first : first + item.response_length] = True
            targets.append(item.tokens[item.prompt_length :])
            offset += item.length
        position_ids[r, offset:] = torch.arange(width - offset)
    chosen = [items[i] for i in indices]
    return MicroBatch(
        routed_experts=_routed_experts(items, rows, width),
        indices=list(indices),
        input_ids=input_ids,
        position_ids=position_ids,
        logits_to_keep=keep,
        targets=torch.cat(targets),
        response_lengths=torch.tensor([it.response_length for it in chosen], dtype=torch.long),
        loss_mask=pad_right([it.loss_mask for it in chosen]),
        extras={name: pad_right([it.extras[name] for it in chosen]) for name in chosen[0].extras},
    )


def _routed_experts(items: list[TrainItem], rows: list[list[int]], width: int) -> torch.Tensor | None:
    """The items' recorded expert choices laid out like the input ids [rows, width, layers, top_k], -1
    elsewhere; None when no item carries any."""
    recorded = [items[i].routed_experts for row in rows for i in row if items[i].routed_experts is not None]
    if not recorded:
        return None
    out = torch.full((len(rows), width, *recorded[0].shape[1:]), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            experts = items[i].routed_experts
            if experts is not None:
                out[r, offset : offset + len(experts)] = experts
            offset += items[i].length
    return out


def dummy_micro_batch(like: TrainItem) -> MicroBatch:
    """A two-token sequence with no policy tokens, for ranks that have run out of work."""
    extras = {name: torch.zeros(1) for name in like.extras}
    item = TrainItem(like.tokens[:1].repeat(2), 1, torch.zeros(1), extras, index=-1)
    batch = collate([item], [0], packed=True)
    batch.indices = []
    return batch


def pad_right(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n][len_i] -> [n, max_len], zero-padded on the right."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0.0)


def kept_outputs(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The model's outputs (logits, or a value head's values) at `batch.logits_to_keep`'s positions, [kept, out]:
    the head runs on those positions only where the model takes a boolean mask, else on every position and
    the kept rows are selected here."""
    if takes_logit_masks(model):
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, logits_to_keep=batch.logits_to_keep,
                     use_cache=False).logits
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[batch.logits_to_keep]


def takes_logit_masks(model: torch.nn.Module) -> bool:
    """verst's native models take a [rows, width] boolean `logits_to_keep`; transformers' since the release
    that added `slice_logits_to_keep` (before it, a tensor indexes the sequence axis, e.g. in 5.17)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a PEFT wrapper
    # FSDP2 subclasses the model's class: its bases tell what it is
    transformers_model = any(cls.__module__.startswith("transformers.") for cls in type(base).__mro__)
    return not transformers_model or transformers_slices_by_mask()


@functools.cache
def transformers_slices_by_mask() -> bool:
    """Whether the installed transformers' causal LMs take a boolean `logits_to_keep` mask."""
    from transformers import modeling_utils

    return hasattr(modeling_utils, "slice_logits_to_keep")
