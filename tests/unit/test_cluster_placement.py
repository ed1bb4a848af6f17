"""Placement on a multi-node cluster without Ray: bundles carry the roles' custom resources, impossible
placements are refused by field name before anything is created, and `cluster.ray_address` is checked."""

import json
import socket
from types import SimpleNamespace

import pytest

from verst.config import ConfigError, load_config
from verst.config.schema import ClusterConfig, SyncConfig
from verst.orchestration import Orchestration
from verst.orchestration.capacity import NodeOffer, PlacementRefused, check_fits
from verst.orchestration.placement import CPUS_PER_BUNDLE, plan_bundles
from verst.orchestration.ray_session import SLOT_RESOURCE, check_reachable, split_address
from verst.orchestration.watchdog import ProcessStatus, RunProcesses

TRAINER, ENGINE = {"trainer_node": 1.0}, {"engine_node": 1.0}


def node(name, cpus=1.0, slots=2.0, **custom):
    return NodeOffer(f"{name:0<56}", "10.0.0." + str(len(name)), {"CPU": cpus, SLOT_RESOURCE: slots, **custom})


def two_nodes(trainer_node=2.0, engine_node=1.0):
    return [node("a", trainer_node=trainer_node), node("bb", engine_node=engine_node)]


def test_bundles_carry_each_roles_resources():
    plan = plan_bundles("disaggregated", 2, 1, "cpu", trainer_resources=TRAINER, engine_resources=ENGINE)
    base = {"CPU": CPUS_PER_BUNDLE, SLOT_RESOURCE: 1.0}
    assert plan.bundles == [{**base, **TRAINER}, {**base, **TRAINER}, {**base, **ENGINE}]
    shared = plan_bundles("colocated", 2, 1, "cuda", trainer_resources={"x": 1, "t": 2}, engine_resources={"x": 3})
    # bundle 0 holds rank 0 and engine 0: both roles' resources, the larger amount of a shared one
    assert shared.bundles == [{"CPU": CPUS_PER_BUNDLE, "GPU": 1.0, "x": 3.0, "t": 2.0},
                              {"CPU": CPUS_PER_BUNDLE, "GPU": 1.0, "x": 1.0, "t": 2.0}]
    assert plan_bundles("disaggregated", 1, 1, "cpu").bundles == [base, base]  # none named: as before


def test_a_placement_that_fits_passes():
    plan = plan_bundles("disaggregated", 2, 1, "cpu", trainer_resources=TRAINER, engine_resources=ENGINE)
    check_fits(plan, two_nodes())
    check_fits(plan_bundles("disaggregated", 2, 2, "cpu"), two_nodes())  # no pins: anywhere


def test_a_resource_no_node_declares_is_refused_by_field():
    plan = plan_bundles("disaggregated", 1, 1, "cpu", trainer_resources=TRAINER, engine_resources={"gpu_box": 1})
    with pytest.raises(PlacementRefused, match=r"the engines ask .* no node has 'gpu_box' \(cluster.engine_resources "
                                               r"= \{'gpu_box': 1.0\}\)"):
        check_fits(plan, two_nodes())


def test_too_many_ranks_for_the_pinned_nodes_is_refused_by_count_field():
    plan = plan_bundles("disaggregated", 3, 1, "cpu", trainer_resources=TRAINER, engine_resources=ENGINE)
    with pytest.raises(PlacementRefused, match=r"the trainer ranks need 3 bundles .* take 2 in all.*"
                                               r"lower cluster.trainer_ranks"):
        check_fits(plan, two_nodes())
    plan = plan_bundles("disaggregated", 1, 2, "cpu", trainer_resources=TRAINER, engine_resources=ENGINE)
    with pytest.raises(PlacementRefused, match="the engines need 2 bundles .* lower cluster.num_engines"):
        check_fits(plan, two_nodes())


