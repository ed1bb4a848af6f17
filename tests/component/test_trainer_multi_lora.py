"""Multi-LoRA on the FSDP2 backend in-process (one rank, gloo, float32): several named adapters on one base,
each trained alone with its own optimizer and lr, synced and exported by name; the reference is the base."""

import pytest
import torch
import torch.distributed as dist

from verst.config.schema import LoraAdapterConfig, LoraConfig
from verst.trainer.persistence import saved_extra

from .test_trainer_backend import LENGTHS, make_items, pg_loss
from .test_trainer_lora import make_backend, max_diff, model_path  # noqa: F401

MULTI = LoraConfig(enabled=True, rank=4, alpha=8.0, adapters=[
    LoraAdapterConfig(name="add"), LoraAdapterConfig(name="rev", rank=2, target_modules=["q_proj"], lr=2e-2)])


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def adapter_params(backend, name: str) -> dict[str, torch.Tensor]:
    parts = (f".lora_A.{name}.", f".lora_B.{name}.")
    return {k: p.full_tensor().clone() for k, p in backend.model.named_parameters() if any(s in k for s in parts)}


def test_each_step_trains_the_active_adapter_only(model_path, tmp_path):  # noqa: F811
    backend = make_backend(model_path, lora=MULTI, ref_model_path=str(model_path), adapter_steps={"add": 4, "rev": 4})
    items = make_items(LENGTHS, advantages=True)
    base = backend.logprobs(items, reference=True)
    add0, rev0 = adapter_params(backend, "add"), adapter_params(backend, "rev")
    backend.use_adapter("add")
    metrics = backend.train_step(items, pg_loss)
    assert metrics["train/lr"] == pytest.approx(1e-2)
    add1, rev1 = adapter_params(backend, "add"), adapter_params(backend, "rev")
    assert all(torch.equal(rev0[k], rev1[k]) for k in rev0)  # the other adapter did not move
    assert any(not torch.equal(add0[k], add1[k]) for k in add0)
    add_lp = backend.logprobs(items)
    backend.use_adapter("rev")
    assert max_diff(backend.logprobs(items), base) == 0.0  # rev is still B = 0: the base's outputs
    assert backend.train_step(items, pg_loss)["train/lr"] == pytest.approx(2e-2)  # its own optimizer's lr
    assert all(torch.equal(add1[k], v) for k, v in adapter_params(backend, "add").items())
    assert max_diff(backend.logprobs(items, reference=True), base) == 0.0  # the reference: adapters disabled
    backend.use_adapter("add")
    assert max_diff(backend.logprobs(items), add_lp) == 0.0
    assert backend.adapter_step == {"add": 1, "rev": 1} and backend.step == 2

    # weight sync: the active adapter's tensors under PEFT's saved names, its config and name
    name, config = backend.sync_adapter
    assert name == "add" and config["r"] == 4
    synced = [n for bucket in backend.synced_weights(2**30) for n, _ in bucket]
    assert synced and all(".add." not in n and ".rev." not in n for n in synced)
    backend.use_adapter("rev")
    name, config = backend.sync_adapter
    assert name == "rev" and config["r"] == 2 and config["target_modules"] == ["q_proj"]
    rev_synced = [n for bucket in backend.synced_weights(2**30) for n, _ in bucket]
    assert rev_synced and all("q_proj" in n for n in rev_synced)

    # checkpoint: every adapter with its optimizer state and step count; export: one directory per adapter
    backend.save(tmp_path / "ckpt")
    assert saved_extra(tmp_path / "ckpt")["adapter_step"] == {"add": 1, "rev": 1}
    resumed = make_backend(model_path, lora=MULTI, adapter_steps={"add": 4, "rev": 4})
    resumed.load(tmp_path / "ckpt")
    assert resumed.adapter_step == {"add": 1, "rev": 1}
    for name in ("add", "rev"):
        mine, theirs = adapter_params(backend, name), adapter_params(resumed, name)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    backend.export_hf(tmp_path / "hf")
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(tmp_path / "hf" / "rev")).r == 2
    assert (tmp_path / "hf" / "add" / "adapter_model.safetensors").is_file()
