"""`make` is quiet by default (a line per step, a step's output only when it fails) and verbose with V=1;
run against a stand-in Python whose "pip" prints and exits as told, in a virtual environment of its own."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Run from `make test`, the outer make's settings (V=1 among them) would reach this one through the environment.
OUTER_MAKE = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "V")
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def run_make(tmp_path: Path, *args: str, pip_status: int = 0) -> subprocess.CompletedProcess:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "pip output of: $*"\necho "more pip output"\nexit {pip_status}\n')
    python.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in OUTER_MAKE}
    return subprocess.run(["make", "--no-print-directory", "install", f"VENV={tmp_path / 'venv'}",
                           f"STEP_LOG={tmp_path / 'step.log'}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_make_prints_a_line_per_step_by_default(tmp_path):
    result = run_make(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    venv = tmp_path / "venv"
    assert result.stdout.splitlines() == [
        f"make: creating {venv}", f"make: upgrading pip in {venv}", "make: installing torch==2.13.0 (the CPU build)",
        "make: installing verst [dev,verifiers,strands,openenv,sandbox,daytona,e2b,modal,diffusion] with constraints.txt"]
    assert "pip output of: -m pip install -c constraints.txt -e" in (tmp_path / "step.log").read_text()


def test_make_v1_prints_every_command_and_its_output(tmp_path):
    result = run_make(tmp_path, "V=1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{tmp_path / 'venv' / 'bin' / 'python'} -m pip install torch==2.13.0" in result.stdout.splitlines()
    assert "pip output of: -m pip install torch==2.13.0" in result.stdout
    assert "make: " not in result.stdout


def test_a_failed_step_shows_its_output_and_exit_status(tmp_path):
    result = run_make(tmp_path, pip_status=3)
    assert result.returncode != 0
    assert result.stdout.splitlines()[-3:] == [
        "pip output of: -m pip install --upgrade pip", "more pip output",
        f"make: upgrading pip in {tmp_path / 'venv'} failed (exit status 3); its output is above and in "
        f"{tmp_path / 'step.log'}; make V=1 runs it verbosely"]
