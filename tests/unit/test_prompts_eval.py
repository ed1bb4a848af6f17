import pytest

from verst.config import DataConfig
from verst.eval import evaluate_greedy
from verst.models import load_tokenizer
from verst.models.prompts import encode_prompt, encode_sft_example, prompt_messages
from verst.rewards import REWARDS
from verst.types import Sample


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_prompt_messages():
    assert prompt_messages("1+1=") == [{"role": "user", "content": "1+1="}]
    assert prompt_messages("x", "sys")[0] == {"role": "system", "content": "sys"}
    with pytest.raises(TypeError, match="prompt must be text or a list of chat messages, got int"):
        prompt_messages(3)


def test_sft_example_response_is_assistant_turn_up_to_eos(tok):
    ids, n = encode_sft_example(tok, [{"role": "user", "content": "12+34="}], "46")
    assert tok.decode(ids[-n:]) == "46<|im_end|>"
    assert ids[:-n] == encode_prompt(tok, "12+34=")
    raw_ids, raw_n = encode_sft_example(tok, "12+34=", "46", apply_chat_template=False)
    assert tok.decode(raw_ids) == "12+34=46<|im_end|>" and raw_n == 3


def test_raw_prompt_needs_text(tok):
    assert tok.decode(encode_prompt(tok, [{"role": "user", "content": "1+2="}], apply_chat_template=False)) == "1+2="
    with pytest.raises(TypeError, match=r"needs a text prompt or one user message, got roles \['system', 'user'\]"):
        encode_prompt(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}], apply_chat_template=False)
    with pytest.raises(ValueError, match="data.system_prompt needs data.apply_chat_template = true"):
        encode_prompt(tok, "x", apply_chat_template=False, system_prompt="s")


def test_evaluate_greedy_scores_with_reward_and_counts_truncation(tok):
    prompts = [Sample(prompt=[{"role": "user", "content": f"{a}+1="}], label=str(a + 1), index=a) for a in range(4)]
    eos = tok.eos_token_id
    answers = {0: "1", 1: "9", 2: "3", 3: "4"}  # 3 right; prompt 3 is cut before eos

    def fake_generate(batch):
        out = []
        for ids in batch:
            a = int(tok.decode(ids).split("user\n")[1].split("+")[0])
            resp = tok.encode(answers[a], add_special_tokens=False)
            out.append(resp if a == 3 else resp + [eos])
        return out


    m = evaluate_greedy(prompts, fake_generate, tok, REWARDS.load("numeric_match"), DataConfig(), 8)
    assert m["eval/accuracy"] == pytest.approx(0.75)
    assert m["eval/truncated_ratio"] == pytest.approx(0.25)
    assert m["eval/n_prompts"] == 4


def test_engine_eval_concurrency_is_checked_by_name():
    from verst.eval import engine_greedy_generate

    with pytest.raises(ValueError, match="concurrency must be >= 1 or None, got 0"):
        engine_greedy_generate("http://127.0.0.1:9", 4, concurrency=0)
