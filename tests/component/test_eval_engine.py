"""Engine-backed evaluation equals HF greedy evaluation on the same weights, and names its version."""

import pytest

from verst.config import DataConfig
from verst.data import load_prompts
from verst.engine.process import EngineProcess
from verst.eval import MixedVersionError, engine_greedy_generate, evaluate_greedy, hf_greedy_generate
from verst.models import load_model, load_tokenizer
from verst.rewards import REWARDS


def test_engine_eval_matches_hf_and_checks_version(tiny_model_dir, addition_data_dir):
    tok = load_tokenizer(tiny_model_dir)
    prompts = load_prompts(addition_data_dir / "test.jsonl")[:12]
    reward = REWARDS.load("numeric_match")
    data = DataConfig(apply_chat_template=False)
    hf = hf_greedy_generate(load_model(tiny_model_dir), tok, max_new_tokens=6, batch_size=4)
    prompt_ids = [tok.encode(p.prompt[0]["content"], add_special_tokens=False) for p in prompts]
    with EngineProcess(tiny_model_dir, args=["--weight-version", "0"]) as engine:
        via_engine = engine_greedy_generate(engine.url, 6, expect_version="0")
        assert via_engine(prompt_ids) == hf(prompt_ids)
        metrics = evaluate_greedy(prompts, via_engine, tok, reward, data, 6)
        assert metrics["eval/n_prompts"] == 12
        with pytest.raises(MixedVersionError, match="expected weight version '3' on every reply, got versions \\['0'\\]"):
            engine_greedy_generate(engine.url, 6, expect_version="3")(prompt_ids[:2])


def test_evaluation_goes_ahead_of_queued_rollout_requests(tiny_model_dir):
    """Eval requests carry EVAL_PRIORITY: with the engine's two slots busy and 14 rollout requests
    queued, the evaluation is answered while most of them still wait (an order, not a timing)."""
    import asyncio
    import threading
    import time

    from verst.inference_client.client import EngineClient

    with EngineProcess(tiny_model_dir, args=["--max-running-requests", "2"]) as engine:
        finished = []

        async def rollouts():
            async with EngineClient(engine.url) as client:
                async def one(i):
                    await client.generate([1 + i, 2, 3], {"max_new_tokens": 48, "ignore_eos": True})
                    finished.append(i)
                await asyncio.gather(*(one(i) for i in range(16)))

        background = threading.Thread(target=asyncio.run, args=(rollouts(),))
        background.start()
        try:
            for _ in range(1200):  # until the rollout requests queue behind the two busy slots (<= 60 s)
                if asyncio.run(_engine_waiting(engine.url)) >= 12:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the rollout requests never queued in the engine")
            replies = engine_greedy_generate(engine.url, 4)([[5, 6], [7, 8]])
            done_at_eval = len(finished)
        finally:
            background.join(timeout=120)
        assert [len(r) for r in replies] == [4, 4]
        assert done_at_eval <= 4, f"{done_at_eval} of 16 rollout requests finished before the evaluation"
        assert len(finished) == 16


async def _engine_waiting(url: str) -> int:
    from verst.inference_client.client import EngineClient

    async with EngineClient(url) as client:
        return sum(int(rank["num_waiting_reqs"]) for rank in await client.get_load())
