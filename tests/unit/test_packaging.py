"""The package's metadata builds without a deprecation warning from setuptools (which `pip install` would
print on every install) and states the license as an SPDX expression."""

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_METADATA = "import sys; from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"


def test_metadata_builds_without_warnings_and_names_the_license(tmp_path):
    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip(f"setuptools {version('setuptools')} here; pyproject.toml's build needs >= 77")
    result = subprocess.run([sys.executable, "-W", "default", "-c", BUILD_METADATA, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "warning" not in output.lower(), output
    metadata = (tmp_path / result.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
