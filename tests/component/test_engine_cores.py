"""The embedded engine takes its share of the cores: at launch (`--cpu-cores`, `--torch-threads`) and mid-run
(`POST /set_cores`), every thread of the server pinned to the share's cores; a core it cannot run on is refused
by field, and generation goes on."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from verst.engine.process import EngineProcess
from verst.inference_client.client import EngineClient, EngineError
from verst.types.cores import usable_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")


def thread_masks(pid: int) -> set[tuple[int, ...]]:
    """The CPU affinity of every thread of process `pid`."""
    masks = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(int(task.name)))))
        except ProcessLookupError:
            continue
    return masks


def test_engine_takes_its_cores_at_launch_and_mid_run(tiny_model_dir):
    cores = usable_cores()
    first = cores[0]
    with EngineProcess(tiny_model_dir, args=["--torch-threads", "1", "--cpu-cores", str(first)]) as engine:

        async def main():
            async with EngineClient(engine.url) as client:
                launched = await client.get_server_info()
                masks_launched = thread_masks(engine.proc.pid)
                reply = await client.set_cores(list(cores), 2)
                moved = await client.get_server_info()
                masks_moved = thread_masks(engine.proc.pid)
                out = await client.generate([5, 6, 7], {"max_new_tokens": 4, "temperature": 0.0})
                with pytest.raises(EngineError) as far:
                    await client.set_cores([cores[0], 100_000], 1)
                with pytest.raises(EngineError) as none:
                    await client.set_cores(list(cores), 0)
                return launched, masks_launched, reply, moved, masks_moved, out, far.value, none.value

        launched, masks_launched, reply, moved, masks_moved, out, far, none = asyncio.run(main())
    assert launched["torch_threads"] == 1 and launched["cpu_cores"] == [first]
    assert masks_launched == {(first,)}
    assert reply == {"success": True, "cores": list(cores), "threads": 2}
    assert moved["torch_threads"] == 2 and moved["cpu_cores"] == list(cores)
    assert masks_moved == {tuple(cores)}
    assert len(out.output_ids) == 4
    assert far.status == 400 and "cores" in str(far) and "100000" in str(far) and "this machine has CPUs 0-" in str(far)
    assert none.status in (400, 422) and "threads" in str(none)
