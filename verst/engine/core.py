"""The engine core: a continuous-batching scheduler over one model, driven one `step()` at a time.

Requests join between decode steps and leave as soon as they finish; a prefix cache lets a prompt that
extends an earlier sequence reuse its KV. Also abort, pause (abort / retract / in place), weight loading
with a version string, LoRA adapters loaded by name and applied per request, and cache flushing. Single-threaded and socket-free: `runner.py` drives it.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from verst.engine.admission import plan_admission, preemption_victims
from verst.engine.config import EngineConfig
from verst.engine.finishing import (
    check_true_on_policy,
    eos_ids,
    final_text,
    finish_reason,
    namespace,
    row_adapters,
    row_sampling,
)
from verst.engine.lora import LoraAdapter, LoraRegistry, build_adapter, read_adapter
from verst.engine.memory import device_memory_bytes
from verst.engine.model_runner import ModelRunner
from verst.engine.prefix_cache import PrefixCache
from verst.engine.request import FinishReason, Phase, Request, check_request
from verst.engine.sampling import sample
from verst.engine.weights import check_weight_names, copy_weights
from verst.inference_client.protocol import WEIGHT_UPDATE_ABORT, InvalidRequest, is_sample_of
from verst.models.scoring import sequence_logprobs

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")
_NO_LORA = ("the engine runs true on-policy, whose scoring pass is the base model's forward; LoRA adapters are "
            "not served in this mode")


class EngineCore:
    """Owns the model, the KV slots, the prefix cache and the request queues. Not thread-safe: one caller.

    Life of a request: `add_request` queues it; a `step()` admits it into a slot (prefix KV copied in),
    prefills what is not cached and samples its first token; later steps decode one token each until a
    stop condition; then its KV is offered to the prefix cache and `on_finish` is called.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None, weight_version: str = "0"):
        self.config = config or EngineConfig()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, impl=self.config.model_impl)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.context_length = self.config.context_length or getattr(self.runner.config, "max_position_embeddings", None)
        if not self.context_length:
            raise ValueError("the model config has no max_position_embeddings; set EngineConfig.context_length")
        self.eos_ids = eos_ids(model, tokenizer)
        self.prefix_cache = PrefixCache(self.config.prefix_cache_tokens)
        self.loras = LoraRegistry(self.config.max_loaded_loras)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # running[i].slot == i
        self.requests: dict[str, Request] = {}
        self.paused = False
        self.released: set[str] = set()  # memory tags given back to a colocated trainer (`memory.py`)
        self.weight_version = weight_version
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.counters = collections.Counter()
        if self.config.true_on_policy:
            check_true_on_policy(self.model)

    # ---- requests ------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Refuse a request the engine cannot serve, naming the field and value (no engine state used)."""
        check_request(req, self.vocab_size, self.context_length, has_tokenizer=self.tokenizer is not None)

    def add_request(self, req: Request) -> None:
        self._check_resident("a request")
        self.validate(req)
        if req.rid in self.requests:
            raise InvalidRequest("rid", req.rid, "a request with this rid is still in flight")
        if (req.lora is not None or req.lora_path is not None) and self.config.true_on_policy:
            raise InvalidRequest("lora_path", req.lora_path, _NO_LORA)
        if req.lora is None:  # the HTTP layer resolves the name already; direct callers may give it alone
            req.lora = self.loras.get(req.lora_path)
        if req.logprob_start_len >= 0:
            # one whole-sequence forward of its own: scoring (max_new_tokens = 0) needs no KV slot
            temperature = req.sampling.temperature or 1.0  # greedy: the raw distribution, as output logprobs
            req.input_logprobs = self.runner.prompt_logprobs(req.prompt_ids, req.logprob_start_len, temperature)
            req.weight_version = self.weight_version
        if req.sampling.max_new_tokens == 0:
            req.cached_tokens = 0
            req.finish = FinishReason("length", length=0)
            self._complete(req)
            return
        self.requests[req.rid] = req
        self._enqueue(req)

    def _enqueue(self, req: Request, first_of_its_priority: bool = False) -> None:
        """Behind every waiting request of the same or a higher priority (FIFO within a priority), or
        with `first_of_its_priority` behind the higher ones only (a preempted request resuming)."""
        rank = req.priority + 0.5 if first_of_its_priority else req.priority  # priorities are integers
        if not self.waiting or self.waiting[-1].priority >= rank:
            self.waiting.append(req)
            return
        at = next(i for i, other in enumerate(self.waiting) if other.priority < rank)
        self.waiting.insert(at, req)

    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.running)

    def step(self) -> int:
        """One scheduling round: decode every running request, then admit and prefill waiting ones.

        Returns the number of tokens generated.
        """
        if self.paused:
            return 0
        produced = 0
        with torch.no_grad():
            if self.running:
                produced += self._decode()
            self._release_finished()
            self._preempt_for_priority()
            fed, followers = self._admit()
            if fed:
                produced += self._prefill(fed, followers)
            self._release_finished()
        self.counters["steps"] += 1
        self.counters["generated_tokens"] += produced
        return produced

    def abort(self, rid: str, message: str = "aborted by request") -> int:
        """End request `rid`, or every sample of a request that asked for `sampling_params.n` > 1 (`{rid}_{i}`);
        the number ended."""
        req = self.requests.get(rid)
        samples = [req] if req is not None else [r for key, r in self.requests.items() if is_sample_of(key, rid)]
        if samples:
            self._abort(samples, message)
        return len(samples)

    def abort_all(self, message: str = "aborted by request") -> int:
        reqs = list(self.waiting) + list(self.running)
        self._abort(reqs, message)
        return len(reqs)

    def reset(self, message: str) -> None:
        """Last resort after a failure: end every request as aborted without touching the KV storage."""
        stuck = list(self.waiting) + list(self.running)
        self.waiting, self.running = collections.deque(), []
        self.runner.cache.clear()
        self.prefix_cache.flush()
        for req in stuck:
            req.finish = FinishReason("abort", message=message)
            self._complete(req)

    def pause(self, mode: str) -> int:
        """Stop scheduling. abort: in-flight requests end as aborted; retract: they go back to the queue
        (their KV kept only in the prefix cache) and are recomputed; in_place: they keep their KV."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest("mode", mode, f"choices: {', '.join(PAUSE_MODES)}")
        affected = len(self.running) + len(self.waiting)
        with torch.no_grad():
            if mode == "abort":
                self.abort_all(message=WEIGHT_UPDATE_ABORT)
            elif mode == "retract":
                self._retract_all()
        self.paused = True
        return affected

    def resume(self) -> None:
        self.paused = False

    def flush_cache(self) -> None:
        self.prefix_cache.flush()
        if not self.running:
            self.runner.cache.clear()

    def check_weights(self, named_shapes: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
        """Every name must be a weight of the model with the same shape; returns the model's tensors."""
        return check_weight_names(self.model, named_shapes)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: str | None, flush: bool = True,
                     shapes: list[tuple[str, Any]] | None = None) -> int:
        """Copy tensors into the model by name, all validated first; set the version; flush the cache.
        With `shapes` (every name and shape `named` will yield), `named` may be lazy: it is read once, each
        tensor copied as it comes (a checkpoint read a file at a time)."""
        self._check_resident("a weight load", ("weights",))
        count = copy_weights(self.model, named, shapes)
        if version is not None:
            self.weight_version = version
        if flush:
            self.prefix_cache.flush()
        self.counters["weight_updates"] += 1
        return count

    def _check_resident(self, what: str, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        released = sorted(self.released.intersection(tags))
        if released:
            raise InvalidRequest("tags", released, f"{what} needs the engine's memory, released by "
                                 "/release_memory_occupation; /resume_memory_occupation first")

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter directory without registering it (any thread: the model is only read)."""
        self.loras.check_room(name)
        return read_adapter(path, name, self.model, self.loras.next_version())

    def build_lora(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> LoraAdapter:
        """An adapter from pushed tensors (PEFT's names) and its adapter_config, checked like a directory's."""
        self.loras.check_room(name)
        return build_adapter(config, tensors, name, self.model, self.loras.next_version(), "(pushed tensors)",
                             field="lora_name")

    def add_lora(self, adapter: LoraAdapter, update_in_flight: bool = False) -> None:
        """Make `adapter` the one its name serves; the prefix cache forgets the KV of the adapter it replaces.
        Requests in flight on the replaced adapter keep it and finish on it, unless `update_in_flight` (a
        weight sync): then they go on with the new one from their next token, as after a full-weight update."""
        if self.config.true_on_policy:
            raise InvalidRequest("lora_name", adapter.name, _NO_LORA)
        old = self.loras.add(adapter)
        if old is not None:
            self.prefix_cache.drop(old.cache_key)
            if update_in_flight:
                for req in self.requests.values():  # waiting (retracted ones too) and running
                    if req.lora is old:
                        req.lora = adapter
        self.counters["lora_loads"] += 1

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`; requests in flight that name it finish on it."""
        self.prefix_cache.drop(self.loras.remove(name).cache_key)

    def probe(self) -> bool:
        with torch.no_grad():
            return self.runner.probe()

    def load(self) -> dict[str, int]:
        """SGLang's `/get_load` numbers for this (single data-parallel rank) engine."""
        return {
            "dp_rank": 0,
            "num_reqs": len(self.running) + len(self.waiting),
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": sum(r.kv_len for r in self.running),
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.load(),
            "num_running_reqs": len(self.running),
            "paused": self.paused,
            "weight_version": self.weight_version,
            "prefix_cache_tokens": self.prefix_cache.num_tokens,
            "prefix_cache_sequences": len(self.prefix_cache),
            "kv_cache_bytes": self.runner.cache.nbytes(),
            "prefix_cache_bytes": self.prefix_cache.nbytes(),
            "released_memory": sorted(self.released),
            "device_memory_bytes": device_memory_bytes(self.runner.device),
            "model_impl": self.runner.impl,
            "loaded_loras": [adapter.describe() for adapter in self.loras.adapters.values()],
            **{f"total_{k}": v for k, v in self.counters.items()},
        }

    # ---- scheduling ----------------------------------------------------------------------------
    def _admit(self) -> tuple[list[tuple[Request, list[int]]], list[tuple[Request, Request]]]:
        """Move waiting requests into free slots (`admission.plan_admission`), prefix-cache KV copied in.
        Returns the rows to prefill (request, tokens to feed) and the followers (request, leader)."""
        plan = plan_admission(self.waiting, self.running, self.config, self.prefix_cache)
        # Slots: the fed rows first (one forward over contiguous slots), then their followers.
        first = len(self.running)
        for i, ((req, _), (entry, hit)) in enumerate(zip(plan.fed, plan.hits)):
            req.routed_experts = []
            if entry is not None and hit > 0:
                self.runner.cache.write_row(first + i, entry.kv, hit)
                if entry.experts is not None:
                    req.routed_experts.append(entry.experts[:hit])
            self._place(req, first + i, hit, hit)
        for j, (req, leader) in enumerate(plan.followers):
            # KV filled by `_prefill`; all but the last token count as cached, as for a prefix-cache hit
            self._place(req, first + len(plan.fed) + j, 0, len(leader.tokens()) - 1)
        return plan.fed, plan.followers

    def _place(self, req: Request, slot: int, kv_len: int, cached: int) -> None:
        req.kv_len, req.slot, req.phase = kv_len, slot, Phase.RUNNING
        if req.cached_tokens < 0:
            req.cached_tokens = cached
        self.counters["cached_tokens"] += cached

    def _unplace(self, req: Request) -> None:
        """Back to waiting without KV (retracted or preempted); its outputs stay."""
        req.slot, req.kv_len, req.phase, req.routed_experts = None, 0, Phase.WAITING, []

    def _prefill(self, fed: list[tuple[Request, list[int]]], followers: list[tuple[Request, Request]]) -> int:
        reqs = [req for req, _ in fed]
        first = len(self.running)
        # followers hold the slots after the fed rows; in `running` before the forward, so a failed
        # forward ends them with the rest
        self.running.extend(reqs + [req for req, _ in followers])
        pending = [p for _, p in fed]
        logits, experts = self.runner.forward(first, pending, [r.kv_len for r in reqs], row_adapters(reqs))
        for i, req in enumerate(reqs):
            req.kv_len += len(pending[i])
            if experts is not None:
                req.routed_experts.append(experts[i])
            # the prompt's KV, so that later requests with this prefix (a group's samples) reuse it
            self._remember(req)
        self.counters["prefill_tokens"] += sum(len(p) for p in pending)
        row = {id(req): i for i, req in enumerate(reqs)}
        self.runner.cache.copy_rows([leader.slot for _, leader in followers], [req.slot for req, _ in followers],
                                    max((leader.kv_len for _, leader in followers), default=0))
        for req, leader in followers:
            req.kv_len, req.routed_experts = leader.kv_len, list(leader.routed_experts)
        if followers:
            logits = torch.cat([logits, logits[[row[id(leader)] for _, leader in followers]]])  # [rows, vocab]
        return self._sample_and_append(reqs + [req for req, _ in followers], logits)

    def _decode(self) -> int:
        rows = self.running
        logits, experts = self.runner.forward(0, [[r.output_ids[-1]] for r in rows], [r.kv_len for r in rows],
                                              row_adapters(rows))
        for i, req in enumerate(rows):
            req.kv_len += 1
            if experts is not None:
                req.routed_experts.append(experts[i])
        return self._sample_and_append(rows, logits)

    def _sample_and_append(self, rows: list[Request], logits: torch.Tensor) -> int:
        settings = [row_sampling(r, self.eos_ids) for r in rows]
        out = sample(logits, settings, self.generator)
        for req, token, logprob, top in zip(rows, out.tokens, out.logprobs, out.top):
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            req.weight_version = self.weight_version
            if req.oldest_weight_version is None:
                req.oldest_weight_version = self.weight_version
            if req.top_logprobs_num:
                req.output_top_logprobs.append(top)
            req.finish = finish_reason(req, self.eos_ids, self.context_length, self.tokenizer)
            if req.finish is None:
                self._notify(req.on_token, req)
        return len(rows)

    # ---- finishing -------------------------------------------------------------------------------
    def _release_finished(self) -> None:
        """Free the slots of finished requests; fill the holes with rows from the end (one copy each)."""
        done = [r for r in self.running if r.finish is not None]
        if not done:
            return
        for req in done:
            if req.kv_len:
                self._remember(req)
        self._leave_slots(done)
        for req in done:
            self._complete(req)

    def _leave_slots(self, leaving: list[Request]) -> None:
        """Take `leaving` out of the running list; rows from the end fill their slots (one indexed copy)."""
        gone = set(map(id, leaving))
        keep = [r for r in self.running if id(r) not in gone]
        holes = sorted(r.slot for r in leaving if r.slot < len(keep))
        movers = [r for r in keep if r.slot >= len(keep)]
        self.runner.cache.copy_rows([r.slot for r in movers], holes, max((r.kv_len for r in movers), default=0))
        for hole, req in zip(holes, movers):
            req.slot = hole
        self.running = sorted(keep, key=lambda r: r.slot)

    def _preempt_for_priority(self) -> None:
        """Retract the running requests `admission.preemption_victims` names. They keep their outputs, go back
        to the front of their priority's queue and continue from the prefix cache once admitted again (the
        same tokens and logprobs as without preemption)."""
        if not self.config.priority_preemption:
            return
        victims = preemption_victims(self.waiting, self.running, self.config.max_running_requests)
        if not victims:
            return
        for req in victims:
            self._remember(req)
        self._leave_slots(victims)
        for req in victims:  # each to the front of its priority: the earliest admitted resumes first
            self._unplace(req)
            self._enqueue(req, first_of_its_priority=True)
        self.counters["preempted"] += len(victims)

    def _complete(self, req: Request) -> None:
        req.phase, req.slot = Phase.FINISHED, None
        req.weight_version = self.weight_version
        req.finished_at = time.monotonic()
        if self.config.true_on_policy and req.output_ids and req.finish.type != "abort":
            self._score(req)
        req.text = final_text(req, self.tokenizer)
        self.requests.pop(req.rid, None)
        self.counters[f"finished_{req.finish.type}"] += 1
        self._notify(req.on_finish, req)

    def _score(self, req: Request) -> None:
        """True on-policy: the output's logprobs from the trainer's forward over the whole sequence alone, at
        the trainer's temperature (greedy: 1). The tokens were sampled from the decode path's logits, which
        differ from these only by float32 rounding. Aborted requests are not scored: they are not trained on."""
        temperature = req.sampling.temperature or 1.0
        req.output_logprobs = sequence_logprobs(self.model, req.prompt_ids + req.output_ids, len(req.output_ids),
                                                temperature)
        self.counters["scored_tokens"] += len(req.output_ids) + len(req.prompt_ids)

    def _notify(self, callback: Any, req: Request) -> None:
        """A listener that fails (its HTTP client is gone) must not stop the batch; counted, then dropped."""
        if callback is None:
            return
        try:
            callback(req)
        except Exception:
            self.counters["callback_errors"] += 1
            log.exception("listener of request %s failed", req.rid)

    def _abort(self, reqs: list[Request], message: str) -> None:
        for req in reqs:
            req.finish = FinishReason("abort", message=message)
        waiting = [r for r in reqs if r.phase is Phase.WAITING]
        if waiting:
            gone = set(map(id, waiting))
            self.waiting = collections.deque(r for r in self.waiting if id(r) not in gone)
            for req in waiting:
                self._complete(req)
        with torch.no_grad():
            self._release_finished()

    def _retract_all(self) -> None:
        for req in self.running:
            self._remember(req)
            self._unplace(req)
        self.waiting.extendleft(reversed(self.running))
        self.counters["retracted"] += len(self.running)
        self.running = []

    def _remember(self, req: Request) -> None:
        """Offer the request's computed KV (tokens[:kv_len]) to the prefix cache."""
        if self.prefix_cache.max_tokens == 0 or req.kv_len < 1:
            return
        slot, length = req.slot, req.kv_len
        self.prefix_cache.insert(
            req.tokens()[:length], lambda: self.runner.cache.read_row(slot, length), req.experts_array(),
            namespace(req),
        )

