"""Launches a real SGLang server (`python -m sglang.launch_server`) with verst's settings and the
pass-through flags, on a free port it reports through `--port-file`, as `EngineProcess` expects.

SGLang speaks the dialect verst's client, router and syncer speak, so nothing sits in between: this
process becomes the server (exec).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

from verst.monitor.logs import configure_logging

log = logging.getLogger(__name__)


def sglang_command(python: str, model: str, host: str, port: int, dtype: str, version: str, device: str,
                   flags: list[str], routed_experts: bool = False) -> list[str]:
    """SGLang's command line: verst's flags, then the pass-through ones, unchanged. `routed_experts`: replies
    carry the experts each token was routed to (routing replay)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port),
           "--dtype", dtype, "--weight-version", str(version)]
    if device != "auto":
        cmd += ["--device", device]
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    return [*cmd, *flags]


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="start SGLang's server for verst")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", default=None)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine-python", default=sys.executable, help="the Python with sglang installed")
    p.add_argument("--engine-flags", default="[]", help="SGLang's own flags, a JSON list, passed unchanged")
    p.add_argument("--return-routed-experts", action="store_true",
                   help="routing replay: SGLang returns the routed experts (--enable-return-routed-experts)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    port = args.port or free_port(args.host)
    cmd = sglang_command(args.engine_python, args.model, args.host, port, args.dtype, args.weight_version,
                         args.device, json.loads(args.engine_flags), args.return_routed_experts)
    if args.port_file:  # the caller then polls /health until SGLang serves
        Path(f"{args.port_file}.tmp").write_text(str(port))
        os.replace(f"{args.port_file}.tmp", args.port_file)
    configure_logging()
    log.info("starting %s", " ".join(cmd))
    os.execv(shutil.which(cmd[0]) or cmd[0], cmd)  # a bare name (python3) is looked up on PATH
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