def test_colocated_roles_pinned_to_different_nodes_is_refused():
    plan = plan_bundles("colocated", 1, 1, "cpu", trainer_resources=TRAINER, engine_resources=ENGINE)
    with pytest.raises(PlacementRefused, match="no node has them all together .*colocated.*cluster.trainer_resources "
                                               "and cluster.engine_resources must both be on it"):
        check_fits(plan, two_nodes())


def test_missing_slots_and_gpus_are_explained():
    with pytest.raises(PlacementRefused, match=f"no node has '{SLOT_RESOURCE}' .*ray start .*--resources"):
        check_fits(plan_bundles("disaggregated", 1, 1, "cpu"), [node("a", slots=0.0)])
    with pytest.raises(PlacementRefused, match=r"the trainer ranks and the engines need 4 bundles .* take 3"):
        check_fits(plan_bundles("disaggregated", 2, 2, "cpu"), [node("a", cpus=4, slots=3.0)])
    # each role fits the nodes it may use, but the ranks pinned to node a leave one slot for two engines
    pinned = plan_bundles("disaggregated", 2, 2, "cpu", trainer_resources=TRAINER)
    with pytest.raises(PlacementRefused, match=r"needs 4 'verst_slot' in all .* the Ray cluster has 3"):
        check_fits(pinned, [node("a", cpus=2, trainer_node=2), node("bb", slots=1.0)])
    with pytest.raises(PlacementRefused, match=r"'GPU' \(cluster.device = 'cuda'"):
        check_fits(plan_bundles("disaggregated", 1, 1, "cuda"), [node("a")])


def test_resource_fields_are_validated_at_config_load():
    cfg = load_config(None, ["--cluster.trainer-resources", "{trainer_node: 1}",
                             "--cluster.engine-resources", '{"engine_node": 2}'])
    assert (cfg.cluster.trainer_resources, cfg.cluster.engine_resources) == (TRAINER, {"engine_node": 2.0})
    with pytest.raises(ConfigError, match=r"cluster.trainer_resources: 'CPU' is not a custom resource"):
        load_config(None, ["--cluster.trainer-resources", "{CPU: 1}"])
    with pytest.raises(ConfigError, match=r"cluster.engine_resources: 'x': the amount 0.0 must be > 0"):
        load_config(None, ["--cluster.engine-resources", "{x: 0}"])
    with pytest.raises(ConfigError, match=r"cluster.ray_address: 'ray://h:10001': Ray Client addresses"):
        load_config(None, ["--cluster.ray-address", "ray://h:10001"])
    assert ClusterConfig(ray_address="auto").ray_address == "auto"


