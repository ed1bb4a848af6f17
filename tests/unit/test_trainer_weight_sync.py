"""The weight syncer as the driver sees it when trainer rank 0 runs the pushes (`TrainerWeightSync`), and
rank 0's bucket source that finishes its gathers when a push stops early (`DrainOnClose`)."""

import asyncio

import pytest

from verst.config import load_config
from verst.orchestration.rank_sync import DrainOnClose
from verst.orchestration.weight_sync import TrainerWeightSync


class Trainer:
    """Records the calls a TrainerActorGroup would send to its ranks."""

    def __init__(self):
        self.calls = []

    def open_weight_sync(self, sync, urls, **options):
        self.calls.append(("open", sync.check_weights, sync.transport, urls, options))

    def sync_weights(self, version, bucket_bytes, reconnect=False):
        self.calls.append(("sync", version, bucket_bytes))
        return {"sync/version": float(version)}

    def close_weight_sync(self):
        self.calls.append(("close",))


class Checker:
    def __init__(self):
        self.checked = []

    async def check(self, fleet, version):
        self.checked.append((fleet, version))
        return {"sync/check_max_abs_diff": 0.0}


def test_pushes_run_in_the_ranks_and_the_check_follows_the_first_one():
    cfg = load_config(None, ["--sync.check-weights", "true", "--sync.interval", "2", "--sync.transport", "disk",
                             "--sync.bucket-bytes", "65536"]).sync
    trainer, checker = Trainer(), Checker()
    syncer = TrainerWeightSync(trainer, cfg, ["http://e0"], checker=checker, fleet="fleet", snapshot_dir="/w")
    assert trainer.calls == []  # rank 0 builds its syncer at the first push: a starting trainer is not waited for
    assert syncer.version is None and [syncer.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]

    async def pushes():
        return [await syncer.sync(2), await syncer.sync(4), await syncer.close()]

    first, second, _ = asyncio.run(pushes())
    assert first == {"sync/version": 2.0, "sync/check_max_abs_diff": 0.0} and second == {"sync/version": 4.0}
    assert checker.checked == [("fleet", 2)] and syncer.version == 4
    # rank 0 never runs the check itself: it needs every rank's logprobs, asked for from the driver
    assert trainer.calls == [("open", False, "disk", ["http://e0"], {"snapshot_dir": "/w"}), ("sync", 2, 65536),
                             ("sync", 4, 65536), ("close",)]
    unused = Trainer()
    asyncio.run(TrainerWeightSync(unused, cfg, ["http://e0"]).close())
    assert unused.calls == []  # never opened, nothing to close


def test_a_checker_needs_the_fleet_it_probes():
    cfg = load_config(None, []).sync
    with pytest.raises(ValueError, match="fleet"):
        TrainerWeightSync(Trainer(), cfg, ["http://e0"], checker=Checker())


def test_closing_rank_zeros_source_early_finishes_its_gathers():
    gathered = []

    def named_weights():  # each step stands for a collective gather every rank takes part in
        for i in range(5):
            gathered.append(i)
            yield [(f"w{i}", None)]

    source = DrainOnClose(named_weights())
    assert next(iter(source)) == [("w0", None)]
    source.close()  # a push that failed after its first bucket
    assert gathered == [0, 1, 2, 3, 4]
    source.close()  # and again, as the rank does after every push: nothing left
    assert gathered == [0, 1, 2, 3, 4]
