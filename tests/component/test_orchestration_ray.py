"""The orchestration on a real local Ray (one Ray for the module): every actor lands in its planned
bundle in both placements, a 2-rank trainer actor group steps exactly like the in-process backend,
engine actors serve `/generate` through the router of the rollout manager actor, a failing rank is
named on the driver, and shutting down leaves none of the started processes behind.
"""

import asyncio
import functools
import gc
import sys
import time

import httpx
import pytest
import ray
import torch
import torch.distributed as dist

from tests.processes import alive, wait_gone
from verst.config.schema import ClusterConfig, ModelConfig, TrainerConfig
from verst.inference_client.client import EngineClient
from verst.models.factory import init_model
from verst.orchestration import (
    SLOT_RESOURCE,
    Orchestration,
    Placement,
    RaySession,
    check_engine_type,
    plan_bundles,
)
from verst.orchestration.placement import current_bundle
from verst.rollout.manager import RolloutParts, RouterSpec
from verst.trainer import FSDP2Backend, RankError, TrainItem, sft_loss_fn
from verst.types import Sample, Status

CONFIG = TrainerConfig(lr=1e-3, max_tokens_per_micro_batch=40, seed=7)
PROMPT = [5, 6, 7, 8]


def make_batch(lengths, seed) -> list[TrainItem]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, (prompt, response) in enumerate(lengths):
        mask = torch.ones(response)
        mask[: response // 3] = 0.0
        items.append(TrainItem(torch.randint(0, 256, (prompt + response,), generator=g), response, mask, {}, i))
    return items


BATCH = make_batch([(5, 4), (9, 7), (3, 12), (20, 6), (4, 3)], seed=0)


def failing_loss(outputs, micro, normalizer):
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return sft_loss_fn(outputs, micro, normalizer)


def router_parts(endpoints):
    """Rollout parts whose batch is 4 one-sample groups generated through the router."""

    async def generate_batch(rollout_id, weight_version):
        async with EngineClient(endpoints.router_url) as client:
            replies = await asyncio.gather(*(
                client.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}) for _ in range(4)))
        return [[Sample(tokens=PROMPT + r.output_ids, response_length=len(r.output_ids), loss_mask=[1] * 3,
                        rollout_logprobs=r.logprobs, weight_versions=[r.weight_version], status=Status.COMPLETED,
                        group_index=i, metadata={"rollout_id": rollout_id})] for i, r in enumerate(replies)]

    return RolloutParts(generate_batch=generate_batch)


@ray.remote(num_cpus=0)
class Probe:
    def bundle(self):
        return current_bundle()


# Functions of this module travel to the actors by value: importing the module there would cost each
# actor the torch and trainer imports at the top of this file.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def ray_session():
    # 4 slots: 2 trainer ranks + 2 engines, disaggregated.
    with RaySession(slots=4, log_to_driver=False) as session:
        yield session


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("orchestration") / "tiny-qwen3", seed=3)


def test_refusals_come_before_anything_starts():
    with pytest.raises(ValueError, match="schedule = 'fully_async' with cluster.placement = 'colocated' is refused"):
        Orchestration(ClusterConfig(placement="colocated"), schedule="fully_async")
    with pytest.raises(ValueError, match="cluster.engine = 'tgi' is not registered"):
        check_engine_type("tgi")


@pytest.mark.parametrize("kind, trainer_bundles, engine_bundles", [
    ("colocated", [0, 1], [0, 1]),
    ("disaggregated", [0, 1], [2, 3]),
])
def test_bundle_plans(kind, trainer_bundles, engine_bundles):
    plan = plan_bundles(kind, trainer_ranks=2, num_engines=2, device="cpu")
    assert (plan.trainer_bundles, plan.engine_bundles) == (trainer_bundles, engine_bundles)
    assert len(plan.bundles) == plan.slots() == len(set(trainer_bundles + engine_bundles))
    shares = {plan.share(role, i) for role in ("trainer", "engine") for i in range(2)}
    assert shares == ({0.5} if kind == "colocated" else {1.0})
    gpu = plan_bundles(kind, trainer_ranks=2, num_engines=2, device="cuda")
    assert all(b["GPU"] == 1.0 and SLOT_RESOURCE not in b for b in gpu.bundles)


def test_colocated_trainer_rank_and_engine_share_a_bundle(ray_session):
    """(Disaggregated placement is checked on the real actor groups below.)"""
    placement = Placement.create(plan_bundles("colocated", trainer_ranks=2, num_engines=2, device="cpu"), timeout_s=30)
    try:
        probes = {(role, i): Probe.options(**placement.actor_options(role, i)).remote()
                  for role in ("trainer", "engine") for i in range(2)}
        where = dict(zip(probes, ray.get([p.bundle.remote() for p in probes.values()], timeout=60)))
        assert where == {(role, i): (placement.id, i) for role in ("trainer", "engine") for i in range(2)}
        for probe in probes.values():
            ray.kill(probe)
    finally:
        placement.remove()


