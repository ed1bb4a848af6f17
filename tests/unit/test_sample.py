import pytest

from verst.types import (
    Sample,
    SampleError,
    Status,
    decode_samples,
    encode_samples,
    expand_group,
    group_is_aborted,
    group_staleness,
)


def make_sample(**kw) -> Sample:
    base = dict(
        tokens=[1, 2, 3, 4, 5, 6],
        response_length=3,
        loss_mask=[1, 0, 1],
        rollout_logprobs=[-0.5, 0.0, -1.25],
        reward=1.0,
        status=Status.COMPLETED,
        weight_versions=["3", "4"],
        group_index=2,
        index=7,
        label="46",
        metadata={"task": "addition"},
        prompt=[{"role": "user", "content": "12+34="}],
        response="46",
    )
    base.update(kw)
    return Sample(**base)


def test_valid_sample_and_views():
    s = make_sample().validate()
    assert s.prompt_tokens == [1, 2, 3]
    assert s.response_tokens == [4, 5, 6]
    assert s.effective_response_length == 2
    assert s.oldest_weight_version() == 3


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(loss_mask=[1, 1]), "len(loss_mask)=2 != response_length=3"),
        (dict(rollout_logprobs=[-1.0]), "len(rollout_logprobs)=1 != response_length=3"),
        (dict(response_length=7), "response_length 7 outside [0, len(tokens)=6]"),
        (dict(response_length=6, loss_mask=[1] * 6, rollout_logprobs=[0.0] * 6), "no prompt tokens"),
        (dict(loss_mask=[1, 2, 1]), "loss_mask values must be 0 or 1, found [2]"),
        (dict(rollout_logprobs=[-0.5, -0.3, -1.0]), "must be 0.0 on loss_mask==0 tokens, found [-0.3]"),
        (dict(routed_experts=[[[0, 1]]]), "len(routed_experts)=1 != len(tokens) - 1 = 5"),
        (dict(teacher_logprobs=[-1.0]), "len(teacher_logprobs)=1 != response_length=3"),
        (dict(teacher_logprobs=[-0.5, -0.25, -1.0]), "teacher_logprobs must be 0.0 on loss_mask==0 tokens, found [-0.25]"),
        (dict(weight_versions=["v1"]), "weight version 'v1' is not an integer string"),
        (dict(token_versions=[3, 4]), "len(token_versions)=2 != response_length=3"),
    ],
)
def test_validate_names_offending_values(kw, message):
    with pytest.raises(SampleError) as e:
        make_sample(**kw).validate()
    assert message in str(e.value)
    assert "sample 7 (group 2)" in str(e.value) or "sample 7" in str(e.value)


def test_dict_round_trip():
    s = make_sample(reward={"acc": 1.0, "fmt": 0.5}, token_versions=[3, 3, 4])
    d = s.to_dict()
    assert d["token_versions"] == [3, 3, 4]
    assert d["status"] == "completed"
    assert Sample.from_dict(d) == s


def test_from_dict_rejects_unknown_keys_and_bad_status():
    with pytest.raises(SampleError, match=r"unknown keys \['bogus'\]"):
        Sample.from_dict({"bogus": 1})
    with pytest.raises(SampleError, match="status 'done' is not one of"):
        Sample.from_dict({"status": "done"})


def test_binary_round_trip_is_compact_and_exact():
    experts = [[[i % 4, (i + 1) % 4]] for i in range(5)]
    samples = [make_sample(), make_sample(index=8, routed_experts=experts, reward=None, status=Status.TRUNCATED),
               make_sample(index=9, teacher_logprobs=[-0.25, 0.0, -2.5], token_versions=[3, 4, 4])]
    blob = encode_samples(samples)
    back = decode_samples(blob)
    assert back == samples  # logprobs chosen to be exact in float32
    assert len(blob) < len(str([s.to_dict() for s in samples]).encode())


def test_binary_rejects_corruption():
    blob = encode_samples([make_sample()])
    with pytest.raises(SampleError, match="bad magic"):
        decode_samples(b"XXXX" + blob[4:])
    with pytest.raises(SampleError, match="trailing bytes"):
        decode_samples(blob + b"\0")


def test_reward_value():
    assert make_sample(reward=0.5).reward_value() == 0.5
    assert make_sample(reward={"acc": 1.0}).reward_value("acc") == 1.0
    with pytest.raises(SampleError, match="reward key 'x' does not select one"):
        make_sample(reward={"acc": 1.0}).reward_value("x")
    with pytest.raises(SampleError, match="reward is not set"):
        make_sample(reward=None).reward_value()


def test_groups_and_staleness():
    prompt = Sample(prompt="1+1=", label="2")
    group = expand_group(prompt, 4, group_index=5, first_index=20)
    assert [s.index for s in group] == [20, 21, 22, 23]
    assert {s.group_index for s in group} == {5}
    group[0].metadata["x"] = 1
    assert "x" not in group[1].metadata  # independent copies
    assert group_is_aborted(group)  # still pending
    for s, versions in zip(group, (["4"], ["3", "5"], ["5"], ["6"])):
        s.weight_versions, s.status = versions, Status.COMPLETED
    assert not group_is_aborted(group)
    group[2].status = Status.FAILED
    assert group_is_aborted(group)
    # pessimistic: the oldest token of any sample decides
    assert group_staleness(group, current_version=7) == 4
    with pytest.raises(SampleError, match="n_samples_per_prompt must be >= 1, got 0"):
        expand_group(prompt, 0, 0, 0)


@pytest.mark.parametrize("extra", [{"row": [1, 2]}, {"row": [1, 2], "score": lambda x: x, "seen": {3}}],
                         ids=["json", "other types"])
def test_a_group_holds_deep_copies_of_its_prompt(extra):
    """Each sample's prompt messages and metadata are its own, nested ones too, whatever else the metadata
    holds (a function, a set); strings are shared, as copy.deepcopy shares them."""
    prompt = Sample(prompt=[{"role": "user", "content": "1+1="}], label="2", tokens=[1, 2], metadata=dict(extra))
    group = expand_group(prompt, 3, group_index=0, first_index=0)
    group[0].metadata["row"].append(3)
    group[0].prompt[0]["content"] = "changed"
    group[0].tokens.append(9)
    assert [s.metadata["row"] for s in group] == [[1, 2, 3], [1, 2], [1, 2]]
    assert prompt.metadata["row"] == [1, 2] and prompt.tokens == [1, 2]
    assert [s.prompt[0]["content"] for s in group] == ["changed", "1+1=", "1+1="]
    assert all(s.label == "2" and s.status is Status.PENDING for s in group)
    assert group[1].prompt[0]["content"] is group[2].prompt[0]["content"] is prompt.prompt[0]["content"]
    if "seen" in extra:
        group[0].metadata["seen"].add(4)
        assert [s.metadata["seen"] for s in group] == [{3, 4}, {3}, {3}] and prompt.metadata["seen"] == {3}
        assert group[1].metadata["score"](5) == 5
