"""What a simulated engine samples: for each request a length and the token ids and logprobs, drawn from its
seed alone, so that a run replays exactly. The seed is the request's `sampling_seed`, else a hash of its
prompt ids; ids and logprobs are windows of fixed pools (no per-token random draws on the hot path).
"""

from __future__ import annotations

import array
import math
import random
import zlib
from typing import Any

POOL = 1 << 16  # tokens in each pool; a response is a window of it


# Token ids of lowercase ASCII in a byte-level tokenizer: no special token (an end of turn, a tool call) among
# them, whatever the tokenizer; in a larger vocabulary they are ordinary tokens.
TOKEN_IDS = (97, 123)


class OutputModel:
    """Lengths are lognormal around `mean_tokens` (log-space spread `sigma`), capped by the request's
    `max_new_tokens` (a capped one finishes with "length", the others with "stop"). Token ids are drawn from
    [`low`, `high`)."""

    def __init__(self, mean_tokens: float, sigma: float = 0.5, low: int = TOKEN_IDS[0], high: int = TOKEN_IDS[1],
                 seed: int = 0):
        if high <= low:
            raise ValueError(f"sim outputs: token ids [{low}, {high}) are empty")
        if mean_tokens < 1:
            raise ValueError(f"sim.response_tokens_mean must be >= 1, got {mean_tokens}")
        draw = random.Random(f"verst.sim.outputs/{seed}")
        self.ids = [draw.randrange(low, high) for _ in range(POOL)]
        self.logprobs = [-draw.expovariate(2.0) for _ in range(POOL)]
        self.mean_tokens, self.sigma = mean_tokens, sigma

    @staticmethod
    def seed_of(input_ids: list[int], params: dict[str, Any]) -> int:
        seed = params.get("sampling_seed")
        if isinstance(seed, int):
            return seed
        tail = input_ids[-64:]  # the tail tells turns of one session apart; the length the rest
        return zlib.crc32(array.array("q", tail).tobytes()) ^ len(input_ids)

    def length(self, seed: int, max_new: int) -> tuple[int, str]:
        """(tokens, finish reason) of the request with this seed."""
        z = random.Random(seed).gauss(0.0, 1.0)
        n = max(1, round(self.mean_tokens * math.exp(self.sigma * z - self.sigma**2 / 2)))
        return (max_new, "length") if n >= max_new else (n, "stop")

    def sample(self, seed: int, n: int) -> tuple[list[int], list[float]]:
        """The `n` token ids and logprobs of the request with this seed."""
        n = min(n, POOL)
        start = seed % (POOL - n + 1)
        return self.ids[start:start + n], self.logprobs[start:start + n]