@pytest.fixture(scope="module")
def run(ray_session, model_path, tmp_path_factory):
    """2 trainer ranks and 2 engines, disaggregated, with a rollout manager routing round-robin."""
    cluster = ClusterConfig(placement="disaggregated", trainer_ranks=2, num_engines=2, device="cpu")
    orch = Orchestration(cluster, timeout_s=120, start_timeout_s=120, log_dir=tmp_path_factory.mktemp("logs"))
    with orch:
        engines = orch.start_engines(model_path, wait=False)  # the servers start while the trainer does
        factory = functools.partial(FSDP2Backend, ModelConfig(path=str(model_path)), CONFIG, device="cpu")
        trainer = orch.start_trainer(factory)
        engines.wait_ready()
        rollout = orch.start_rollout_manager(engines.urls, router_parts, router=RouterSpec(policy="round_robin"))
        yield {"orch": orch, "engines": engines, "trainer": trainer, "rollout": rollout}


def test_actor_groups_sit_in_their_bundles(run):
    placement_id = run["orch"].placement.id
    assert [(i["placement_group"], i["bundle"]) for i in run["trainer"].infos] == [(placement_id, 0), (placement_id, 1)]
    assert [(i["placement_group"], i["bundle"]) for i in run["engines"].infos] == [(placement_id, 2), (placement_id, 3)]
    assert all(run["engines"].health().values())


def test_two_rank_actor_group_steps_like_the_in_process_backend(run, model_path):
    trainer = run["trainer"]
    got = trainer.train_step(BATCH, sft_loss_fn)
    streamed = [bucket for bucket in trainer.named_weights(bucket_bytes=1 << 16)]
    assert trainer.step == 1
    assert trainer.apply(lambda backend, k: (backend.rank, backend.world_size, k), k="x") == [(0, 2, "x"), (1, 2, "x")]
    one = FSDP2Backend(ModelConfig(path=str(model_path)), CONFIG, device="cpu")
    try:
        want = one.train_step(BATCH, sft_loss_fn)
        reference = {name: t for bucket in one.named_weights(1 << 30) for name, t in bucket}
    finally:
        dist.destroy_process_group()
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    assert len(streamed) > 1  # small buckets: the weights really came in several pieces
    weights = {name: t for bucket in streamed for name, t in bucket}
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        # Adam's g/sqrt(v) turns reduction-order noise on near-zero gradients into ~1e-5 steps.
        torch.testing.assert_close(weights[name], tensor, atol=1e-4, rtol=0)


def test_the_rollout_manager_and_the_ranks_froze_their_start_up_heaps(run):
    # verst.monitor.heap: each of these processes is verst's own; this test's process is not
    def frozen(actor: object) -> int:
        return ray.get(actor.__ray_call__.remote(lambda self: gc.get_freeze_count()))

    counts = [frozen(run["rollout"].actor), *(frozen(a) for a in run["trainer"]._actors)]
    assert all(n > 10_000 for n in counts), counts
    assert gc.get_freeze_count() == 0


def test_engines_serve_generate_through_the_managers_router(run):
    rollout, engines = run["rollout"], run["engines"]
    assert rollout.engine_urls() == engines.urls

    async def label():  # each engine names itself through its weight version
        for i, url in enumerate(engines.urls):
            async with EngineClient(url) as client:
                await client.update_weight_version(f"engine-{i}")

    asyncio.run(label())
    groups = rollout.generate_batch(rollout_id=7, weight_version=0)
    assert len(groups) == 4 and all(len(s.response_tokens) == 3 for g in groups for s in g)
    assert {s.weight_versions[0] for g in groups for s in g} == {"engine-0", "engine-1"}  # round robin
    reply = httpx.post(f"{rollout.router_url}/generate", timeout=60,
                       json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 2
    with pytest.raises(RuntimeError, match="no fully async worker"):
        rollout.start_async()


def test_a_failing_rank_is_named_and_shutdown_leaves_no_process(run):
    trainer, engines, rollout = run["trainer"], run["engines"], run["rollout"]
    pids = trainer.pids + engines.pids + [rollout.pids["manager"], rollout.pids["router"]]
    assert all(alive(p) for p in pids)
    start = time.monotonic()
    with pytest.raises(RankError, match="ValueError: boom on rank 1") as failure:
        trainer.train_step(BATCH, failing_loss)
    assert failure.value.rank == 1 and time.monotonic() - start < 30
    assert wait_gone(trainer.pids) == []
    with pytest.raises(RuntimeError, match="shut down"):
        trainer.logprobs(BATCH)
    run["orch"].shutdown()
    assert wait_gone(pids) == []
    assert ray.util.placement_group_table()  # the table is still there, the group removed
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