def test_ray_address_is_parsed_and_probed():
    assert split_address("auto") == ("auto", None)
    assert split_address("10.1.2.3:6379") == ("10.1.2.3", 6379)
    with pytest.raises(ValueError, match="cluster.ray_address = 'h:x'"):
        split_address("h:x")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"cluster.ray_address = '127.0.0.1:{port}': no Ray head answers"):
        check_reachable("127.0.0.1", port, timeout_s=2.0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        check_reachable("127.0.0.1", server.getsockname()[1], timeout_s=2.0)


class _Engines:
    infos = [{"index": 0, "url": "http://10.0.0.9:1", "server_pid": 1, "actor_pid": 1, "node": "10.0.0.9",
              "node_id": "n9"}]


class _Trainer:
    ready_infos = [{"rank": 0, "pid": 1, "node": "10.0.0.1", "node_id": "n1"}]


def test_processes_on_other_machines_are_listed_not_surveyed(tmp_path):
    """pid 1 exists here; on another machine it names another process, which the driver must not probe."""
    processes = RunProcesses(tmp_path, _Engines(), _Trainer(), None, tmp_path, node="10.0.0.1")
    states = {s.role: s for s in processes.survey()}
    assert states["trainer-0"].state != "unknown" and not states["trainer-0"].state.startswith("on node")
    assert states["engine-0"].state.startswith("on node 10.0.0.9") and states["engine-0"].exit is None
    assert processes.all_pids() == [("trainer-0", 1)]
    assert ProcessStatus("x", "x", 1, None, "").node is None


def test_processes_json_is_written_when_a_process_comes_or_goes(tmp_path):
    """Every guarded phase looks; processes.json is rewritten only when the listing changed (an engine
    restarted with a new pid), not at every phase of every step."""
    import asyncio
    import copy

    from verst.orchestration.watchdog import Watchdog

    engines = _Engines()
    engines.infos = copy.deepcopy(_Engines.infos)
    processes = RunProcesses(tmp_path, engines, _Trainer(), None, tmp_path, node="10.0.0.1")
    watchdog, listing = Watchdog(tmp_path, processes), tmp_path / "processes.json"
    writes = []
    original = processes.write
    processes.write = lambda listed: (writes.append(listed), original(listed))

    async def phases(n: int) -> None:
        for _ in range(n):
            assert await watchdog.guard("a phase", 5.0, "step_timeout_s", asyncio.sleep(0, result=1)) == 1

    asyncio.run(phases(3))
    assert len(writes) == 1 and json.loads(listing.read_text())[0]["pid"] == 1
    engines.infos[0]["server_pid"] = 2  # the engine was restarted
    asyncio.run(phases(2))
    assert len(writes) == 2
    assert [entry["pid"] for entry in json.loads(listing.read_text()) if entry["name"].startswith("engine 0 (")] == [2]


def test_the_distributed_transport_is_rooted_at_rank_0s_node_address(monkeypatch):
    """The engines join the weight-update group at trainer rank 0's Ray node address, not at loopback."""
    from verst.orchestration import trainer_actors

    opened = {}
    monkeypatch.setattr(trainer_actors.ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    monkeypatch.setattr(trainer_actors, "SyncerLoop", lambda sync, urls, options: opened.update(options))
    rank = SimpleNamespace(backend=object())
    trainer_actors.TrainerRank.open_weight_sync(rank, SyncConfig(), ["http://10.0.0.9:1"], {"timeout_s": 5.0})
    assert opened == {"master_address": "10.1.2.3", "timeout_s": 5.0}


def test_the_tensor_transport_is_refused_across_machines(monkeypatch):
    from verst.orchestration import cluster as orchestration

    a, b = node("a"), node("bb")
    monkeypatch.setattr(orchestration, "ray_nodes", lambda: [a, b])
    orch = Orchestration(ClusterConfig(num_engines=2))
    orch.placement = SimpleNamespace(nodes_of=lambda role: [a.node_id] if role == "trainer" else [a.node_id, b.node_id])
    with pytest.raises(ValueError, match=r"sync.transport = 'tensor' .* engine\(s\) \[1\] were placed on "
                                         r"\['10.0.0.2'\], not on trainer rank 0's 10.0.0.1; use a transport that "
                                         "crosses machines: 'distributed', 'disk'"):
        orch.check_transport("tensor")
    orch.check_transport("distributed")
    orch.placement = SimpleNamespace(nodes_of=lambda role: [a.node_id])  # one machine: shared memory works
    orch.check_transport("tensor")


def test_a_run_directory_for_ray_stays_within_the_unix_socket_path_limit(monkeypatch):
    """Ray's sockets live under the run's temporary directory; a long TMPDIR (a fresh machine's
    `TMPDIR=$(mktemp -d)`, or a run started from inside another run's directory) moves it to /tmp."""
    import tempfile

    from verst.orchestration.ray_session import _RAY_SOCKET_TAIL, socket_safe_temp_root

    for root, expected in (("/tmp/tmp.AbCdEfGhIj", "/tmp/tmp.AbCdEfGhIj"),
                           ("/tmp/tmp.AbCdEfGhIj/verst-abcdefgh", "/tmp"), ("/tmp/" + "d" * 60, "/tmp")):
        monkeypatch.setattr(tempfile, "tempdir", root)
        assert socket_safe_temp_root() == expected, root
        assert len(socket_safe_temp_root()) + len("/verst-xxxxxxxx") + _RAY_SOCKET_TAIL <= 107
