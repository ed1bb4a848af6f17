"""On-policy distillation's teacher side: the scoring client's wire shape, the scorer that fills samples'
teacher logprobs, its metrics, the tokenizer check and the teacher's placement bundles."""

import asyncio
import json
import shutil

import httpx
import pytest

from verst.inference_client.client import EngineClient, EngineError
from verst.models.loader import check_same_tokenizer
from verst.orchestration.placement import plan_bundles
from verst.rollout.teacher import TEACHER_SECONDS_KEY, TeacherScorer, teacher_metrics
from verst.types import Sample, Status


def scoring_reply(ids, start, logprobs):
    triples = [[lp, tok, None] for lp, tok in zip(logprobs, ids[start:])]
    return {"text": "", "output_ids": [], "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 0},
                                                        "prompt_tokens": len(ids), "completion_tokens": 0,
                                                        "input_token_logprobs": triples}}


def score_with(reply, ids, start, **client_kwargs):
    calls = []

    def handler(request):
        calls.append(json.loads(request.content))
        return httpx.Response(200, json=reply)

    async def main():
        async with EngineClient("http://teacher", transport=httpx.MockTransport(handler), **client_kwargs) as c:
            return await c.score(ids, start, {"temperature": 0.7})

    return asyncio.run(main()), calls


def test_score_is_one_prefill_in_sglangs_request_shape():
    ids = [3, 4, 5, 6, 7]
    logprobs, calls = score_with(scoring_reply(ids, 3, [-0.5, -1.5]), ids, 3, lora_path="policy-adapter")
    assert logprobs == [-0.5, -1.5]
    assert calls == [{"input_ids": ids, "return_logprob": True, "logprob_start_len": 3,
                      "sampling_params": {"temperature": 0.7, "max_new_tokens": 0}}]  # no adapter: the base scores


def test_score_refuses_a_reply_that_does_not_cover_the_tokens_sent():
    ids = [3, 4, 5, 6, 7]
    with pytest.raises(EngineError, match="holds 1 input_token_logprobs for 2 scored tokens"):
        score_with(scoring_reply(ids, 4, [-0.5]), ids, 3)
    with pytest.raises(EngineError, match="other token ids than were sent"):
        score_with(scoring_reply([3, 4, 5, 9, 9], 3, [-0.5, -1.5]), ids, 3)
    with pytest.raises(ValueError, match=r"start = 0 must be in \[1, len\(input_ids\) = 5\)"):
        score_with({}, ids, 0)


class FakeTeacher:
    """A teacher engine client: logprob −token_id/10 per scored token; records its calls."""

    def __init__(self):
        self.calls, self.closed = [], False

    async def score(self, ids, start, params):
        self.calls.append((list(ids), start, params))
        await asyncio.sleep(0.01)
        return [-tok / 10 for tok in ids[start:]]

    async def close(self):
        self.closed = True


def sample(index, response, mask, status=Status.COMPLETED):
    return Sample(tokens=[1, 2] + response, response_length=len(response), loss_mask=mask,
                  rollout_logprobs=[-0.1 * m for m in mask], index=index, status=status)


def test_scorer_fills_teacher_logprobs_zero_on_environment_tokens_and_spreads_the_load():
    teachers = [FakeTeacher(), FakeTeacher()]
    scorer = TeacherScorer(teachers, temperature=0.0)
    group = [sample(0, [5, 6, 7], [1, 0, 1]), sample(1, [8], [1]), sample(2, [9], [1], status=Status.ABORTED)]
    asyncio.run(scorer.score_group(group))
    assert group[0].teacher_logprobs == [-0.5, 0.0, -0.7] and group[1].teacher_logprobs == [-0.8]
    assert group[2].teacher_logprobs is None  # an unfinished sample is not scored
    assert [len(t.calls) for t in teachers] == [1, 1]  # the least loaded engine takes each request
    assert all(start == 2 and params == {"temperature": 1.0} for t in teachers for _, start, params in t.calls)
    assert all(s.metadata[TEACHER_SECONDS_KEY] > 0 for s in group)
    group[0].validate()
    asyncio.run(scorer.aclose())
    assert all(t.closed for t in teachers)


def test_teacher_metrics_are_the_rollout_reverse_kl_and_the_scoring_time():
    a, b = sample(0, [5, 6], [1, 0]), sample(1, [7], [1])
    a.teacher_logprobs, b.teacher_logprobs = [-0.5, 0.0], [-1.0]
    a.metadata[TEACHER_SECONDS_KEY] = b.metadata[TEACHER_SECONDS_KEY] = 0.25
    # rollout logprobs −0.1 on policy tokens: (−0.1 + 0.5 + −0.1 + 1.0) / 2 over the two policy tokens
    assert teacher_metrics([a, b]) == {"rollout/teacher_kl": pytest.approx(0.65), "rollout/teacher_score_seconds": 0.25}
    assert teacher_metrics([sample(2, [5], [1])]) == {}


def test_a_teacher_with_another_tokenizer_or_a_smaller_vocabulary_is_refused(tiny_model_dir, tmp_path):
    check_same_tokenizer(tiny_model_dir, tiny_model_dir)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"teacher.model_path = '.*other' and model.path = .* have different tokenizers"):
        check_same_tokenizer(tiny_model_dir, other)
    small = tmp_path / "small"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] -= 1
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the teacher's vocab_size \d+ is smaller than the student's"):
        check_same_tokenizer(tiny_model_dir, small)


@pytest.mark.parametrize("kind", ["colocated", "disaggregated"])
def test_teacher_engines_get_bundles_of_their_own_after_the_others(kind):
    plan = plan_bundles(kind, trainer_ranks=2, num_engines=2, device="cpu", teacher_engines=2)
    others = set(plan.trainer_bundles) | set(plan.engine_bundles)
    assert plan.teacher_bundles == [len(others), len(others) + 1] and len(plan.bundles) == len(others) + 2
    assert plan.share("teacher", 0) == 1.0
