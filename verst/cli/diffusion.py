"""`verst diffusion init | pretrain | classifier | rl | serve`: the shapes denoiser made, pretrained and RL-trained locally.

- init: a seeded class-conditioned UNet2DModel in diffusers' format.
- pretrain: flow matching on the procedural coloured-shapes dataset; saved in diffusers' format.
- classifier: the shapes classifier the alignment reward uses.
- prompts: the prompt files of an RL run on the shapes (`verst train` with model.kind = "diffusion").
- rl: Flow-GRPO steps with a reward (alignment, jpeg, or module:function); prints the held-out mean reward
  and classifier accuracy before and after, and writes the held-out samples before and after as image grids.
- serve: the diffusion engine over HTTP (`verst diffusion serve --model DIR --port P`; see docs/diffusion.md).
"""

from __future__ import annotations

import argparse
import json
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
    rl = commands.add_parser("rl", help="Flow-GRPO on a pretrained denoiser")
    rl.add_argument("--base", required=True, help="the denoiser (diffusers' format)")
    rl.add_argument("--classifier", required=True)
    rl.add_argument("--out", required=True)
    rl.add_argument("--reward", default="alignment", help="alignment, jpeg, or module:function")
    rl.add_argument("--rl-steps", type=int, default=120)
    rl.add_argument("--prompts-per-step", type=int, default=9,
                    help="classes per step, taken in turn so that every class gets as many groups")
    rl.add_argument("--group-size", type=int, default=8)
    rl.add_argument("--sample-steps", type=int, default=10)
    rl.add_argument("--lr", type=float, default=1e-4)
    rl.add_argument("--kl-coef", type=float, default=0.0)
    rl.add_argument("--noise-level", type=float, default=0.7, help="the SDE sampler's a (default: %(default)s)")
    rl.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance while training")
    rl.add_argument("--eval-images", type=int, default=16, help="held-out images per class per evaluation")
    # its flags are the server's own (verst.engine.diffusion_server.build_parser); main hands them over
    commands.add_parser("serve", help="serve a denoiser over HTTP (--model DIR --port P; serve --help)", add_help=False)
    return parser


def _reward(spec: str, classifier):
    from verst.rewards.image import jpeg_compressibility, load_image_reward

    if spec == "alignment":
        return classifier.alignment
    if spec == "jpeg":
        return lambda images, labels: jpeg_compressibility(images)
    return load_image_reward(spec)


HELD_OUT_SEED = 12345  # the training steps sample with seeds 1..rl_steps


def evaluate(model, classifier, reward, per_class: int, grid: Path, seed: int = HELD_OUT_SEED) -> dict[str, float]:
    """Held-out seeds (never used in training) for every class -> mean reward and classifier accuracy; the
    samples are written to `grid`, one column per class."""
    import torch

    from verst.data.shapes import N_CLASSES
    from verst.models import diffusion

    labels = torch.arange(N_CLASSES).repeat(per_class)
    images = diffusion.sample(model, labels, seed=seed, steps=10).images
    save_grid(images, grid, columns=N_CLASSES)
    return {"reward": reward(images, labels).float().mean().item(), "accuracy": classifier.accuracy(images, labels)}


def save_grid(images, path: Path, columns: int, scale: int = 4) -> None:
    """Images (N, 3, H, W) in [-1, 1], row by row, as one PNG enlarged `scale` times."""
    from verst.monitor import image_grid

    image_grid.save_grid(image_grid.to_pixels(images.detach().cpu().numpy()), path, columns, scale)


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
    return rl(args)


def rl(args: argparse.Namespace) -> int:
    import torch

    from verst.data.shapes import N_CLASSES
    from verst.models import diffusion
    from verst.rewards.image import ShapeClassifier
    from verst.trainer.diffusion import FlowGRPOSettings, flow_grpo_step

    if args.rl_steps >= HELD_OUT_SEED:
        raise ValueError(f"--rl-steps {args.rl_steps}: the training seeds 1..{args.rl_steps} would reach the "
                         f"held-out seed {HELD_OUT_SEED}")
    model = diffusion.load(args.base)
    reference = diffusion.load(args.base) if args.kl_coef > 0 else None
    classifier = ShapeClassifier.load(args.classifier)
    reward = _reward(args.reward, classifier)
    settings = FlowGRPOSettings(group_size=args.group_size, steps=args.sample_steps, lr=args.lr,
                                kl_coef=args.kl_coef, noise_level=args.noise_level, guidance=args.guidance)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = evaluate(model, classifier, reward, args.eval_images, out / "samples_before.png")
    print(f"before: held-out mean reward {before['reward']:.4f}, classifier accuracy {before['accuracy']:.3f}")
    start = time.time()
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(1, args.rl_steps + 1):
            first = (step - 1) * args.prompts_per_step
            labels = torch.arange(first, first + args.prompts_per_step) % N_CLASSES
            metrics = flow_grpo_step(model, optimizer, labels, reward, settings, seed=step, reference=reference)
            metrics["step"] = step
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            print(f"step {step}: reward {metrics['rollout/reward_mean']:.4f} ({time.time() - start:.0f}s)")
    print(f"rl: {args.rl_steps} steps in {time.time() - start:.0f}s")
    after = evaluate(model, classifier, reward, args.eval_images, out / "samples_after.png")
    print(f"after: held-out mean reward {after['reward']:.4f}, classifier accuracy {after['accuracy']:.3f}")
    print(f"held-out samples (a column per class, {args.eval_images} rows): {out / 'samples_before.png'} "
          f"and {out / 'samples_after.png'}")
    diffusion.save(model, out / "denoiser")
    (out / "result.json").write_text(json.dumps({"before": before, "after": after}))
    return 0
