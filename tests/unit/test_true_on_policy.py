"""`algorithm.true_on_policy`: the shared scoring arithmetic, and the start-up refusals where bitwise
equal logprobs cannot hold (each naming its field)."""

import pytest
import torch

from verst.config import ConfigError, load_config
from verst.models.scoring import sequence_inputs, token_logprobs
from verst.trainer.batching import collate
from verst.trainer.items import TrainItem


def test_token_logprobs_follow_the_definition():
    generator = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(5, 11, generator=generator), torch.tensor([0, 3, 10, 4, 4])
    for temperature in (1.0, 0.7):
        chosen, full = token_logprobs(logits, targets, temperature)
        reference = torch.log_softmax(logits.double() / temperature, dim=-1)
        torch.testing.assert_close(full.double(), reference, atol=1e-6, rtol=0)
        assert torch.equal(chosen, full[torch.arange(5), targets])


def test_the_engines_scoring_inputs_are_the_trainers_one_sequence_micro_batch():
    tokens = [4, 8, 15, 16, 23, 42]
    micro = collate([TrainItem(tokens, 2, torch.ones(2), {}, 0)], [0], packed=False)
    inputs = sequence_inputs(tokens, 2)
    assert torch.equal(inputs["input_ids"], micro.input_ids)
    assert torch.equal(inputs["position_ids"], micro.position_ids)
    assert torch.equal(inputs["logits_to_keep"], micro.logits_to_keep)


@pytest.mark.parametrize("override, field", [
    (["--model.dtype", "bfloat16"], "model.dtype"),
    (["--model.impl", "transformers"], "model.impl"),
    (["--cluster.engine", "vllm"], "cluster.engine"),
    (["--cluster.device", "cuda"], "cluster.device"),
    (["--lora.enabled", "true"], "lora.enabled"),
])
def test_true_on_policy_is_refused_where_it_cannot_hold(override, field):
    with pytest.raises(ConfigError, match=f"algorithm.true_on_policy = true needs {field} = .* got {field} = "):
        load_config(None, ["--algorithm.true-on-policy", "true", *override])
