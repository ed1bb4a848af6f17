"""LoRA adapters in the engine core: logprobs equal to transformers + PEFT, a batch mixing the base and
two adapters giving each row what it gets alone, prefix-cache isolation between adapters and across a
reload, in-flight requests across a reload, and refusals naming the adapter or the problem."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora_adapters import make_adapter, reference_logprobs
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.lora import LoraBatch
from verst.engine.request import Request
from verst.inference_client.protocol import InvalidRequest, SamplingParams
from verst.models.loader import load_model_and_tokenizer
from verst.models.native import load_causal_lm

torch.set_num_threads(1)
TOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """{name: (directory, PeftModel)}: a of every linear (r 4), b of q/v/down with rsLoRA and a rank pattern."""
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "a": (root / "a", make_adapter(tiny_model_dir, root / "a", seed=1)),
        "b": (root / "b", make_adapter(tiny_model_dir, root / "b", seed=2, target_modules=["q_proj", "v_proj",
                                                                                           "down_proj"],
                                       r=8, alpha=16, use_rslora=True, rank_pattern={"down_proj": 2})),
    }


def make_core(model_dir, adapters, impl="auto", native_model=False, **config):
    if native_model:
        model, tokenizer = load_causal_lm(model_dir, "native", "float32", "cpu", False), None
    else:
        model, tokenizer = load_model_and_tokenizer(model_dir)
    core = EngineCore(model, tokenizer, EngineConfig(model_impl=impl, **config))
    for name, (path, _) in adapters.items():
        core.add_lora(core.read_lora(name, str(path)))
    return core


def req(rid, prompt, lora=None, max_new=8, seed=0):
    return Request(rid=rid, prompt_ids=list(prompt), return_logprob=True, lora_path=lora, sampling=SamplingParams(
        max_new_tokens=max_new, sampling_seed=seed, ignore_eos=True))


def run(core, reqs):
    for r in reqs:
        core.add_request(r)
    for _ in range(1000):
        if not core.has_work():
            return reqs
        core.step()
    raise AssertionError("engine did not finish")


def prompt(seed, n=20):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize(("impl", "native_model"), [("native", False), ("transformers", False), ("native", True)],
                         ids=["native-forward", "transformers-hooks", "native-model"])
def test_adapter_logprobs_equal_transformers_with_peft(tiny_model_dir, adapters, impl, native_model):
    core = make_core(tiny_model_dir, adapters, impl, native_model)
    assert core.runner.impl == impl
    for name, (_, peft_model) in adapters.items():
        done = run(core, [req(name, prompt(3), lora=name, max_new=10)])[0]
        expected = reference_logprobs(peft_model, done.prompt_ids, done.output_ids)
        assert max(abs(a - b) for a, b in zip(expected, done.output_logprobs)) < TOL
        with peft_model.disable_adapter():  # the adapter moves the logprobs: the test has teeth
            base = reference_logprobs(peft_model, done.prompt_ids, done.output_ids)
        assert max(abs(a - b) for a, b in zip(base, done.output_logprobs)) > 1e-2


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_batch_mixing_base_and_two_adapters_gives_each_row_its_own_result(tiny_model_dir, adapters, impl):
    shared = prompt(5)  # the same prompt under three adapters: never one prefill shared between them
    rows = [(None, shared), ("a", shared), ("b", shared), ("a", prompt(6, 9)), (None, prompt(7, 31)),
            ("b", prompt(8, 4))]
    core = make_core(tiny_model_dir, adapters, impl)
    batched = run(core, [req(f"r{i}", p, lora, seed=i) for i, (lora, p) in enumerate(rows)])
    for i, (lora, p) in enumerate(rows):
        alone = run(make_core(tiny_model_dir, adapters, impl), [req("alone", p, lora, seed=i)])[0]
        assert batched[i].output_ids == alone.output_ids
        assert max(abs(a - b) for a, b in zip(batched[i].output_logprobs, alone.output_logprobs)) < 1e-5
    assert len({tuple(r.output_logprobs) for r in batched[:3]}) == 3


def test_kv_cached_under_one_adapter_is_never_reused_for_another_or_after_a_reload(tiny_model_dir, adapters):
    core = make_core(tiny_model_dir, adapters)
    fresh = {name: run(make_core(tiny_model_dir, adapters), [req("f", prompt(9, 40), name)])[0].output_logprobs
             for name in (None, "a", "b")}
    first = run(core, [req("a1", prompt(9, 40), "a")])[0]
    assert first.cached_tokens == 0
    for name in (None, "b"):
        other = run(core, [req(f"{name}-after-a", prompt(9, 40), name)])[0]
        assert other.cached_tokens == 0 and other.output_logprobs == pytest.approx(fresh[name], abs=1e-5)
    again = run(core, [req("a2", prompt(9, 40), "a")])[0]
    assert again.cached_tokens >= 32 and again.output_logprobs == pytest.approx(fresh["a"], abs=1e-5)
    # "a" reloaded with b's weights: a new version, whose requests see none of the old KV
    core.add_lora(core.read_lora("a", str(adapters["b"][0])))
    reloaded = run(core, [req("a3", prompt(9, 40), "a")])[0]
    assert reloaded.cached_tokens == 0 and reloaded.output_logprobs == pytest.approx(fresh["b"], abs=1e-5)


def test_a_request_in_flight_finishes_on_the_adapter_it_started_with(tiny_model_dir, adapters):
    core = make_core(tiny_model_dir, adapters)
    expected = run(make_core(tiny_model_dir, adapters), [req("x", prompt(11), "a", max_new=12)])[0]
    running = req("x", prompt(11), "a", max_new=12)
    core.add_request(running)
    for _ in range(4):
        core.step()
    core.add_lora(core.read_lora("a", str(adapters["b"][0])))
    core.unload_lora("b")
    run(core, [])
    assert running.output_ids == expected.output_ids
    assert running.output_logprobs == pytest.approx(expected.output_logprobs, abs=1e-5)
    after = run(core, [req("y", prompt(11), "a", max_new=12)])[0]
    assert after.output_logprobs != pytest.approx(expected.output_logprobs, abs=1e-3)


def test_a_weight_sync_swap_moves_requests_in_flight_to_the_new_adapter(tiny_model_dir, adapters):
    """The adapter pushed by weight sync (tensors and config, not a directory) replaces the one of its name
    for requests in flight too, as a full-weight update does: paused with retract, a request recomputes
    its KV under the new adapter and samples its later tokens from it."""
    core = make_core(tiny_model_dir, {"a": adapters["a"]})
    running = req("x", prompt(11), "a", max_new=12)
    core.add_request(running)
    for _ in range(4):
        core.step()
    done = len(running.output_ids)
    core.pause("retract")
    path = adapters["b"][0]
    pushed = core.build_lora("a", json.loads((path / "adapter_config.json").read_text()),
                             load_file(str(path / "adapter_model.safetensors")))
    core.add_lora(pushed, update_in_flight=True)
    core.resume()
    run(core, [])
    assert running.lora is pushed and core.loras.get("a") is pushed
    old = reference_logprobs(adapters["a"][1], running.prompt_ids, running.output_ids)
    new = reference_logprobs(adapters["b"][1], running.prompt_ids, running.output_ids)
    assert running.output_logprobs[:done] == pytest.approx(old[:done], abs=TOL)
    assert running.output_logprobs[done:] == pytest.approx(new[done:], abs=TOL)


def test_a_pushed_adapter_that_does_not_fit_is_refused_naming_lora_name(tiny_model_dir, adapters):
    core = make_core(tiny_model_dir, {})
    path = adapters["a"][0]
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequest) as refused:
        core.build_lora("policy", {**config, "r": 0}, tensors)
    assert refused.value.field == "lora_name" and "r = 0" in str(refused.value)
    with pytest.raises(InvalidRequest, match="not a LoRA A or B matrix"):
        core.build_lora("policy", config, {**tensors, "model.norm.weight": torch.ones(4, 4)})


def test_unknown_and_unloaded_adapter_names_are_refused_by_name(tiny_model_dir, adapters):
    core = make_core(tiny_model_dir, adapters)
    with pytest.raises(InvalidRequest, match="'nope'.*loaded: a, b") as refused:
        core.add_request(req("x", prompt(1), "nope"))
    assert refused.value.field == "lora_path"
    core.unload_lora("b")
    with pytest.raises(InvalidRequest, match="'b'") as refused:
        core.add_request(req("y", prompt(1), "b"))
    assert refused.value.field == "lora_path" and not core.requests
    with pytest.raises(InvalidRequest, match="'b'") as refused:
        core.unload_lora("b")
    assert refused.value.field == "lora_name"
    assert [a["lora_name"] for a in core.stats()["loaded_loras"]] == ["a"]


def test_the_number_of_resident_adapters_is_bounded(tiny_model_dir, adapters):
    core = make_core(tiny_model_dir, {"a": adapters["a"]}, max_loaded_loras=1)
    with pytest.raises(InvalidRequest, match="max_loaded_loras = 1") as refused:
        core.read_lora("b", str(adapters["b"][0]))
    assert refused.value.field == "lora_name"
    core.add_lora(core.read_lora("a", str(adapters["b"][0])))  # a reload takes no new room
    assert run(core, [req("base", prompt(2))])[0].finish.type == "length"


def _broken(source, target, config=None, tensors=None):
    shutil.copytree(source, target)
    if config is not None:
        data = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps(config(data)))
    if tensors is not None:
        save_file(tensors(load_file(str(target / "adapter_model.safetensors"))), str(target / "adapter_model.safetensors"))
    return target


def _renamed(tensors):
    return {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qq_proj"): v for k, v in tensors.items()}


BROKEN = {
    "missing-weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    "rank-mismatch": (dict(config=lambda c: {**c, "r": 6}), "rank mismatch"),
    "absent-target": (dict(config=lambda c: {**c, "target_modules": ["q_proj", "foo_proj"]}), r"\['foo_proj'\]"),
    "absent-module": (dict(tensors=_renamed), "qq_proj is not in the model"),
    "dora": (dict(config=lambda c: {**c, "use_dora": True}), "use_dora"),
    "zero-rank": (dict(config=lambda c: {**c, "r": 0}), "r = 0"),
    "one-sided": (dict(tensors=lambda t: {k: v for k, v in t.items() if "q_proj.lora_B" not in k}), "no lora_B"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_bad_adapter_directory_is_refused_naming_the_problem(tiny_model_dir, adapters, tmp_path, case):
    core = make_core(tiny_model_dir, {})
    change, message = BROKEN[case]
    if callable(change):
        target = _broken(adapters["a"][0], tmp_path / case)
        change(target)
    else:
        target = _broken(adapters["a"][0], tmp_path / case, **change)
    with pytest.raises(InvalidRequest, match=message) as refused:
        core.read_lora("x", str(target))
    assert refused.value.field == "lora_path" and not core.loras.adapters
    with pytest.raises(InvalidRequest, match="not a directory"):
        core.read_lora("x", str(tmp_path / "nowhere"))


def test_per_row_deltas_equal_a_separate_product_per_row():
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(6, 5)), None

    torch.manual_seed(0)
    module = Linear()
    adapters = [type("Adapter", (), {"modules": {module: (torch.randn(2, 5), torch.randn(6, 2))}})() for _ in range(2)]
    rows = [adapters[0], None, adapters[1], adapters[0]]
    x = torch.randn(4, 3, 5)
    got = LoraBatch(rows, "cpu").linear(x, module)
    for i, adapter in enumerate(rows):
        expected = x[i] @ module.weight.T
        if adapter is not None:
            a, b = adapter.modules[module]
            expected = expected + (x[i] @ a.T) @ b.T
        assert torch.allclose(got[i], expected, atol=1e-5)
    same = LoraBatch([adapters[1]] * 4, "cpu")
    assert same.by_module[module][0][0] is None  # every row on one adapter: no gather
    assert LoraBatch.of([None, None], "cpu") is None
