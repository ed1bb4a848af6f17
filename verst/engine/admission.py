"""Which waiting requests get a KV slot at the next step, and which running ones give theirs up to a more
urgent request: the engine core's scheduling decisions, apart from the slot and KV bookkeeping that carries
them out.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from verst.engine.config import EngineConfig
from verst.engine.finishing import namespace
from verst.engine.prefix_cache import PrefixCache
from verst.engine.request import Request


@dataclasses.dataclass
class Admission:
    """`fed`: (request, tokens to feed) rows to prefill, in slot order; `hits`: each fed row's prefix-cache
    (entry, tokens reused); `followers`: (request, leader) pairs, a request whose tokens equal an admitted
    row's, which takes a copy of its KV and logits instead of a row of its own."""

    fed: list[tuple[Request, list[int]]] = dataclasses.field(default_factory=list)
    hits: list[tuple[Any, int]] = dataclasses.field(default_factory=list)
    followers: list[tuple[Request, Request]] = dataclasses.field(default_factory=list)


def plan_admission(waiting: collections.deque[Request], running: list[Request], config: EngineConfig,
                   prefix_cache: PrefixCache) -> Admission:
    """Take waiting requests (popped from `waiting`, in order) into the free slots within the prefill budget
    (`config.max_prefill_tokens` over the longest row). The n samples of one prompt, which arrive together,
    prefill it once: the first leads, the others follow. A batch with free slots waits for
    `config.min_prefill_batch` requests unless one is more urgent than every running request."""
    plan = Admission()
    free = config.max_running_requests - len(running)
    urgent = waiting and running and waiting[0].priority > min(r.priority for r in running)
    if running and not urgent and free < min(len(waiting), config.min_prefill_batch):
        return plan
    leaders: dict[tuple[tuple[int, ...], Any], Request] = {}
    longest = 0
    while waiting and len(running) + len(plan.fed) + len(plan.followers) < config.max_running_requests:
        req = waiting[0]
        tokens = req.tokens()
        key = (tuple(tokens), req.lora)  # a follower shares its leader's KV: the same adapter too
        leader = leaders.get(key)
        if leader is not None:
            waiting.popleft()
            plan.followers.append((req, leader))
            continue
        entry, hit = prefix_cache.match(tokens, namespace(req))
        hit = min(hit, len(tokens) - 1)  # the last token is always fed: its logits pick the next one
        pending = tokens[hit:]
        longest_if_added = max(longest, len(pending))
        if plan.fed and (len(plan.fed) + 1) * longest_if_added > config.max_prefill_tokens:
            break
        waiting.popleft()
        leaders[key] = req
        longest = longest_if_added
        plan.fed.append((req, pending))
        plan.hits.append((entry, hit))
    return plan


def preemption_victims(waiting: collections.deque[Request], running: list[Request],
                       max_running: int) -> list[Request]:
    """Running requests of a lower priority than the first waiting one, as many as its priority's waiting
    requests lack free slots: the most recently admitted of the lowest priority first."""
    if not (waiting and running):
        return []
    top = waiting[0].priority
    lower = [r for r in running if r.priority < top]
    if not lower:  # the common case (one priority): no scan of the waiting queue
        return []
    urgent = sum(1 for r in waiting if r.priority == top)
    need = urgent - (max_running - len(running))
    return sorted(lower, key=lambda r: (r.priority, -r.slot))[: max(need, 0)]
