"""A real SGLang server behind verst: the engine contract suite against it, an NCCL weight broadcast into
it with the weight check, and one RL step of a run with `cluster.engine = "sglang"`, on SmolLM2-135M.

Needs a CUDA GPU and sglang installed (`pip install "sglang[all]"`), so it is skipped elsewhere; run with
`make test-gpu`. The server is started with SGLang's documented command line (`python -m
sglang.launch_server`) and driven through its documented HTTP API only.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
sglang = pytest.importorskip("sglang", reason="needs sglang installed")

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600.0
MEM_FRACTION = "0.3"  # leaves the GPU to the trainer of the same test


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def sglang_url(smollm2_dir, tmp_path_factory):
    """`python -m sglang.launch_server` on a free port, in float32 (the trainer's dtype, for the weight check)."""
    port = free_port()
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(smollm2_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--mem-fraction-static", MEM_FRACTION,
           "--weight-version", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"SGLang exited with {proc.returncode} at start-up:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang did not serve within {STARTUP_TIMEOUT_S:g}s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_engine_contract_suite_passes_against_sglang(sglang_url):
    """The same requests tests/contracts/test_engine_contract.py sends the embedded engine."""
    env = {**os.environ, "VERST_ENGINE_URL": sglang_url, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(REPO / "tests/contracts/test_engine_contract.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_nccl_weight_broadcast_into_sglang_passes_the_weight_check(sglang_url, smollm2_dir):
    from verst.config import ModelConfig, SyncConfig, TrainerConfig
    from verst.inference_client.fleet import EngineFleet
    from verst.sync import build_syncer
    from verst.trainer import FSDP2Backend

    trainer = FSDP2Backend(ModelConfig(path=str(smollm2_dir)), TrainerConfig(lr=1e-5), device="cuda")

    async def go():
        async with EngineFleet([sglang_url]) as fleet:
            syncer = build_syncer(SyncConfig(transport="distributed", check_weights=True), fleet,
                                  logprobs_fn=trainer.logprobs, device="cuda")
            try:
                metrics = await syncer.sync(list(trainer.named_weights(1 << 28)), 1)
            finally:
                await syncer.close()
            return metrics, await fleet.clients[sglang_url].get_weight_version()

    metrics, version = asyncio.run(go())
    assert metrics["sync/version"] == 1 and version == "1"
    assert metrics["sync/check_max_abs_diff"] < 5e-2  # SGLang's kernels against the trainer's, both float32


def test_one_rl_step_with_cluster_engine_sglang(smollm2_dir, addition_data_dir, tmp_path):
    """A run launches SGLang itself (cluster.engine = "sglang"), rolls out, trains one step and broadcasts
    the new weights over NCCL (sync.transport = "distributed" on CUDA)."""
    from verst.config import load_config
    from verst.orchestration import RaySession
    from verst.schedules import SCHEDULES

    cfg = load_config(None, [
        "--name", "gpu-sglang", "--run-dir", str(tmp_path / "run"), "--model.path", str(smollm2_dir),
        "--data.train-path", str(addition_data_dir / "train.jsonl"),
        "--data.test-path", str(addition_data_dir / "test.jsonl"), "--data.apply-chat-template", "false",
        "--cluster.engine", "sglang", "--cluster.device", "cuda", "--cluster.placement", "disaggregated",
        "--sglang.mem-fraction-static", MEM_FRACTION, "--sync.transport", "distributed",
        "--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "1",
        "--rollout.max-response-tokens", "8", "--trainer.lr", "1e-5", "--eval.max-prompts", "8",
        "--logging.tensorboard", "false", "--logging.progress", "false",
    ])
    with RaySession(slots=2, log_to_driver=False):
        summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    assert summary["train/steps"] == 1 and summary["eval/version_after"] == 1
    run_summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert run_summary["sync/transport"] == "distributed"
