"""Routing replay's pure parts: the replayed routing weights against a float64 reference and against
Qwen3-MoE's own router, the count of disagreeing choices, the micro-batch layout of recorded experts,
and the start-up refusals of `algorithm.routing_replay`."""

import pytest
import torch

from verst.config import ConfigError, load_config
from verst.trainer.batching import collate
from verst.trainer.items import TrainItem, TrainItemError
from verst.trainer.routing import choice_mismatches, replay_weights


def reference_weights(logits, experts, norm):
    """R3's rule in float64: softmax over every expert, read at the replayed ones, renormalised."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights = probs.gather(-1, experts)
    return weights / weights.sum(-1, keepdim=True) if norm else weights


@pytest.mark.parametrize("norm", [True, False])
def test_replay_weights_follow_the_definition(norm):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 6, generator=generator)
    experts = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(7)])
    got = replay_weights(logits, experts, norm)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_weights(logits, experts, norm), atol=1e-7, rtol=0)


def test_replaying_the_routers_own_choice_gives_its_own_weights_bit_for_bit():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    logits, weights, indices = router(hidden)
    assert torch.equal(replay_weights(logits, indices, router.norm_topk_prob), weights)


def test_choice_mismatches_count_missing_choices_ignoring_order():
    own = torch.tensor([[0, 1], [2, 3], [1, 0]])
    recorded = torch.tensor([[1, 0], [2, 0], [3, 2]])
    assert choice_mismatches(own, recorded) == (3, 6)  # row 1: 0 missing; row 2: 3 and 2 missing
    assert choice_mismatches(own[:0], recorded[:0]) == (0, 0)


def item(tokens, response_length, experts, index):
    return TrainItem(tokens, response_length, torch.ones(response_length), {}, index, experts)


def test_collate_lays_recorded_experts_out_like_the_input_ids():
    a = item([1, 2, 3, 4], 2, torch.arange(3 * 2 * 2).reshape(3, 2, 2), 0)
    b = item([5, 6], 1, None, 1)
    c = item([7, 8, 9], 1, torch.full((2, 2, 2), 3), 2)
    padded = collate([a, b, c], [0, 1, 2], packed=False)
    experts = padded.routed_experts  # [rows, width, layers, top_k]
    assert experts.shape == (3, 4, 2, 2)
    assert torch.equal(experts[0, :3], a.routed_experts) and (experts[0, 3] == -1).all()
    assert (experts[1] == -1).all()  # an item without a record: its router decides
    assert torch.equal(experts[2, :2], c.routed_experts) and (experts[2, 2:] == -1).all()
    packed = collate([a, c], [0, 1], packed=True).routed_experts
    assert packed.shape == (1, 7, 2, 2)
    assert torch.equal(packed[0, 4:6], c.routed_experts) and (packed[0, [3, 6]] == -1).all()
    assert collate([b], [0], packed=False).routed_experts is None


def test_train_item_checks_the_routed_experts_length():
    with pytest.raises(TrainItemError, match=r"routed_experts has shape \(4, 2, 2\), expected \(3, moe_layers"):
        item([1, 2, 3, 4], 2, torch.zeros(4, 2, 2), 0)


@pytest.mark.parametrize("override, message", [
    (["--cluster.engine", "vllm", "--sync.transport", "disk"],
     "algorithm.routing_replay = 'replay' needs engines .* cluster.engine = 'vllm'"),
    (["--rollout.agent-fn", "pkg.agent:run"], "rollout.agent_fn = 'pkg.agent:run' does not record them"),
])
def test_routing_replay_refusals_name_the_fields(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--algorithm.routing-replay", "replay", *override])
