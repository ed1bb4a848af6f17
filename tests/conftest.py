"""Shared fixtures: a tiny model, its tokenizer with the chat template, and the addition task, made once per test
session; the real SmolLM2 model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from verst.models import init_model

    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("models") / "tiny-qwen3", seed=0)


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tiny models' tokenizer and chat template, without making a model."""
    from verst.models.chat_template import TINY_CHAT_TEMPLATE
    from verst.models.loader import load_tokenizer
    from verst.models.tokenizer import save_tokenizer

    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tokenizer"), TINY_CHAT_TEMPLATE))


@pytest.fixture(scope="session")
def addition_data_dir(tmp_path_factory):
    from verst.data import make_splits, write_jsonl

    out = tmp_path_factory.mktemp("data") / "addition"
    train, test = make_splits("addition", n_train=2000, n_test=100, seed=0)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(test, out / "test.jsonl")
    return out


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint (tests/real_model.py): for `slow` tests only."""
    from tests.real_model import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture
def registries_restored():
    """The registries as they were before the test, and plug-in modules imported during it forgotten: a
    test that registers names of its own (through `plugins`) leaves the process's registries as it found them."""
    import sys

    from verst.config.registries import REGISTRIES

    saved = [(registry, dict(registry._entries), dict(registry._loaded)) for registry in REGISTRIES]
    modules = set(sys.modules)
    yield
    for registry, entries, loaded in saved:
        registry._entries, registry._loaded = entries, loaded
    for name in set(sys.modules) - modules:
        if name.startswith(("examples.plugins", "tests.")):  # a plug-in module registers again when imported
            del sys.modules[name]


@pytest.fixture(autouse=True)
def cores_given_back():
    """Every test leaves this process on the cores it had: a run in this process pins its threads to its core
    share, and a run started later plans its core budget from the cores the process may use. A test that
    leaves it pinned is named in a warning, and the cores are given back."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = tuple(sorted(os.sched_getaffinity(0)))
    yield
    after = tuple(sorted(os.sched_getaffinity(0)))
    if after != before:
        from verst.types.cores import pin_process

        pin_process(before)
        import warnings

        warnings.warn(f"the test left this process pinned to cores {list(after)} (it had {list(before)})", stacklevel=1)
