"""bench/_cpu.py's window over its samples: the CPU each role spent between two instants, a process that
started inside the window counted from zero, and how busy that kept the cores."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # _cpu imports _memory as the benches do

from _cpu import CpuMeter  # noqa: E402


def test_a_window_counts_each_role_between_its_samples():
    meter = CpuMeter(cores=2)
    meter._samples = [  # (Unix time, pid -> (role, CPU seconds so far))
        (10.0, {1: ("driver", 1.0), 2: ("trainer rank", 5.0)}),
        (11.0, {1: ("driver", 1.2), 2: ("trainer rank", 5.8), 3: ("other: ray::IDLE", 0.1)}),
        (12.0, {1: ("driver", 1.4), 2: ("trainer rank", 6.6), 3: ("engine server", 0.9)}),
        (13.0, {1: ("driver", 9.0), 2: ("trainer rank", 9.0), 3: ("engine server", 5.0)}),
    ]
    window = meter.between(10.0, 12.0)
    assert window.seconds == 2.0
    assert window.by_role == pytest.approx({"driver": 0.4, "trainer rank": 1.6, "engine server": 0.9})
    assert window.busy == pytest.approx(2.9 / 4)
    assert window.line(2) == "cores busy 72%; CPU ms a step: trainer rank 800, engine server 450, driver 200"
    with pytest.raises(ValueError, match="no samples"):
        CpuMeter(cores=2).between(0.0, 1.0)
