"""The diffusion engine's logic without sockets: `DiffusionCore` samples images from a diffusers denoiser with
the Flow-GRPO SDE sampler (`verst.models.diffusion.sample`), loads weights by name and carries the weight
version; `ImageRunner` calls it on one thread and holds requests while generation is paused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from verst.data import shapes
from verst.engine.weights import check_weight_names, copy_weights
from verst.inference_client.images import SETTINGS, ImageGenerateRequest, ImageSamplingParams
from verst.inference_client.protocol import WEIGHT_UPDATE_ABORT, InvalidRequest
from verst.models import diffusion

T = TypeVar("T")
_job_ids = itertools.count()
MAX_BATCH = 256  # images in one forward


@dataclasses.dataclass
class ImageJob:
    """One admitted request: `n` images of class `label` with seeds `seed + i`. `aborted` is set by an abort
    (any thread); the images not yet sampled then end as aborted."""

    rid: str
    label: int
    seed: int
    params: ImageSamplingParams
    return_logprob: bool
    aborted: str | None = None
    wake: Callable[[], None] = lambda: None
    key: int = dataclasses.field(default_factory=lambda: next(_job_ids))


class NoAdapters:
    """The diffusion engine serves no LoRA adapters: a pushed adapter is refused by name."""

    def check_room(self, name: str) -> None:
        raise InvalidRequest("lora_name", name, "the diffusion engine serves no LoRA adapters; push full weights")


class DiffusionCore:
    """A class-conditioned denoiser and its weight version. `generate` (a batch of jobs) and the weight loads run
    on the runner's thread, one at a time; `abort` and `abort_all` may come from any thread."""

    def __init__(self, model: torch.nn.Module, weight_version: str = "0", seed: int = 0,
                 settings: dict[str, Any] | None = None):
        self.model = model.eval()
        self.weight_version = weight_version
        self.seed = seed
        # the sampler's settings a request leaves out (through sglang-router, which drops them, every request)
        self.settings = ImageSamplingParams(**(settings or {}))
        self.loras = NoAdapters()
        self.n_classes = int(model.config.num_class_embeds) - 1
        self.counters = {"images": 0, "batches": 0, "requests": 0, "aborted": 0, "weight_updates": 0}
        self._pending: dict[int, ImageJob] = {}
        self._lock = threading.Lock()

    # ---- requests --------------------------------------------------------------------------------------
    def job(self, body: ImageGenerateRequest, rid: str) -> ImageJob:
        """The job of a request, its class checked against the model's."""
        try:
            label = shapes.label_of(body.text)
        except ValueError as exc:
            raise InvalidRequest("text", body.text, str(exc)) from None
        if label >= self.n_classes:
            raise InvalidRequest("text", body.text, f"class {label}; the model has {self.n_classes} classes")
        asked = body.sampling_params
        params = asked.model_copy(update={name: getattr(self.settings, name) for name in SETTINGS
                                          if name not in asked.model_fields_set})
        return ImageJob(rid=rid, label=label, seed=self.seed if asked.sampling_seed is None else asked.sampling_seed,
                        params=params, return_logprob=body.return_logprob)

    def admit(self, job: ImageJob) -> None:
        with self._lock:
            self._pending[job.key] = job
            self.counters["requests"] += 1

    def leave(self, job: ImageJob) -> None:
        with self._lock:
            self._pending.pop(job.key, None)

    def pending(self) -> list[ImageJob]:
        with self._lock:
            return list(self._pending.values())

    def abort(self, rid: str, message: str = "aborted by request") -> int:
        return self._abort([job for job in self.pending() if job.rid == rid], message)

    def abort_all(self, message: str = "aborted by request") -> int:
        return self._abort(self.pending(), message)

    def _abort(self, jobs: list[ImageJob], message: str) -> int:
        for job in jobs:
            job.aborted = message
            job.wake()
        self.counters["aborted"] += len(jobs)
        return len(jobs)

    def generate(self, jobs: list[ImageJob]) -> dict[int, tuple[str, list[diffusion.Trajectory | None]]]:
        """By job key: the weight version and each image's trajectory; None for an image an abort came before.
        The images of every job with the same sampler settings are sampled as one batch (up to MAX_BATCH), each
        from its own seed (`seed + i`), so a seed gives one image (within float32 noise) whatever the batch."""
        out = {job.key: [None] * job.params.n for job in jobs}
        batches: dict[tuple, list[tuple[ImageJob, int]]] = {}
        for job in jobs:
            if job.aborted is None:
                p = job.params
                batches.setdefault((p.num_inference_steps, p.guidance_scale, p.noise_level), []).extend(
                    (job, i) for i in range(p.n))
        for (steps, guidance, noise_level), images in batches.items():
            for start in range(0, len(images), MAX_BATCH):
                part = images[start:start + MAX_BATCH]
                traj = diffusion.sample(self.model, torch.tensor([job.label for job, _ in part]),
                                        seeds=[job.seed + i for job, i in part], steps=steps, guidance=guidance,
                                        noise_level=noise_level)
                for row, (job, i) in enumerate(part):
                    out[job.key][i] = diffusion.Trajectory(traj.latents[row:row + 1], traj.logprobs[row:row + 1],
                                                           traj.times)
                self.counters["images"] += len(part)
                self.counters["batches"] += 1
        return {job.key: (self.weight_version, out[job.key]) for job in jobs}

    def probe(self) -> bool:
        """One step of one image: whether the model's output is finite."""
        traj = diffusion.sample(self.model, torch.tensor([0]), seed=0, steps=1)
        return bool(torch.isfinite(traj.latents).all() and math.isfinite(float(traj.logprobs.sum())))

    # ---- weights --------------------------------------------------------------------------------------
    def check_weights(self, named_shapes: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
        return check_weight_names(self.model, named_shapes)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: str | None, flush: bool = True,
                     shapes: list[tuple[str, Any]] | None = None) -> int:
        """Copy tensors into the model by name, all validated first (with `shapes`, `named` may be lazy and is
        read once); set the version. `flush` has nothing to flush: no state outlives a request."""
        count = copy_weights(self.model, named, shapes)
        if version is not None:
            self.weight_version = version
        self.counters["weight_updates"] += 1
        return count

    def build_lora(self, name: str, config: dict[str, Any], tensors: dict[str, Any]) -> Any:
        self.loras.check_room(name)

    def add_lora(self, adapter: Any, update_in_flight: bool = False) -> None:
        self.loras.check_room(str(adapter))


