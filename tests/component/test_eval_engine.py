"""Engine-backed evaluation equals HF greedy evaluation on the same weights, and names its version."""

import pytest

from verst.config import DataConfig
from verst.data import load_prompts
from verst.engine.process import EngineProcess
from verst.eval import MixedVersionError, engine_greedy_generate, evaluate_greedy, hf_greedy_generate
from verst.models import load_model, load_tokenizer
from verst.rewards import BUILTIN_REWARDS


def test_engine_eval_matches_hf_and_checks_version(tiny_model_dir, addition_data_dir):
    tok = load_tokenizer(tiny_model_dir)
    prompts = load_prompts(addition_data_dir / "test.jsonl")[:12]
    reward = BUILTIN_REWARDS["numeric_match"]
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
