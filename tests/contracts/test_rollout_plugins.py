"""Contract of the three rollout plug-in layers: a generate fn, rollout fn and agent fn named by import path
(here, functions of this module) are loaded, checked and used by the defaults; bad paths and wrong
signatures fail naming the config field and the path; a rollout fn's batch is checked on return."""

import asyncio

import pytest

from verst.config import ConfigError, ImportPathError, RewardConfig, RolloutConfig, VerstConfig
from verst.data import PromptSource
from verst.rollout.generate import generate as default_generate
from verst.rollout.plugins import (
    RolloutBatch,
    RolloutContext,
    load_agent_fn,
    load_generate_fn,
    load_plugin,
    load_rollout_fn,
)
from verst.rollout.rollout_fn import rollout as default_rollout
from verst.rollout.rollout_fn import run_rollout
from verst.types import Sample, Status

HERE = __name__
GENERATED: list[int] = []


# ---- plug-ins that keep the contract ----------------------------------------------------------
async def echo_generate(ctx, sample):
    """A generate fn with no engine: the prompt's bytes echoed back, one version per call."""
    GENERATED.append(sample.index)
    prompt = list(sample.prompt.encode())
    sample.tokens = prompt + prompt[:2]
    sample.response_length = 2
    sample.loss_mask, sample.rollout_logprobs = [1, 1], [-0.1, -0.2]
    sample.weight_versions.append("4")
    sample.response = sample.prompt[:2]
    sample.status = Status.COMPLETED
    return sample


async def index_parity_reward(sample):
    return float(sample.index % 2)


async def two_group_rollout(ctx, n_groups):
    groups = ctx.source.next_groups(n_groups, ctx.rollout.n_samples_per_prompt)
    for group in groups:
        for s in group:
            await echo_generate(ctx, s)
            s.reward = 1.0
    return RolloutBatch(groups, {"rollout/custom": 1.0})


async def agent_run(base_url, prompt, request_kwargs, metadata, **extra):
    return {"turns": 1}


class AsyncCallable:
    async def __call__(self, ctx, sample):
        return sample


GENERATE_INSTANCE = AsyncCallable()


# ---- plug-ins that break it --------------------------------------------------------------------
def sync_generate(ctx, sample):
    return sample


async def one_arg_generate(sample):
    return sample


async def keyword_only_rollout(ctx, *, n_groups):
    return RolloutBatch([])


async def agent_three_args(base_url, prompt, request_kwargs):
    return None


NOT_CALLABLE = 3


async def rollout_returning_a_list(ctx, n_groups):
    return []


async def rollout_short_by_one(ctx, n_groups):
    return await two_group_rollout(ctx, n_groups - 1)


async def generate_returning_a_dict(ctx, sample):
    return {"tokens": []}


def prompts(n=8):
    return PromptSource([Sample(prompt=f"prompt {i}") for i in range(n)], shuffle=False)


def context(**rollout_kw):
    reward = RewardConfig(type="custom", path=f"{HERE}:index_parity_reward")
    cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=2, **rollout_kw)
    return RolloutContext(engine=object(), tokenizer=None, rollout=cfg, reward=reward, source=prompts())


def test_defaults_when_no_path_is_set():
    cfg = RolloutConfig()
    assert load_generate_fn(cfg) is default_generate
    assert load_rollout_fn(cfg) is default_rollout
    assert load_agent_fn(cfg) is None


def test_custom_generate_fn_by_path_is_used_by_the_default_rollout_fn():
    GENERATED.clear()
    ctx = context(generate_fn=f"{HERE}:echo_generate", dynamic_filter="zero_std")
    assert ctx.generate_fn is echo_generate and ctx.rollout_fn is default_rollout
    batch = asyncio.run(run_rollout(ctx, 2))
    assert sorted(GENERATED) == [s.index for s in batch.samples] == [0, 1, 2, 3]
    assert [s.reward for s in batch.samples] == [0.0, 1.0, 0.0, 1.0]  # the custom reward fn by path
    assert batch.metrics["rollout/weight_version_mean"] == 4.0


