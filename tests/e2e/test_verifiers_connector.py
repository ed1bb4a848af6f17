"""The verifiers connector end to end on the tiny model: a verifiers MultiTurnEnv (examples/verifiers_addition,
written with verifiers' own API) replaces the rollout fn; its rollouts run against session-server sessions in
front of the embedded engine, and the batch verst trains on holds exactly the engine's ids, with the loss mask
on the model's turns only. Success is not checked: the model is untrained."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("verifiers", reason="the verifiers extra: pip install 'verst[verifiers]'")

from examples.verifiers_addition.env import RETRY  # noqa: E402
from tests.agent_accounting import check_trained_tokens_are_the_engines, run_recorded_rollout  # noqa: E402
from verst.config import RolloutConfig, SamplingConfig  # noqa: E402
from verst.connectors.verifiers import METRICS_KEY, STOP_KEY  # noqa: E402
from verst.inference_client.client import EngineClient  # noqa: E402
from verst.models.loader import load_tokenizer  # noqa: E402
from verst.rollout.plugins import RolloutContext  # noqa: E402
from verst.rollout.rollout_fn import run_rollout  # noqa: E402

torch.set_num_threads(1)


def test_verifiers_rollouts_train_on_the_engines_tokens(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout_cfg = RolloutConfig(rollout_fn="examples.verifiers_addition.env:rollout", n_samples_per_prompt=3,
                                max_response_tokens=6, sampling=SamplingConfig(temperature=1.0, seed=0))
    batch, calls = run_recorded_rollout(tiny_model_dir, rollout_cfg, 2)

    assert [len(g) for g in batch.groups] == [3, 3]
    samples = batch.samples
    assert len({s.prompt[0]["content"] for s in samples}) == 2  # the environment's own tasks, one per group
    turns = check_trained_tokens_are_the_engines(samples, calls)
    assert turns > len(samples)  # an untrained model answers wrong: the environment asked again
    retry_ids = tokenizer.encode(RETRY, add_special_tokens=False)
    for s in samples:
        assert s.reward in (0.0, 1.0) and set(s.metadata[METRICS_KEY]) >= {"correct"}
        assert s.metadata[STOP_KEY] in ("answered_right", "max_turns_reached")
        if len(s.metadata["turns"]) == 2:  # the environment's retry request is in the sample, masked
            masked = [t for t, bit in zip(s.tokens[-s.response_length:], s.loss_mask) if not bit]
            assert any(masked[i:i + len(retry_ids)] == retry_ids for i in range(len(masked)))
    assert batch.metrics["rollout/kept_groups"] == 2.0 and "rollout/reward_mean" in batch.metrics


def test_the_environment_is_built_on_first_use_also_off_the_main_thread():
    """The rollout manager's actor imports the rollout fn and runs it off its main thread, where verifiers'
    signal handlers cannot be installed; an environment instance (built at import) or a factory that returns
    something else is refused naming what was given."""
    import threading

    from examples.verifiers_addition.env import AdditionWithRetry, load_environment
    from verst.connectors.verifiers import VerifiersRollout

    rollout = VerifiersRollout(lambda: load_environment(n_train=10))
    built: list = []
    worker = threading.Thread(target=lambda: built.append(rollout.env))
    worker.start()
    worker.join()
    assert isinstance(built[0], AdditionWithRetry) and rollout.env is built[0]
    with pytest.raises(TypeError, match="load_env must be a function that returns the Environment"):
        VerifiersRollout(built[0])
    with pytest.raises(TypeError, match="load_env returned dict; expected a verifiers Environment"):
        VerifiersRollout(dict).env


class BrokenRetry:
    """An environment whose retry turn raises (a sandbox that went away), built with verifiers' API."""

    @staticmethod
    def load():
        from examples.verifiers_addition.env import AdditionWithRetry, load_environment

        class Broken(AdditionWithRetry):
            async def env_response(self, messages, state, **kwargs):
                raise RuntimeError("sandbox gone")

        env = load_environment(n_train=4)
        return Broken(dataset=env.get_dataset(), rubric=env.rubric)


def test_a_group_whose_environment_raises_fails_and_is_replaced_until_the_rounds_run_out(tmp_path):
    from verst.connectors.verifiers import VerifiersRollout
    from verst.models.chat_template import TINY_CHAT_TEMPLATE
    from verst.models.loader import load_tokenizer
    from verst.models.tokenizer import save_tokenizer
    from verst.rollout.rollout_fn import RolloutError
    from verst.session.scripted import ScriptedEngine

    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "tok", TINY_CHAT_TEMPLATE))
    scripted = ScriptedEngine(tokenizer, ["no idea"] * 8)  # a wrong answer: the environment's retry turn runs

    async def main():
        async with EngineClient("http://scripted-engine", transport=scripted) as client:
            ctx = RolloutContext(engine=client, tokenizer=tokenizer, rollout_fn=VerifiersRollout(BrokenRetry.load),
                                 rollout=RolloutConfig(n_samples_per_prompt=2), max_rounds=2)
            try:
                return await run_rollout(ctx, 1)
            finally:
                assert len(ctx.resources["session_server"].manager) == 0  # every session was deleted
                await ctx.aclose()

    with pytest.raises(RolloutError, match=r"0 of 1 groups kept after 2 rounds \(0 filtered, 2 failed\)"):
        asyncio.run(main())
    assert len(scripted.calls) == 4  # two groups of two rollouts, one model turn each
