"""LoRA on the FSDP2 backend in-process (one rank, gloo, float32), native and transformers model classes:
only the adapters train, the reference is the base, the engines' weights are the merged ones, checkpoints
hold the adapters, exports load with PEFT and transformers."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from verst.config.schema import LoraConfig, ModelConfig, TrainerConfig
from verst.models.factory import init_model
from verst.models.native import NativeCausalLM
from verst.trainer import FSDP2Backend, sft_loss_fn
from verst.trainer.persistence import SHARDS_DIR

from .test_trainer_backend import LENGTHS, hf_model, make_items, pg_loss, plain_logprobs

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("trainer-lora") / "tiny-qwen3", seed=5)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def make_backend(path, impl="auto", lora=LORA, **kwargs) -> FSDP2Backend:
    config = TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=4096)
    return FSDP2Backend(ModelConfig(path=str(path), impl=impl), config, device="cpu", lora=lora, **kwargs)


def full_parameters(backend) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in backend.model.named_parameters()}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float((torch.cat(a) - torch.cat(b)).abs().max())


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_only_the_adapters_train_and_the_engines_get_the_merged_weights(model_path, impl):
    backend = make_backend(model_path, impl, ref_model_path=str(model_path))
    assert isinstance(backend.model.get_base_model(), NativeCausalLM) == (impl == "auto")
    assert backend.ref_model is None  # the reference is the base itself: no second copy of the weights
    items = make_items(LENGTHS, advantages=True)
    start, before = full_parameters(backend), backend.logprobs(items)
    for _ in range(3):
        metrics = backend.train_step(items, pg_loss)
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    end = full_parameters(backend)
    changed = {name for name in start if not torch.equal(start[name], end[name])}
    adapters = {name for name, p in backend.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert changed == adapters  # every adapter moved; not one base weight did
    trained = {id(p) for p in backend.model.parameters() if p.requires_grad}
    assert set(map(id, backend.optimizer.state)) == trained  # optimizer state: the adapters' only
    after = backend.logprobs(items)
    assert max_diff(after, before) > 1e-3

    base = hf_model(model_path)
    assert max_diff(backend.logprobs(items, reference=True), plain_logprobs(base, items)) < 1e-5
    merged = {name: t.clone() for bucket in backend.named_weights(1 << 16) for name, t in bucket}
    assert set(merged) == set(base.state_dict()) - {"lm_head.weight"}  # base names; the tied head once
    base.load_state_dict(merged, strict=False)
    base.tie_weights()
    assert max_diff(plain_logprobs(base, items), after) < 1e-5
    assert max_diff(backend.logprobs(items), after) == 0  # computing the merged weights left the model as it was


def test_the_checkpoint_holds_the_adapters_and_resumes(model_path, tmp_path):
    backend = make_backend(model_path)
    items = make_items(LENGTHS, seed=2, advantages=True)
    backend.train_step(items, pg_loss)
    backend.save(tmp_path / "ckpt")
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / SHARDS_DIR)).read_metadata().state_dict_metadata
    tensors = [key for key in keys if key.startswith("model.") or key.startswith("optimizer.state.")]
    assert tensors and all("lora_" in key for key in tensors)  # no base weight, no state of one

    resumed = make_backend(model_path)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 1
    assert max_diff(resumed.logprobs(items), backend.logprobs(items)) == 0
    one, two = backend.train_step(items, pg_loss), resumed.train_step(items, pg_loss)
    assert one["train/loss"] == two["train/loss"]  # the optimizer state came back too
    assert max_diff(resumed.logprobs(items), backend.logprobs(items)) == 0


def test_the_export_is_a_peft_adapter_and_a_merged_model(model_path, tmp_path):
    from peft import PeftModel

    backend = make_backend(model_path)
    items = make_items(LENGTHS, seed=4, advantages=True)
    for _ in range(2):
        backend.train_step(items, pg_loss)
    want = backend.logprobs(items)
    backend.export_hf(tmp_path / "hf", merge_lora=True)
    assert (tmp_path / "hf" / "adapter_config.json").exists() and (tmp_path / "hf" / "tokenizer.json").exists()
    adapted = PeftModel.from_pretrained(hf_model(model_path), str(tmp_path / "hf"))
    assert max_diff(plain_logprobs(adapted, items), want) < 1e-5
    assert max_diff(plain_logprobs(hf_model(tmp_path / "hf" / "merged"), items), want) < 1e-5

    backend.export_hf(tmp_path / "adapter-only")
    assert not (tmp_path / "adapter-only" / "merged").exists()


def test_sft_steps_train_the_adapters(model_path):
    backend = make_backend(model_path)
    items = make_items(LENGTHS, seed=5)
    first = backend.train_step(items, sft_loss_fn)["train/loss"]
    for _ in range(4):
        last = backend.train_step(items, sft_loss_fn)["train/loss"]
    assert last < first


def test_target_modules_that_name_no_linear_layer_are_refused(model_path):
    with pytest.raises(ValueError, match=r"lora.target_modules: 'qkv_proj' names no linear layer.*q_proj"):
        make_backend(model_path, lora=LoraConfig(enabled=True, target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ValueError, match="'norm' names no linear layer"):
        make_backend(model_path, lora=LoraConfig(enabled=True, target_modules=["norm"]))
    with pytest.raises(ValueError, match="'lm_head' names the output head .* tied"):
        make_backend(model_path, lora=LoraConfig(enabled=True, target_modules=["lm_head"]))


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_all_linear_leaves_out_the_output_head(model_path, impl):
    backend = make_backend(model_path, impl, lora=LoraConfig(enabled=True))
    targets = backend.model.peft_config["default"].target_modules
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    narrow = make_backend(model_path, impl, lora=LoraConfig(enabled=True, target_modules=["q_proj", "v_proj"]))
    assert {name.split(".")[-4] for name, p in narrow.model.named_parameters() if p.requires_grad} == {"q_proj",
                                                                                                       "v_proj"}
