"""Layer 2: evaluation — greedy held-out accuracy over any generation backend."""

from verst.eval.engine import engine_greedy_generate
from verst.eval.greedy import GenerateFn, evaluate_greedy, hf_greedy_generate
from verst.eval.skip import EvalSkip, MixedVersionError

__all__ = ["EvalSkip", "GenerateFn", "MixedVersionError", "engine_greedy_generate", "evaluate_greedy", "hf_greedy_generate"]
