"""verst on a real two-node Ray cluster (`ray.cluster_utils.Cluster`: a head and a worker node, each its
own raylet and object store, both on 127.0.0.1): joined through `cluster.ray_address`, trainer ranks
pinned to the worker and engines to the head by custom resources (unpinned, Ray puts the trainer ranks
on the larger head too), weights synced across the nodes with the `distributed` transport; the cluster outlives
the run, and impossible placements are refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import ray

from tests.e2e.test_rl_schedules import check_run, rl_config, run_schedule
from verst.config.schema import ClusterConfig
from verst.orchestration import Orchestration, RaySession
from verst.orchestration.capacity import PlacementRefused

REPO = Path(__file__).resolve().parents[2]
# The head could hold every bundle (4 slots, 2 logical CPUs: 4 × 0.5), the worker only the trainer's.
HEAD = {"num_cpus": 2, "resources": {"verst_slot": 4.0, "engine_node": 2.0}}  # the engines' (and the driver's)
WORKER = {"num_cpus": 1, "resources": {"verst_slot": 2.0, "trainer_node": 2.0}}  # the trainer's
OBJECT_STORE = 80 * 2**20


@pytest.fixture(scope="module")
def cluster():
    """Yields (address, head node id, worker node id); the driver is disconnected between tests."""
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process; this module starts a cluster of its own")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_TMPDIR")}
    saved_switch = constants.ENABLE_RAY_CLUSTER
    # The nodes' processes inherit this: the workers import this checkout; every node binds loopback.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved["PYTHONPATH"]]))
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    # Ray's default home is TMPDIR/ray (or /tmp/ray), shared by every Ray on the machine and absent on a new
    # one; `Cluster` writes its address file there. This cluster keeps everything in a home of its own.
    temp_dir = tempfile.mkdtemp(prefix="vc-")  # short: Ray's sockets live under it
    ray_home = Path(temp_dir) / "ray"
    ray_home.mkdir()
    os.environ["RAY_TMPDIR"] = temp_dir
    nodes = None
    try:
        common = {"object_store_memory": OBJECT_STORE, "node_ip_address": "127.0.0.1"}
        nodes = Cluster(initialize_head=True, head_node_args={
            **common, **HEAD, "include_dashboard": False, "temp_dir": str(ray_home)})
        worker = nodes.add_node(**common, **WORKER)
        nodes.wait_for_nodes()
        yield nodes.address, nodes.head_node.node_id, worker.node_id
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if nodes is not None:
            nodes.shutdown()  # ends the raylets, GCS and workers this fixture started, by their handles
        constants.ENABLE_RAY_CLUSTER = saved_switch
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp_dir, ignore_errors=True)


def alive_nodes(address: str) -> set[str]:
    """The cluster's alive node ids, from a connection of its own (closed again)."""
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()


def test_joining_starts_nothing_and_leaves_the_cluster_running(cluster):
    address, head, worker = cluster
    session = RaySession(address, log_to_driver=False).start()
    try:
        assert session.owned and session.tmp_dir is None and session._reaper is None  # no local Ray, no reaper
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == {head, worker}
    finally:
        session.shutdown()
    assert not ray.is_initialized()
    assert alive_nodes(address) == {head, worker}  # disconnecting did not end the cluster


def test_a_local_session_starts_a_ray_of_its_own_beside_another_cluster(cluster, monkeypatch):
    """Another Ray runs on the machine, its address is in Ray's address file (`Cluster` wrote it) and in
    RAY_ADDRESS: a session without `cluster.ray_address` still starts a Ray of its own and leaves that one be."""
    address, head, worker = cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    assert (Path(os.environ["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").read_text() == address
    with RaySession(slots=1, log_to_driver=False) as session:
        assert session.tmp_dir is not None  # a local Ray with the run's own temporary directory
        ours = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(ours) == 1 and not ours & {head, worker}, ours
        assert ray.get(ray.remote(lambda: 7).remote()) == 7
    assert alive_nodes(address) == {head, worker}


def test_a_dead_ray_address_in_the_environment_is_ignored_and_named(monkeypatch, caplog):
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", dead)
    with caplog.at_level(logging.WARNING, logger="verst.orchestration.ray_session"):
        with RaySession(slots=1, log_to_driver=False) as session:
            assert session.tmp_dir is not None
            assert ray.get(ray.remote(lambda: 7).remote()) == 7
    assert f"RAY_ADDRESS={dead} is set and ignored" in caplog.text and "cluster.ray_address" in caplog.text


def test_impossible_placements_are_refused_by_field_before_anything_is_reserved(cluster):
    address, _, _ = cluster
    pinned = {"ray_address": address, "trainer_resources": {"trainer_node": 1}, "engine_resources": {"engine_node": 1}}
    cases = [
        (ClusterConfig(**pinned, trainer_ranks=3), r"the trainer ranks need 3 bundles .*lower cluster.trainer_ranks"),
        (ClusterConfig(**{**pinned, "engine_resources": {"gpu_box": 1}}),
         r"no node has 'gpu_box' \(cluster.engine_resources"),
        (ClusterConfig(**pinned, placement="colocated"), "no node has them all together"),
    ]
    for config, message in cases:
        orch = Orchestration(config, start_timeout_s=30)
        with pytest.raises(PlacementRefused, match=message):
            orch.start()
        assert orch.placement is None and not ray.is_initialized()  # disconnected again, nothing left


@pytest.mark.slow
def test_rl_steps_with_trainer_and_engines_on_different_nodes(cluster, tiny_model_dir, addition_data_dir, tmp_path):
    """2 trainer ranks on the worker, 2 engines on the head, 2 sync steps; the first sync's weight check
    compares the engines' logprobs with the trainer's, so the broadcast across the nodes is exact."""
    address, head, worker = cluster
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync",
                    "--sync.transport", "distributed", "--sync.check-weights", "true",
                    "--cluster.ray-address", address, "--cluster.trainer-ranks", "2", "--cluster.num-engines", "2",
                    "--cluster.trainer-resources", "{trainer_node: 1}", "--cluster.engine-resources", "{engine_node: 1}")
    records = check_run(cfg, run_schedule(cfg), steps=2)
    assert any(k.startswith("sync/check") for k in records[1]), sorted(records[1])
    listed = json.loads((Path(cfg.run_dir) / "processes.json").read_text())
    nodes = {entry["name"]: entry["node_id"] for entry in listed}
    trainer = {nodes[f"trainer rank {rank}"] for rank in (0, 1)}
    engines = {node for name, node in nodes.items() if name.startswith("engine ")}
    assert trainer == {worker} and engines == {head}, listed
    assert nodes["rollout manager"] == head  # the driver's node, whose loopback router it calls
    assert not ray.is_initialized()
    assert alive_nodes(address) == {head, worker}  # the run left the user's cluster as it found it
