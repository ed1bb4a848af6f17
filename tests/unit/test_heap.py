"""`verst.monitor.heap`: a process verst owns freezes its start-up heap and collects young objects less often;
any other process (this test runner) is left as it was. Each case runs in a fresh interpreter."""

import gc
import importlib.metadata
import json
import subprocess
import sys

from verst.monitor.heap import THRESHOLDS

STATE = "import gc, json; print(json.dumps([frozen, gc.get_freeze_count(), list(gc.get_threshold())]))"


def settled(code: str) -> tuple[int, int, list[int]]:
    out = subprocess.run([sys.executable, "-c", f"from verst.monitor.heap import *; {code}; {STATE}"],
                         capture_output=True, text=True, timeout=60, check=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_process_verst_does_not_own_is_left_alone():
    frozen, count, thresholds = settled("frozen = settle_heap()")
    assert (frozen, count) == (0, 0) and thresholds == list(gc.get_threshold())


def test_a_process_of_its_own_freezes_what_is_alive_and_still_collects_new_cycles():
    code = ("own_heap(); frozen = settle_heap(); "
            "cycle = []; cycle.append(cycle); del cycle; collected = gc.collect(); assert collected >= 1, collected")
    frozen, count, thresholds = settled(code)
    assert frozen == count > 1000 and thresholds == list(THRESHOLDS)
    frozen, count, thresholds = settled("frozen = settle_heap(owned=True)")
    assert frozen == count > 1000 and thresholds == list(THRESHOLDS)


def test_the_verst_command_owns_its_process():
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "verst"]
    assert script.value == "verst.cli.main:run"
    frozen, count, _ = settled("import verst.cli.main as m; m.main = lambda: 0; m.run(); frozen = settle_heap()")
    assert frozen == count > 1000


def test_an_engine_server_settles_its_heap_before_it_serves(tiny_model_dir):
    # the server's own `main`, with uvicorn's serving loop replaced by a return
    code = ("import gc, uvicorn; uvicorn.Server.run = lambda self, sockets=None: None; import verst.engine.server as s; "
            f"s.main(['--model', {str(tiny_model_dir)!r}, '--port', '0']); frozen = gc.get_freeze_count()")
    frozen, count, thresholds = settled(code)
    assert frozen == count > 10_000 and thresholds == list(THRESHOLDS)
