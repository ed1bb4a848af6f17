"""Trajectory assembly: loss mask and logprobs line up token for token (1 / the engine's logprob on sampled
ids, 0 / 0.0 on prompt, tool and template ids), status from the finish reasons, cuts at turn boundaries."""

import pytest

from verst.session.assemble import ERROR_KEY, Trajectory, assemble
from verst.types import Status


def three_turns(reasons=("stop", "stop", "stop")):
    t = Trajectory()
    t.add_turn([1, 2, 3], [10, 11], [-0.1, -0.2], reasons[0], "4")
    t.add_turn([20], [12], [-0.3], reasons[1], "5", n_messages_before=2)
    t.add_turn([21, 22], [13, 14, 15], [-0.4, -0.5, -0.6], reasons[2], "5", n_messages_before=4)
    return t


def test_tokens_mask_and_logprobs_line_up():
    sample = assemble(three_turns(), decode=lambda ids: ",".join(map(str, ids)))
    assert sample.tokens == [1, 2, 3, 10, 11, 20, 12, 21, 22, 13, 14, 15]
    assert sample.prompt_tokens == [1, 2, 3] and sample.response_length == 9
    assert sample.loss_mask == [1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert sample.rollout_logprobs == [-0.1, -0.2, 0.0, -0.3, 0.0, 0.0, -0.4, -0.5, -0.6]
    assert sample.weight_versions == ["4", "5", "5"] and sample.status is Status.COMPLETED
    assert sample.response == "13,14,15"  # the last reply: the final answer for rewards
    assert [t["output_tokens"] for t in sample.metadata["turns"]] == [2, 1, 3]


@pytest.mark.parametrize("reasons, status", [
    (("stop", "stop", "length"), Status.TRUNCATED),
    (("length", "stop", "stop"), Status.COMPLETED),  # a cut reply the agent went on from is still a turn
    (("stop", "abort", "stop"), Status.ABORTED),
])
def test_status_comes_from_the_finish_reasons(reasons, status):
    assert assemble(three_turns(reasons)).status is status


def test_truncation_keeps_whole_turns_only():
    sample = assemble(three_turns(), max_tokens=8)  # turn 2 ends at 7, turn 3 at 12
    assert sample.tokens == [1, 2, 3, 10, 11, 20, 12] and sample.status is Status.TRUNCATED
    assert sample.weight_versions == ["4", "5"] and "cut after 2 of 3 turns" in sample.metadata[ERROR_KEY]
    too_small = assemble(three_turns(), max_tokens=4)
    assert too_small.status is Status.ABORTED and "max_tokens = 4" in too_small.metadata[ERROR_KEY]


def test_a_context_limit_reached_after_the_last_turn_truncates():
    t = three_turns()
    t.truncated = "no room"
    sample = assemble(t)
    assert sample.status is Status.TRUNCATED and sample.metadata[ERROR_KEY] == "no room"


def test_rollback_drops_the_last_turn_and_its_environment_ids():
    t = three_turns()
    dropped = t.rollback()
    assert dropped.n_messages_before == 4 and t.ids == [1, 2, 3, 10, 11, 20, 12]
    assert t.model_mask() == [0, 0, 0, 1, 1, 0, 1]
    assert t.sampled_end(1, 12) and not t.sampled_end(0, 12)


def test_no_turn_is_an_aborted_sample_and_bad_turns_are_refused():
    empty = assemble(Trajectory())
    assert empty.status is Status.ABORTED and "never asked" in empty.metadata[ERROR_KEY]
    with pytest.raises(ValueError, match="2 logprobs for 1 output ids"):
        Trajectory().add_turn([1], [2], [-0.1, -0.2], "stop", "0")
    with pytest.raises(ValueError, match="finish_reason 'tool_calls'"):
        Trajectory().add_turn([1], [2], [-0.1], "tool_calls", "0")


def test_token_versions_line_up_with_the_response_when_every_turn_recorded_them():
    t = Trajectory()
    t.add_turn([1, 2, 3], [10, 11], [-0.1, -0.2], "stop", "4", token_versions=[4, 4])
    # continued across an update: two calls, the tokens before it by 5, after it by 6
    t.add_turn([20, 21], [12, 13, 14], [-0.3, -0.4, -0.5], "stop", "5", later_versions=["6"],
               token_versions=[5, 6, 6])
    sample = assemble(t)
    # the environment ids between the turns carry the version of the call that read them (the next turn's first)
    assert sample.token_versions == [4, 4, 5, 5, 5, 6, 6] and sample.weight_versions == ["4", "5", "6"]
    assert sample.metadata["turns"][1]["continued"] == 1
    t.add_turn([22], [15], [-0.6], "stop", "6")  # a turn without versions (unknown, or not recorded)
    assert assemble(t).token_versions is None and assemble(t, max_tokens=10).token_versions is not None  # cut before it
    with pytest.raises(ValueError, match="turn 3: 1 token versions for 2 output ids"):
        t.add_turn([1], [2, 3], [-0.1, -0.2], "stop", "0", token_versions=[0])
