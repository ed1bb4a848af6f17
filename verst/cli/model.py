"""`verst model init`: make a seeded tiny or small model locally (no hub, no network).

torch and transformers are imported only when a model is made, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

# Both modules import torch and transformers inside their functions, not at import time.
from verst.models.factory import ARCHS, SIZES, count_parameters, init_model
from verst.models.loader import load_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verst model", description="Make models locally.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{init}")
    init = commands.add_parser(
        "init",
        help="write a randomly initialised HF checkpoint (config, safetensors, tokenizer, chat template)",
        description="Write a seeded, randomly initialised Hugging Face checkpoint with the byte-level "
        "tokenizer and the tiny chat template. tiny is ~0.5M parameters, small ~4M.",
    )
    init.add_argument("--arch", required=True, choices=ARCHS, help="model family")
    init.add_argument("--size", required=True, choices=SIZES, help="tiny (~0.5M parameters) or small (~4M)")
    init.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    init.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default: 0)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = init_model(args.arch, args.size, args.out, seed=args.seed)
    except FileExistsError as error:
        print(f"verst model init: {error}", file=sys.stderr)
        return 1
    # Counted on the reloaded checkpoint, which also proves the folder loads.
    n_params = count_parameters(load_model(out))
    print(f"{out}  ({args.arch} {args.size}, {n_params:,} parameters, seed {args.seed})")
    return 0
