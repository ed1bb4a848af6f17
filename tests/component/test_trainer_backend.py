"""The FSDP2 backend in-process (one rank, gloo, float32) on a real tiny Qwen3 checkpoint."""

import functools
import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from verst.config.schema import ModelConfig, TrainerConfig
from verst.models.factory import init_model
from verst.models.native import NativeCausalLM
from verst.trainer import ForwardOutputs, FSDP2Backend, MicroBatch, TrainBackend, TrainItem, sft_loss_fn
from verst.trainer.optim import lr_factor

VOCAB = 256  # ids drawn from the byte range of the tiny tokenizer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("trainer-backend") / "tiny-qwen3", seed=3)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def make_backend(path, impl="auto", **trainer) -> FSDP2Backend:
    """On CPU `impl` auto is verst's native model for these checkpoints; "transformers" keeps theirs."""
    kwargs = {k: trainer.pop(k) for k in ("total_steps", "ref_model_path", "packing", "temperature") if k in trainer}
    config = TrainerConfig(**{"lr": 1e-3, "max_tokens_per_micro_batch": 4096, **trainer})
    return FSDP2Backend(ModelConfig(path=str(path), impl=impl), config, device="cpu", **kwargs)


def make_items(lengths, seed=0, advantages=False) -> list[TrainItem]:
    """Mixed prompt/response lengths; some env tokens (loss_mask 0) in the middle of responses."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, (prompt, response) in enumerate(lengths):
        mask = torch.ones(response)
        if response > 3:
            mask[1:3] = 0.0
        extras = {"advantages": torch.randn(response, generator=g)} if advantages else {}
        items.append(TrainItem(torch.randint(0, VOCAB, (prompt + response,), generator=g), response, mask, extras, i))
    return items


LENGTHS = [(5, 4), (9, 7), (3, 12), (20, 6), (4, 1), (6, 0), (2, 9)]


def plain_logprobs(model, items, temperature=1.0):
    """Reference: one full-sequence forward per item, no padding, no packing."""
    out = []
    with torch.no_grad():
        for it in items:
            logits = model(it.tokens[None], use_cache=False).logits[0, :-1] / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, it.tokens[1:, None])[:, 0]
            out.append(lp[it.prompt_length - 1 :])
    return out


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def pg_loss(outputs: ForwardOutputs, batch: MicroBatch, normalizer: float):
    """A REINFORCE-style loss that reads an extra, for checking the gradient plumbing."""
    per_token = -batch["advantages"] * outputs.logprobs * batch.loss_mask
    return per_token.sum() / normalizer, {"adv_mean": (batch["advantages"] * batch.loss_mask).sum() / batch.loss_mask.sum()}


def nan_loss(outputs, batch, normalizer):
    return outputs.logprobs.sum() * float("nan"), {}


def weights(backend) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in backend.named_weights(1 << 30) for name, t in bucket}


# ---- logprobs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["auto", "transformers"])
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("budget", [4096, 32])
def test_logprobs_equal_a_plain_full_sequence_forward(model_path, packing, budget, impl):
    backend = make_backend(model_path, impl, packing=packing, max_tokens_per_micro_batch=budget, temperature=0.7)
    assert isinstance(backend.model, NativeCausalLM) == (impl == "auto")
    items = make_items(LENGTHS)
    got = backend.logprobs(items)
    want = plain_logprobs(hf_model(model_path), items, temperature=0.7)
    assert [t.shape[0] for t in got] == [r for _, r in LENGTHS]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_logprobs_of_other_architectures(arch, tmp_path):
    path = init_model(arch, "tiny", tmp_path / arch)
    items = make_items(LENGTHS, seed=6)
    want = plain_logprobs(hf_model(path), items)
    for packing in (False, True):
        got = make_backend(path, packing=packing, max_tokens_per_micro_batch=40).logprobs(items)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_entropy_and_frozen_reference(model_path):
    backend = make_backend(model_path, ref_model_path=str(model_path))
    items = make_items(LENGTHS[:4], seed=1)
    logprobs, entropy = backend.logprobs(items, with_entropy=True)
    model = hf_model(model_path)
    with torch.no_grad():
        logits = model(items[1].tokens[None]).logits[0, items[1].prompt_length - 1 : -1]
    want = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(entropy[1], want, atol=1e-5, rtol=0)
    backend.train_step(items, sft_loss_fn)
    after = backend.logprobs(items)
    ref = backend.logprobs(items, reference=True)
    for a, r, before in zip(after, ref, logprobs):
        torch.testing.assert_close(r, before, atol=1e-6, rtol=0)  # the reference never trains
        assert not torch.allclose(a, before, atol=1e-4)  # the policy did
    with pytest.raises(ValueError, match="without ref_model_path"):
        make_backend(model_path).logprobs(items, reference=True)


# ---- training ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_train_step_gradient_equals_plain_autograd(model_path, impl):
    """Normaliser, masks and extras: verst's pre-clip grad norm and loss equal a plain computation on
    transformers' model (the native model's gradients are transformers')."""
    items = make_items(LENGTHS, seed=2, advantages=True)
    backend = make_backend(model_path, impl, max_tokens_per_micro_batch=32, grad_clip=1e9)
    metrics = backend.train_step(items, pg_loss)
    model = hf_model(model_path)
    total_tokens = sum(float(it.loss_mask.sum()) for it in items)
    loss = sum((-(it.extras["advantages"] * lp * it.loss_mask).sum()) for it, lp in zip(items, _grad_logprobs(model, items)))
    (loss / total_tokens).backward()
    loss = loss.detach()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert metrics["train/loss"] == pytest.approx(loss.item() / total_tokens, rel=1e-5, abs=1e-7)
    assert metrics["train/grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    want_adv = sum(float((it.extras["advantages"] * it.loss_mask).sum()) for it in items) / total_tokens
    assert metrics["train/adv_mean"] == pytest.approx(want_adv, rel=1e-5)
    assert set(metrics) == {"train/loss", "train/adv_mean", "train/grad_norm", "train/lr", "perf/train_tokens_per_s"}


def _grad_logprobs(model, items):
    for it in items:
        logits = model(it.tokens[None], use_cache=False).logits[0, :-1]
        yield torch.log_softmax(logits, -1).gather(-1, it.tokens[1:, None])[:, 0][it.prompt_length - 1 :]


def test_micro_batching_packing_and_checkpointing_do_not_change_the_step(model_path):
    """Same global batch, different layouts: the same losses, lr schedule and weights."""
    common = dict(lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.1, total_steps=4)
    one = make_backend(model_path, packing=False, max_tokens_per_micro_batch=4096, **common)
    many = make_backend(model_path, packing=True, max_tokens_per_micro_batch=32, gradient_checkpointing=True, **common)
    batches = [make_items(LENGTHS, seed=5)] * 3  # one batch thrice, so the loss must fall
    results = [[b.train_step(items, sft_loss_fn) for items in batches] for b in (one, many)]
    for a, b in zip(*results):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/lr"] == b["train/lr"]
    assert [m["train/lr"] for m in results[0]] == pytest.approx([1e-3 * lr_factor(s, one.config, 4) for s in range(3)])
    losses = [m["train/loss"] for m in results[0]]
    assert losses[2] < losses[1] < losses[0]
    # Adam divides by sqrt(v): summation-order noise in near-zero gradients shows at ~lr × 1e-2.
    for name, tensor in weights(one).items():
        torch.testing.assert_close(weights(many)[name], tensor, atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_activation_checkpointing_is_on_for_both_model_classes_and_keeps_the_step(model_path, impl):
    """trainer.gradient_checkpointing recomputes activations in backward on verst's native model and on
    transformers' alike; the step stays the same."""
    plain = make_backend(model_path, impl)
    recomputed = make_backend(model_path, impl, gradient_checkpointing=True)
    def checkpointing(model):  # transformers' property is is_gradient_checkpointing before 5.2x (the floor, 5.17)
        if impl == "auto":
            return model.checkpointing is not None
        name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
        return getattr(model, name)

    assert checkpointing(recomputed.model) and not checkpointing(plain.model)
    items = make_items(LENGTHS, seed=3)
    a, b = plain.train_step(items, sft_loss_fn), recomputed.train_step(items, sft_loss_fn)
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6)
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    for name, tensor in weights(plain).items():
        torch.testing.assert_close(weights(recomputed)[name], tensor, atol=1e-6, rtol=0)


def test_non_finite_gradients_and_empty_batches_are_refused(model_path):
    backend = make_backend(model_path)
    with pytest.raises(FloatingPointError, match="gradient norm is nan at train step 0"):
        backend.train_step(make_items(LENGTHS[:2]), nan_loss)
    silent = make_items(LENGTHS[:2])
    for it in silent:
        it.loss_mask.zero_()
    with pytest.raises(ValueError, match="no policy tokens"):
        backend.train_step(silent, sft_loss_fn)


# ---- weights and checkpoints ------------------------------------------------------------------
def test_named_weights_are_full_hf_named_buckets(model_path):
    backend = make_backend(model_path)
    assert isinstance(backend, TrainBackend)
    saved = load_file(str(model_path / "model.safetensors"))
    buckets = list(backend.named_weights(bucket_bytes=64 * 1024))
    assert len(buckets) > 1
    for bucket in buckets:
        if len(bucket) > 1:
            assert sum(t.numel() * t.element_size() for _, t in bucket) <= 64 * 1024
    got = {name: t for bucket in buckets for name, t in bucket}
    assert set(got) == set(saved)  # tied lm_head appears once, as in the HF checkpoint
    for name, tensor in saved.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_export_hf_loads_in_transformers_with_identical_logits(model_path, tmp_path, impl):
    backend = make_backend(model_path, impl)
    items = make_items(LENGTHS, seed=4)
    backend.train_step(items, sft_loss_fn)
    backend.export_hf(tmp_path / "hf")
    exported = hf_model(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (model_path / name).read_bytes()
    for got, want in zip(plain_logprobs(exported, items), backend.logprobs(items)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for name, tensor in weights(backend).items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_save_and_load_resume_in_process(model_path, tmp_path):
    make = functools.partial(make_backend, model_path, lr_schedule="linear", total_steps=4)
    batches = [make_items(LENGTHS, seed=s) for s in range(3)]
    first = make()
    first.train_step(batches[0], sft_loss_fn)
    first.save(tmp_path / "ckpt")
    want = [first.train_step(b, sft_loss_fn) for b in batches[1:]]
    second = make()
    second.load(tmp_path / "ckpt")
    assert second.step == 1
    got = [second.train_step(b, sft_loss_fn) for b in batches[1:]]
    for g, w in zip(got, want):
        assert (g["train/loss"], g["train/lr"]) == pytest.approx((w["train/loss"], w["train/lr"]), rel=1e-6)
    for name, tensor in weights(first).items():
        torch.testing.assert_close(weights(second)[name], tensor, atol=1e-6, rtol=0)
    with pytest.raises(FileNotFoundError, match="not a complete trainer checkpoint"):
        second.load(tmp_path / "missing")


def test_a_background_save_holds_the_state_of_its_call(model_path, tmp_path):
    """The shards are copied at the call: steps taken while the thread writes do not leak in; the
    directory is complete once the rank's write has ended and COMPLETE is written."""
    from verst.monitor.checkpoint_dirs import wait_trainer_writes

    make = functools.partial(make_backend, model_path, lr_schedule="linear", total_steps=4)
    batches = [make_items(LENGTHS, seed=s) for s in range(3)]
    first = make()
    first.train_step(batches[0], sft_loss_fn)
    first.save(tmp_path / "ckpt", background=True)
    want = [first.train_step(b, sft_loss_fn) for b in batches[1:]]  # while the write may still run
    first.wait_saves()
    wait_trainer_writes(tmp_path / "ckpt", ranks=1, step=1)
    second = make()
    second.load(tmp_path / "ckpt")
    got = [second.train_step(b, sft_loss_fn) for b in batches[1:]]
    for g, w in zip(got, want):
        assert (g["train/loss"], g["train/lr"]) == pytest.approx((w["train/loss"], w["train/lr"]), rel=1e-6)
    for name, tensor in weights(first).items():
        torch.testing.assert_close(weights(second)[name], tensor, atol=1e-6, rtol=0)


def test_a_native_trainer_imports_no_transformers_modeling(model_path):
    import subprocess
    import sys

    code = ("import sys, torch.distributed as dist; "
            "from verst.config.schema import ModelConfig, TrainerConfig; from verst.trainer.fsdp import FSDP2Backend; "
            f"b = FSDP2Backend(ModelConfig(path={str(model_path)!r}), TrainerConfig(), device='cpu'); "
            "print([m for m in sys.modules if m.startswith('transformers')]); "  # FSDP2 itself imports dynamo
            "dist.destroy_process_group()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
