"""`verst diffusion init | pretrain | classifier | prompts | serve`: the shapes denoiser, its reward and prompts, made
locally, and the diffusion engine.

- init: a seeded class-conditioned UNet2DModel in diffusers' format.
- pretrain: flow matching on the procedural coloured-shapes dataset; saved in diffusers' format.
- classifier: the shapes classifier the alignment reward uses.
- prompts: the prompt files of an RL run on the shapes: `verst train recipes/flow_grpo_shapes.toml` then trains
  the denoiser with Flow-GRPO (docs/diffusion.md).
- serve: the diffusion engine over HTTP (`verst diffusion serve --model DIR --port P`; see docs/diffusion.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verst diffusion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="a seeded denoiser in diffusers' format")
    pre = commands.add_parser("pretrain", help="flow-matching pretraining on the shapes dataset")
    for p in (init, pre):
        p.add_argument("--out", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--widths", default="32,64", help="the UNet's block widths (default: %(default)s)")
    pre.add_argument("--steps", type=int, default=700)
    pre.add_argument("--n-images", type=int, default=4500)
    clf = commands.add_parser("classifier", help="train the shapes classifier")
    clf.add_argument("--out", required=True)
    clf.add_argument("--steps", type=int, default=1000)
    prompts = commands.add_parser("prompts", help="the RL run's prompt files (train.jsonl, test.jsonl)")
    prompts.add_argument("--out", required=True)
    prompts.add_argument("--repeat", type=int, default=8, help="each class's lines in train.jsonl")
    # its flags are the server's own (verst.engine.diffusion_server.build_parser); main hands them over
    commands.add_parser("serve", help="serve a denoiser over HTTP (--model DIR --port P; serve --help)", add_help=False)
    return parser


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        from verst.engine.diffusion_server import main as serve

        return serve(argv[1:], prog="verst diffusion serve")
    args = build_parser().parse_args(argv)
    import torch

    from verst.data import shapes
    from verst.models import diffusion
    from verst.rewards.image import ShapeClassifier

    torch.manual_seed(0)
    if args.command in ("init", "pretrain"):
        widths = tuple(int(w) for w in args.widths.split(","))
        model = diffusion.init_denoiser(shapes.N_CLASSES, widths=widths, seed=args.seed)
        if args.command == "pretrain":
            images, labels = (torch.tensor(a) for a in shapes.dataset(args.n_images, seed=args.seed))
            start = time.time()
            losses = diffusion.pretrain(model, images, labels, steps=args.steps, seed=args.seed)
            print(f"pretrained {args.steps} steps in {time.time() - start:.0f}s, final loss "
                  f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
        diffusion.save(model, args.out)
        print(args.out)
        return 0
    if args.command == "prompts":
        for path in shapes.write_prompts(args.out, args.repeat):
            print(path)
        return 0
    if args.command == "classifier":
        images, labels = (torch.tensor(a) for a in shapes.dataset(1800, seed=1))
        classifier = ShapeClassifier(shapes.N_CLASSES)
        classifier.fit(images, labels, steps=args.steps)
        held, held_labels = (torch.tensor(a) for a in shapes.dataset(450, seed=2))
        print(f"classifier held-out accuracy {classifier.accuracy(held, held_labels):.3f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        classifier.save(args.out)
    return 0
