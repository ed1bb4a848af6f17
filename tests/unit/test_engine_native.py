"""The engine's native forward for dense Llama-family models: the same logits as transformers' forward
on ragged batches over the slot cache (Qwen3, Llama, Qwen2 with biases), in-place weight loads seen at
once, and a clear refusal for models it does not cover or a forward that disagrees."""

import pytest
import torch

import verst.engine.native as native
from verst.engine.core import EngineConfig
from verst.engine.model_runner import ModelRunner
from verst.models.factory import init_model
from verst.models.loader import load_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("native-models")
    out = {arch: load_model(init_model(arch, "tiny", root / arch, seed=0)) for arch in ("qwen3", "llama", "qwen3-moe")}
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    out["qwen2"] = qwen2.eval().requires_grad_(False)  # q/k/v projections with biases
    return out


def decode_run(model, impl, steps=6):
    """A ragged prefill of three rows, then decode steps feeding one token per row."""
    runner = ModelRunner(model, impl=impl)
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 3, 14)]
    outputs = []
    with torch.no_grad():
        logits, _ = runner.forward(0, prompts, [0, 0, 0])
        lengths = [len(p) for p in prompts]
        for _ in range(steps):
            outputs.append(logits)
            tokens = logits.argmax(-1).tolist()
            logits, _ = runner.forward(0, [[t] for t in tokens], lengths)
            lengths = [n + 1 for n in lengths]
    return runner, torch.stack(outputs)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_native_logits_match_transformers_over_prefill_and_decode(models, arch):
    runner, ours = decode_run(models[arch], "native")
    reference_runner, theirs = decode_run(models[arch], "transformers")
    assert (runner.impl, reference_runner.impl) == ("native", "transformers")
    assert (ours - theirs).abs().max().item() < 1e-5


def test_auto_picks_native_for_dense_models_and_transformers_for_moe(models):
    assert ModelRunner(models["qwen3"]).impl == "native"
    assert ModelRunner(models["qwen3-moe"]).impl == "transformers"
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' is not one of"):
        ModelRunner(models["qwen3-moe"], impl="native")


def test_a_bad_impl_name_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="model_impl must be one of .* got 'fast'"):
        EngineConfig(model_impl="fast")


def test_weights_loaded_in_place_are_used_by_the_next_forward(models):
    model = models["llama"]
    runner = ModelRunner(model, impl="native")
    weight = model.model.layers[0].mlp.down_proj.weight
    saved = weight.clone()
    try:
        with torch.no_grad():
            before, _ = runner.forward(0, [[1, 2, 3]], [0])
            weight.mul_(3.0)  # what EngineCore.load_weights does: copy_ into the parameter
            after, _ = runner.forward(0, [[1, 2, 3]], [0])
            reference, _ = ModelRunner(model, impl="transformers").forward(0, [[1, 2, 3]], [0])
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert (after - before).abs().max() > 1e-3 and (after - reference).abs().max() < 1e-5


def test_a_native_forward_that_disagrees_with_transformers_is_refused(models, monkeypatch):
    monkeypatch.setattr(native, "_rope", lambda x, cos, sin: x)  # a broken forward: positions ignored
    with pytest.raises(RuntimeError, match="native forward differs from transformers'"):
        ModelRunner(models["qwen3"], impl="native")
    assert ModelRunner(models["qwen3"], impl="native", check=False).impl == "native"
