"""An `eval.backend` that scores the snapshot with verst's embedded engine in a process of its own:
`verst serve engine` on a free port of 127.0.0.1, the run's held-out prompts, then the engine stops.

    verst train recipes/grpo_addition.toml --eval.backend examples.eval_backend.engine:score

The engine serves the snapshot as weight version `step` and every reply must carry it, so the score is
tied to the weights it measured. The rollout engines are not touched: training goes on meanwhile.
"""

from __future__ import annotations

import contextlib

from verst.config import VerstConfig
from verst.eval import EvalSkip
from verst.eval.local import held_out_prompts, score_url, serve_snapshot
from verst.models import load_tokenizer


def score(snapshot_dir: str, step: int, config: VerstConfig) -> dict[str, float]:
    """`eval/accuracy` (or `eval/success` for an agent task) of the snapshot, with the usual `eval/` keys."""
    prompts, tokenizer = held_out_prompts(config), load_tokenizer(snapshot_dir)
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(serve_snapshot(snapshot_dir, step, device=config.cluster.device,
                                                     model_impl=config.model.impl))
        except (RuntimeError, TimeoutError) as error:  # no engine, no score; training goes on
            raise EvalSkip("unhealthy", f"the evaluation engine for {snapshot_dir} did not start: {error}") from error
        return score_url(config, url, tokenizer, prompts, step)
