"""verst.models: tiny-model factory, byte-level tokenizer, chat template, the shared loader, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tokenizers import pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verst.cli.main import main as verst_main
from verst.models.chat_template import TINY_CHAT_TEMPLATE
from verst.models.factory import ARCHS, count_parameters, init_model, model_config
from verst.models.loader import (
    chat_prompt_ids,
    check_vocab,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    render_chat,
)
from verst.models.tokenizer import VOCAB_SIZE, build_tokenizer, byte_to_char, save_tokenizer, special_token_ids

torch.set_num_threads(1)

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: init_model(arch, "tiny", root / arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok"), TINY_CHAT_TEMPLATE))


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # [1, seq, vocab]


# --- factory and loader round trip ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_round_trip_gives_same_logits(arch, tiny_dirs, tmp_path):
    model, tok = load_model_and_tokenizer(tiny_dirs[arch])
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "12+34="}])
    before = _logits(model, ids)
    assert before.shape == (1, len(ids), VOCAB_SIZE)
    model.save_pretrained(tmp_path / "resaved")
    after = _logits(load_model(tmp_path / "resaved"), ids)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_size_equals_tokenizer_size_and_tiny_is_about_half_a_million(arch, tiny_dirs):
    model, tok = load_model_and_tokenizer(tiny_dirs[arch])
    assert len(tok) == VOCAB_SIZE == model.config.vocab_size == model.get_input_embeddings().num_embeddings
    assert 350_000 <= count_parameters(model) <= 700_000
    assert model.config.max_position_embeddings == 1024
    ids = special_token_ids()
    assert model.generation_config.eos_token_id == ids["<|im_end|>"] == tok.eos_token_id
    assert model.generation_config.pad_token_id == ids["<|endoftext|>"] == tok.pad_token_id


def test_moe_has_four_experts_top_two(tiny_dirs):
    config = load_model(tiny_dirs["qwen3-moe"]).config
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)


def test_small_is_a_few_million(tmp_path):
    n_params = count_parameters(load_model(init_model("qwen3", "small", tmp_path / "small")))
    assert 2_000_000 <= n_params <= 10_000_000


def test_same_seed_same_weights_other_seed_differs(tiny_dirs, tmp_path):
    reference = load_model(tiny_dirs["qwen3"]).state_dict()
    same = load_model(init_model("qwen3", "tiny", tmp_path / "same", seed=0)).state_dict()
    other = load_model(init_model("qwen3", "tiny", tmp_path / "other", seed=1)).state_dict()
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert not torch.equal(reference["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_init_leaves_global_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_model("llama", "tiny", tmp_path / "m")
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.parametrize(("arch", "size", "bad"), [("gpt2", "tiny", "'gpt2'"), ("qwen3", "huge", "'huge'")])
def test_unknown_arch_or_size_names_value_and_choices(arch, size, bad):
    with pytest.raises(ValueError, match=bad) as error:
        model_config(arch, size)
    assert "choices" in str(error.value)


def test_init_refuses_non_empty_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        init_model("qwen3", "tiny", tmp_path)


# --- loader errors --------------------------------------------------------------------------------


def test_loader_errors_name_path_and_what_is_missing(tmp_path, tiny_dirs):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((tiny_dirs["qwen3"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="'float64'"):
        load_model(tiny_dirs["qwen3"], dtype="float64")


def test_tokenizer_larger_than_model_vocab_is_refused(tiny_dirs):
    model, tok = load_model_and_tokenizer(tiny_dirs["llama"])
    model.resize_token_embeddings(200)
    with pytest.raises(ValueError, match=r"265 tokens.*only 200 rows"):
        check_vocab(tok, model)


def test_missing_pad_token_pads_with_eos(tmp_path):
    save_tokenizer(tmp_path, TINY_CHAT_TEMPLATE)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").unlink()
    tok = load_tokenizer(tmp_path)
    assert tok.pad_token_id == tok.eos_token_id == special_token_ids()["<|im_end|>"]


# --- tokenizer ------------------------------------------------------------------------------------


def test_byte_alphabet_matches_the_byte_level_pre_tokenizer():
    assert sorted(byte_to_char().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize(
    "text",
    ["12+34=46", "Hello, world!\n\ttabs  and  spaces ", "héllo — 世界 🙂 e\u0301", "\x00\x7f\u00a0\u00ad"],
)
def test_tokenizer_round_trips_any_utf8(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one id per byte, id = byte value
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer):
    ids = special_token_ids()
    text = "<|im_start|>a<tool_call>{}</tool_call><think>x</think><|im_end|><|endoftext|>"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert encoded == [
        ids["<|im_start|>"], ord("a"), ids["<tool_call>"], ord("{"), ord("}"), ids["</tool_call>"],
        ids["<think>"], ord("x"), ids["</think>"], ids["<|im_end|>"], ids["<|endoftext|>"],
    ]
    assert tokenizer.decode(encoded) == text
    # Control tokens are skipped; tool and reasoning markup stays for the parsers.
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "a<tool_call>{}</tool_call><think>x</think>"


def test_loaded_tokenizer_is_ours_and_matches_the_built_one(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    text = "<|im_start|>user\nñ<|im_end|>"
    assert tokenizer.encode(text, add_special_tokens=False) == build_tokenizer().encode(text).ids


def test_loader_keeps_our_tokenizer_in_a_qwen2_folder(tmp_path):
    # transformers 5.x AutoTokenizer picks Qwen2Tokenizer for a qwen2 config.json, whose NFC
    # normaliser turns "e" + combining accent into one character: the ids silently change.
    save_tokenizer(tmp_path, TINY_CHAT_TEMPLATE)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    text = "e\u0301"
    assert load_tokenizer(tmp_path).encode(text, add_special_tokens=False) == list(text.encode("utf-8"))


def test_loading_our_tokenizer_imports_no_torch(tmp_path):
    # The rollout manager and the driver load only a tokenizer: importing torch for it (through
    # AutoTokenizer's config) cost each of them 3-4 s of start-up on 2 cores.
    bare = "import sys; from transformers import PreTrainedTokenizerFast; print('torch' in sys.modules)"
    if subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, check=True).stdout.split()[-1] == "True":
        pytest.skip("this transformers' tokenizer module imports torch itself (5.17: through its GGUF loader)")
    save_tokenizer(tmp_path, TINY_CHAT_TEMPLATE)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    probe = ("import sys; from verst.models import load_tokenizer; "
             f"tok = load_tokenizer({str(tmp_path)!r}); print(tok.encode('1+2'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False", out


# --- chat template --------------------------------------------------------------------------------


def test_one_turn_prompt_is_short_chatml(tokenizer):
    messages = [{"role": "user", "content": "12+34="}]
    text = render_chat(tokenizer, messages)
    assert text == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    ids = special_token_ids()
    assert chat_prompt_ids(tokenizer, messages) == [
        ids["<|im_start|>"], *b"user\n12+34=", ids["<|im_end|>"], *b"\n", ids["<|im_start|>"], *b"assistant\n",
    ]


def test_tools_tool_calls_and_tool_results_render_exactly(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
            ],
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "3 and 7."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You can call these functions (JSON schemas, one per line):\n<tools>\n"
        + json.dumps(ADD_TOOL)
        + "\n</tools>\n\nTo call a function, write one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <JSON object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n1+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n3 and 7.<|im_end|>\n"
    )
    assert render_chat(tokenizer, messages, tools=[ADD_TOOL], add_generation_prompt=False) == expected


def test_system_without_tools_content_before_call_and_reasoning(tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {
            "role": "assistant",
            "content": "Adding.",
            "reasoning_content": "easy",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}],
        },
    ]
    assert render_chat(tokenizer, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n<think>\neasy\n</think>\n\nAdding.\n"
        '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


@pytest.mark.parametrize("tools", [None, [ADD_TOOL]])
@pytest.mark.parametrize("first", ["system", "user"])
def test_template_is_append_only(tokenizer, tools, first):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [
        {"role": "system", "content": "You add."} if first == "system" else {"role": "user", "content": "hi"},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3", "reasoning_content": "sum"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    # transformers refuses an empty conversation, so the first prefix holds one message.
    renders = [render_chat(tokenizer, messages[:k], tools=tools, add_generation_prompt=False) for k in range(1, 9)]
    for k in range(len(renders) - 1):
        assert renders[k + 1].startswith(renders[k]), f"rendering {k + 2} messages rewrote the first {k + 1}"
        prefix_ids = tokenizer.encode(renders[k], add_special_tokens=False)
        assert tokenizer.encode(renders[k + 1], add_special_tokens=False)[: len(prefix_ids)] == prefix_ids


def test_unknown_role_and_non_string_content_fail_loudly(tokenizer):
    with pytest.raises(Exception, match="unknown role robot"):
        render_chat(tokenizer, [{"role": "robot", "content": "x"}])
    with pytest.raises(Exception, match="content of a user message must be a string"):
        render_chat(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "x"}]}])


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_model_init_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "cli-llama"
    argv = ["model", "init", "--arch", "llama", "--size", "tiny", "--out", str(out), "--seed", "3"]
    assert verst_main(argv) == 0
    printed = capsys.readouterr().out
    n_params = count_parameters(load_model(out))
    assert str(out) in printed and f"{n_params:,} parameters" in printed
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json"}  # fmt: skip
    assert expected <= {p.name for p in out.iterdir()}
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TINY_CHAT_TEMPLATE
    assert verst_main(argv) == 1  # the folder is no longer empty
    assert "not empty" in capsys.readouterr().err


def test_cli_model_init_sets_the_context_length(tmp_path, capsys):
    out = tmp_path / "long"
    assert verst_main(["model", "init", "--arch", "qwen3", "--size", "tiny", "--out", str(out),
                       "--context-length", "2048"]) == 0
    assert load_model(out).config.max_position_embeddings == 2048
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 2048
    with pytest.raises(ValueError, match="context_length 0"):
        init_model("qwen3", "tiny", tmp_path / "none", context_length=0)


def test_cli_rejects_unknown_arch(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        verst_main(["model", "init", "--arch", "gpt2", "--size", "tiny", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "gpt2" in capsys.readouterr().err
