"""The README's "Your own model and data" example runs as written: a model made locally, a JSONL task,
and `verst train` on them, ending with a report and an exported model."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def own_data_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own model and data", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_readme_own_model_and_data_example_runs(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", own_data_block()], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the run and everything it started
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    run = tmp_path / "runs" / "my-run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train/steps"] == 3 and (run / "report.html").exists()