class ImageRunner:
    """Runs the core's work one call at a time on its own thread (generation and weight loads never overlap):
    the requests that arrive while a batch samples are the next batch. New requests wait while paused; a batch
    already sampling finishes."""

    def __init__(self, core: DiffusionCore, torch_threads: int = 1):
        self.core = core
        self.torch_threads = torch_threads
        self.paused = False
        self.busy_seconds = 0.0
        self.stopped = False
        self.started_at = time.monotonic()
        self._queued: list[tuple[ImageJob, asyncio.Future]] = []  # jobs waiting for the next batch
        self._batching: asyncio.Future | None = None  # the task sampling them
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="verst-diffusion", initializer=torch.set_num_threads, initargs=(torch_threads,))

    async def acall(self, fn: Callable[[DiffusionCore], T]) -> T:
        def timed() -> T:
            start = time.monotonic()
            try:
                return fn(self.core)
            finally:
                self.busy_seconds += time.monotonic() - start

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    async def generate(self, job: ImageJob) -> tuple[str, list[diffusion.Trajectory | None]]:
        """The job's images, sampled with every job queued meanwhile (one batch a turn of the engine's thread);
        held while paused."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        job.wake = lambda: loop.call_soon_threadsafe(woken.set)
        self.core.admit(job)
        try:
            while self.paused and job.aborted is None:
                woken.clear()
                await woken.wait()
            done: asyncio.Future = loop.create_future()
            self._queued.append((job, done))
            if self._batching is None or self._batching.done():
                self._batching = asyncio.ensure_future(self._sample_queued())
            return await done
        finally:
            self.core.leave(job)

    async def _sample_queued(self) -> None:
        """Sample what is queued, as one batch, until nothing is (a batch's failure is each of its jobs')."""
        while self._queued:
            batch, self._queued = self._queued, []
            try:
                results = await self.acall(lambda core: core.generate([job for job, _ in batch]))
            except Exception as exc:  # noqa: BLE001  (handed to every request of the batch)
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for job, done in batch:
                if not done.done():  # a request whose client went away is cancelled
                    done.set_result(results[job.key])

    def pause(self, mode: str) -> int:
        """abort: requests held or queued end as aborted; retract and in_place: they wait for `resume`."""
        self.paused = True
        if mode == "abort":
            return self.core.abort_all(WEIGHT_UPDATE_ABORT)
        return len(self.core.pending())

    def resume(self) -> None:
        self.paused = False
        for job in self.core.pending():
            job.wake()

    def alive(self) -> bool:
        return not self.stopped

    def stop(self) -> None:
        self.stopped = True
        self.core.abort_all("the engine is stopping")
        self._executor.shutdown(wait=True, cancel_futures=True)
