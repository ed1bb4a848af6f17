"""The engine's native forward for dense Llama-family models: the same logits as transformers' forward
on ragged batches over the slot cache (Qwen3, Llama, Qwen2 with biases), in-place weight loads seen at
once, and a clear refusal for models it does not cover or a forward that disagrees."""

import pytest
import torch

import verst.engine.native as native
from verst.engine.core import EngineConfig
from verst.engine.model_runner import ModelRunner, check_native_model
from verst.models.factory import init_model
from verst.models.loader import load_model
from verst.models.native import NativeCausalLM, load_causal_lm, load_native_model, native_config_reason

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Checkpoint folders: the tiny factory's, Qwen2 (q/k/v biases, untied head) and Mistral (no window)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("native-models")
    out = {arch: init_model(arch, "tiny", root / arch, seed=0) for arch in ("qwen3", "llama", "qwen3-moe")}
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0)
    torch.manual_seed(0)
    for name, cls, config in (("qwen2", Qwen2ForCausalLM, Qwen2Config(**small, tie_word_embeddings=False)),
                              ("mistral", MistralForCausalLM, MistralConfig(**small, sliding_window=None))):
        cls(config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def models(model_dirs):
    return {arch: load_model(path) for arch, path in model_dirs.items()}


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


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
def test_the_model_built_without_transformers_gives_transformers_logits(models, model_dirs, arch):
    ours = load_native_model(model_dirs[arch])
    assert isinstance(ours, NativeCausalLM)
    assert not any(p.requires_grad or p.is_meta for p in ours.parameters())
    runner, native_logits = decode_run(ours, "auto")
    _, reference = decode_run(models[arch], "transformers")
    assert runner.impl == "native" and (native_logits - reference).abs().max().item() < 1e-5
    assert check_native_model(ours, models[arch]) < 1e-5 and runner.probe()
    tied = arch in ("qwen3", "llama")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


def test_the_engine_loads_the_native_model_where_it_applies_and_says_why_not(model_dirs, tmp_path):
    assert isinstance(load_causal_lm(model_dirs["qwen3"]), NativeCausalLM)
    assert not isinstance(load_causal_lm(model_dirs["qwen3"], impl="transformers"), NativeCausalLM)
    assert not isinstance(load_causal_lm(model_dirs["qwen3-moe"]), NativeCausalLM)  # auto: transformers'
    with pytest.raises(ValueError, match="model impl 'native' cannot load .*model_type 'qwen3_moe' is not one of"):
        load_causal_lm(model_dirs["qwen3-moe"], impl="native")
    with pytest.raises(ValueError, match="model_impl 'transformers' needs the model loaded by transformers"):
        ModelRunner(load_native_model(model_dirs["qwen3"]), impl="transformers")


@pytest.mark.parametrize("change, reason", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
    ({"intermediate_size": None}, "lacks ['intermediate_size']"),
])
def test_configs_the_native_model_does_not_cover_are_named(change, reason):
    config = {"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "vocab_size": 10}
    assert native_config_reason(config) is None
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    assert reason in native_config_reason(config)


def test_a_checkpoint_that_does_not_fit_is_refused_by_name(model_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["qwen3"], broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    del tensors["model.norm.weight"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \['model.layers.0.mlp.extra"):
        load_native_model(broken)


def test_a_native_model_that_disagrees_with_transformers_is_refused_when_checked(models, model_dirs, monkeypatch):
    monkeypatch.setattr(native, "_rope", lambda x, cos, sin: x)
    with pytest.raises(RuntimeError, match="native model differs from transformers'"):
        check_native_model(load_native_model(model_dirs["qwen3"]), models["qwen3"])


HEAVY = ("transformers.modeling", "transformers.models.", "transformers.cache_utils", "torch._dynamo",
         "torch.distributed.tensor")  # DTensor: a sequence-parallel trainer's, half a second of CPU at an engine's start
# the modules of HEAVY a process holds after `code`: imported ones (placeholders transformers puts in sys.modules
# without importing them have no __file__)
HEAVY_AFTER = ("; import sys; print(sorted(m for m, mod in list(sys.modules.items()) if m.startswith({heavy!r}) "
               "and getattr(mod, '__file__', None)))")


def heavy_modules(code: str) -> set[str]:
    import ast
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code + HEAVY_AFTER.format(heavy=HEAVY)], capture_output=True,
                         text=True, timeout=120, check=True)
    return set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


def test_an_engine_serving_the_native_model_never_imports_transformers_modeling_or_dtensor(model_dirs):
    # beyond what transformers' own tokenizer class imports (5.17's imports its GGUF loader, modeling_gguf_...)
    tokenizer = heavy_modules("from transformers import PreTrainedTokenizerFast")
    engine = heavy_modules("import uvicorn; uvicorn.Server.run = lambda self, sockets=None: None; "
                           "import verst.engine.server as s; "
                           f"s.main(['--model', {str(model_dirs['qwen3'])!r}, '--port', '0'])")
    assert engine - tokenizer == set()