def test_custom_rollout_fn_by_path_is_what_run_rollout_calls():
    ctx = context(rollout_fn=f"{HERE}.two_group_rollout")  # the dotted form works too
    batch = asyncio.run(run_rollout(ctx, 2))
    assert batch.metrics == {"rollout/custom": 1.0} and len(batch.groups) == 2
    assert ctx.state.step == 1


def test_from_config_resolves_every_layer_from_the_tree():
    cfg = VerstConfig(rollout={"rollout_fn": f"{HERE}:two_group_rollout", "generate_fn": f"{HERE}:GENERATE_INSTANCE",
                               "agent_fn": f"{HERE}:agent_run"})
    ctx = RolloutContext.from_config(cfg, engine=object(), tokenizer=None, source=prompts())
    assert ctx.rollout_fn is two_group_rollout and ctx.generate_fn is GENERATE_INSTANCE
    assert ctx.agent_fn is agent_run and load_agent_fn(cfg.rollout) is agent_run
    reply = asyncio.run(ctx.agent_fn("http://127.0.0.1:1/sessions/s1", "2+2=", {"max_tokens": 4}, {"max_seq_len": 64}))
    assert reply == {"turns": 1}


@pytest.mark.parametrize("layer, field", [("generate", "generate_fn"), ("rollout", "rollout_fn"),
                                          ("agent", "agent_fn")])
@pytest.mark.parametrize("path", ["tests.contracts.no_such_module:fn", f"{HERE}:no_such_fn", "no_module_part"])
def test_bad_import_paths_name_the_field_and_path(layer, field, path):
    with pytest.raises(ImportPathError) as info:
        load_plugin(path, layer)
    assert f"rollout.{field} = {path!r}" in str(info.value)


@pytest.mark.parametrize("field, name, why", [
    ("generate_fn", "sync_generate", "is not an async function"),
    ("generate_fn", "one_arg_generate", "cannot be called as `async def generate(ctx, sample) -> Sample`"),
    ("generate_fn", "AsyncCallable", "is a class"),
    ("generate_fn", "NOT_CALLABLE", "is not callable"),
    ("rollout_fn", "keyword_only_rollout", "cannot be called as `async def rollout(ctx, n_groups)"),
    ("agent_fn", "agent_three_args", "cannot be called as `async def run(base_url, prompt, request_kwargs, metadata)"),
])
def test_wrong_signatures_fail_naming_the_field_and_path(field, name, why):
    path = f"{HERE}:{name}"
    cfg = RolloutConfig(**{field: path})
    with pytest.raises(ConfigError) as info:
        RolloutContext(engine=object(), tokenizer=None, rollout=cfg)
    assert f"rollout.{field} = {path!r}" in str(info.value) and why in str(info.value)


def test_plugins_passed_directly_are_checked_too():
    with pytest.raises(ConfigError, match="rollout.generate_fn .* is not an async function"):
        RolloutContext(engine=object(), tokenizer=None, generate_fn=sync_generate)


@pytest.mark.parametrize("name, error, message", [
    ("rollout_returning_a_list", TypeError, "returned list; expected RolloutBatch"),
    ("rollout_short_by_one", ValueError, r"returned groups of sizes \[2\]; expected 2 groups of 2"),
])
def test_a_rollout_fn_breaking_the_batch_contract_fails_at_once(name, error, message):
    ctx = context(rollout_fn=f"{HERE}:{name}")
    with pytest.raises(error, match=message):
        asyncio.run(run_rollout(ctx, 2))


def test_a_generate_fn_returning_a_non_sample_fails_the_step():
    ctx = context(generate_fn=f"{HERE}:generate_returning_a_dict")
    with pytest.raises(TypeError, match="returned dict for sample 0; expected Sample"):
        asyncio.run(run_rollout(ctx, 2))
