"""Engine actors: each starts one inference server of `cluster.engine` (the embedded engine, vLLM behind
verst's gateway, or SGLang; a child process of the actor) in its placement bundle and reports its URL and
health; `EngineActorGroup` is the driver's handle.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import ray

from verst.config.imports import import_plugins
from verst.engine.process import EngineProcess
from verst.engine_kinds.kinds import engine_kind
from verst.inference_client.client import EngineClient
from verst.monitor.diagnosis import headline
from verst.monitor.stacks import arm_stack_dump
from verst.orchestration.placement import Placement, Role, current_bundle
from verst.types.cores import CoreShare


def check_engine_type(engine: str) -> None:
    """`engine` must name an engine kind (what each kind cannot do is refused at config load and preflight)."""
    engine_kind(engine)


class EngineServer:
    """The body of one engine actor: the server runs as a child process, which Ray ends with the actor.
    `engine` picks what runs (`EngineKind.entry`: the server, or the launcher or gateway that starts it)."""

    def __init__(self, index: int, model: str, device: str, args: list[str], startup_timeout_s: float,
                 log_dir: str | None, port: int = 0, role: str = "engine", engine: str = "embedded",
                 plugins: tuple[str, ...] = ()):
        # A hang report can read this actor's stacks; its output goes beside its server's log.
        arm_stack_dump(Path(log_dir) / f"{role}-{index}-actor.log" if log_dir else None)
        import_plugins(list(plugins))  # an engine kind of the run's own is registered there
        self.index = index
        # Bind where the router (perhaps on another node) can reach it: this node's Ray address,
        # which is 127.0.0.1 on a local one-node Ray.
        self.host = ray.util.get_node_ip_address()
        self.log_path = Path(log_dir) / f"{role}-{index}.log" if log_dir else None
        self.args, self.startup_timeout_s = ["--device", device, *args], startup_timeout_s
        self.entry = list(engine_kind(engine).entry)
        self.server = EngineProcess(model, host=self.host, args=self.args, startup_timeout=startup_timeout_s,
                                    log_path=self.log_path, port=port, entry=self.entry)
        self.device = device

    def start(self) -> dict[str, Any]:
        self.server.start()
        return self.info()

    def info(self) -> dict[str, Any]:
        placement_group, bundle = current_bundle()
        return {"index": self.index, "url": self.server.url, "actor_pid": os.getpid(),
                "server_pid": self.server.proc.pid if self.server.proc else None,
                "placement_group": placement_group, "bundle": bundle,
                "node": self.host, "node_id": ray.get_runtime_context().get_node_id()}

    def url(self) -> str:
        return self.server.url

    def restart(self, model: str, version: int) -> dict[str, Any]:
        """Replace the server (stopped hard: it may be hung) by a new one serving `model` as weight version
        `version`, on the same port, so its URL stays the same for the router, the syncer and the clients."""
        port = self.server.port or 0
        self.server.stop(grace=2.0)
        args = with_weight_version(self.args, version)
        self.server = EngineProcess(model, host=self.host, args=args, startup_timeout=self.startup_timeout_s,
                                    log_path=self.log_path, port=port, entry=self.entry)
        return self.start()

    def halt(self) -> None:
        """Kill the server at once (SIGKILL: it may be stopped or hung), so calls waiting on it fail now."""
        proc = self.server.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def status(self) -> dict[str, Any]:
        """The server's pid and its return code (None while it runs; negative: the killing signal)."""
        proc = self.server.proc
        return {"index": self.index, "server_pid": proc.pid if proc else None,
                "returncode": proc.poll() if proc else None}

    def health(self) -> bool:
        """The server process is alive and `GET /health` answers 200."""
        if self.server.proc is None or self.server.proc.poll() is not None:
            return False
        try:
            return httpx.get(self.server.url + "/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def release_memory(self) -> bool:
        """Colocated placement: the server gives its memory to the trainer while it steps (weights and KV
        cache: SGLang's `/release_memory_occupation`); generation has finished when the sync schedule calls
        this (the run decides whether to: `verst.run.training.DeviceShare`)."""
        asyncio.run(_call_server(self.server.url, lambda client: client.release_memory_occupation()))
        return True

    def resume_memory(self) -> bool:
        """Undo `release_memory`: weights back on the device, the KV cache grown again as requests need it."""
        asyncio.run(_call_server(self.server.url, lambda client: client.resume_memory_occupation()))
        return True

    def stop(self) -> None:
        self.server.stop()


async def _call_server(url: str, call: Any) -> Any:
    async with EngineClient(url) as client:
        return await call(client)


_RemoteEngineServer = ray.remote(max_restarts=0, max_task_retries=0)(EngineServer)


def share_args(share: CoreShare | None) -> list[str]:
    """The embedded engine's arguments for its share of the cores (none: one thread, unpinned)."""
    if share is None:
        return []
    return ["--torch-threads", str(share.threads), "--cpu-cores", ",".join(map(str, share.cores))]


def with_weight_version(args: list[str], version: int) -> list[str]:
    """Server arguments with `--weight-version` set to `version`."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--weight-version":
            skip = True
            continue
        out.append(arg)
    return [*out, "--weight-version", str(version)]


class EngineActorGroup:
    """One engine actor per bundle of `role` in `placement` (the policy's engines, a teacher's: `role =
    "teacher"`, or the evaluation fleet's: `role = "eval"`), all started before this returns unless `wait=False`."""

    def __init__(
        self,
        engine: str,
        model: str | Path,
        placement: Placement,
        *,
        device: str = "cpu",
        args: list[str] | None = None,
        startup_timeout_s: float = 180.0,
        log_dir: str | Path | None = None,
        wait: bool = True,
        role: Role = "engine",
        plugins: tuple[str, ...] = (),
        shares: list[CoreShare] | None = None,
    ):
        check_engine_type(engine)
        self.engine, self.startup_timeout_s, self.role, self.plugins = engine, startup_timeout_s, role, tuple(plugins)
        self._placement, self._spawn = placement, (str(model), device, list(args or []), startup_timeout_s,
                                                   str(log_dir) if log_dir else None)
        self._closed = False
        self._infos: list[dict[str, Any]] | None = None
        count = len(placement.plan.bundles_of(role))
        self._actors = [
            _RemoteEngineServer.options(**placement.actor_options(role, i)).remote(
                i, str(model), device, [*(args or []), *share_args(shares[i] if shares else None)], startup_timeout_s,
                str(log_dir) if log_dir else None, role=role, engine=engine, plugins=self.plugins)
            for i in range(count)
        ]
        self._starting = [actor.start.remote() for actor in self._actors]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> EngineActorGroup:
        """Block until every server is healthy (`wait=False` lets the trainer start meanwhile)."""
        if self._infos is None:
            try:
                self._infos = self._collect(self._starting, "start", self.startup_timeout_s + 60.0)
            except BaseException:
                self.shutdown()
                raise
        return self

    @property
    def infos(self) -> list[dict[str, Any]]:
        """Per engine: index, url, actor_pid, server_pid, placement_group, bundle, node (address), node_id."""
        if self._infos is None:
            raise RuntimeError("the engines are still starting; call wait_ready() first")
        return self._infos

    def __enter__(self) -> EngineActorGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def urls(self) -> list[str]:
        return [info["url"] for info in self.infos]

    @property
    def pids(self) -> list[int]:
        """Every process this group started: the actors and their servers."""
        return [pid for info in self.infos for pid in (info["actor_pid"], info["server_pid"])]

    def health(self) -> dict[str, bool]:
        return dict(zip(self.urls, self._all("health", 30.0)))

    def release_memory(self, indices: list[int] | None = None) -> dict[int, bool | Exception]:
        """Colocated: each engine (of `indices`; default all) gives its memory to the trainer while it steps (the
        run asks only where the engines are idle then and their kind releases memory); by engine, True, or the
        error of one that failed (the others still released theirs)."""
        return self._each_settled("release_memory", indices, 120.0)

    def resume_memory(self, indices: list[int] | None = None) -> dict[int, bool | Exception]:
        """Undo `release_memory`, by engine as it."""
        return self._each_settled("resume_memory", indices, 120.0)

    def halt(self, index: int, timeout_s: float = 15.0) -> None:
        """Kill engine `index`'s server now (see `EngineServer.halt`); a dead actor has none left."""
        ready, _ = ray.wait([self._actors[index].halt.remote()], timeout=timeout_s)
        if ready:
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError:
                pass

    def restart(self, index: int, model: str, version: int) -> dict[str, Any]:
        """Restart engine `index` in place: a new server in its actor (same bundle, same URL) serving
        `model` as `version`; a dead actor is replaced by a new one in the same bundle. Returns its info."""
        old = self.infos[index]
        timeout_s = self.startup_timeout_s + 60.0
        try:
            info = ray.get(self._actors[index].restart.remote(model, version), timeout=timeout_s)
        except ray.exceptions.RayActorError:  # the actor itself is gone: a new one, same bundle, same port
            ray.kill(self._actors[index], no_restart=True)
            _, device, args, startup, log_dir = self._spawn
            port = int(old["url"].rsplit(":", 1)[1])
            self._actors[index] = _RemoteEngineServer.options(**self._placement.actor_options(self.role, index)).remote(
                index, model, device, with_weight_version(args, version), startup, log_dir, port, role=self.role,
                engine=self.engine, plugins=self.plugins)
            info = ray.get(self._actors[index].start.remote(), timeout=timeout_s)
        except ray.exceptions.RayTaskError as error:
            raise error.as_instanceof_cause() from None
        info["index"] = index
        self._infos[index] = info
        return info

    def status(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Per engine, what its actor reports of its server (`EngineServer.status`), or `actor_error`
        when the actor is dead or does not answer within `timeout_s`."""
        refs = [actor.status.remote() for actor in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out: list[dict[str, Any]] = []
        for index, ref in enumerate(refs):
            if ref not in ready:
                out.append({"index": index, "actor_error": f"no answer within {timeout_s:g} s"})
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError as error:
                out.append({"index": index, "actor_error": headline(error)})
        return out

    def shutdown(self, grace_s: float = 15.0) -> None:
        """Stop every server (SIGTERM, then SIGKILL), then the actors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        stops = [actor.stop.remote() for actor in self._actors]
        ray.wait(stops, num_returns=len(stops), timeout=grace_s)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)  # Ray also ends a server whose stop did not finish

    def _all(self, method: str, timeout_s: float) -> list[Any]:
        if self._closed:
            raise RuntimeError(f"the engine actor group is shut down; cannot {method}")
        return self._collect([getattr(actor, method).remote() for actor in self._actors], method, timeout_s)

    def _each_settled(self, method: str, indices: list[int] | None, timeout_s: float) -> dict[int, Any]:
        """`method` on the engines of `indices` (default all) at once; by engine, its result or its error."""
        if self._closed:
            raise RuntimeError(f"the engine actor group is shut down; cannot {method}")
        chosen = range(len(self._actors)) if indices is None else indices
        refs = {index: getattr(self._actors[index], method).remote() for index in chosen}
        deadline, out = time.monotonic() + timeout_s, {}
        for index, ref in refs.items():
            try:
                out[index] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.GetTimeoutError:
                out[index] = TimeoutError(f"engine {index} did not finish {method!r} within {timeout_s:g}s")
            except ray.exceptions.RayError as error:
                out[index] = RuntimeError(f"engine {index} failed in {method!r}: {error}")
        return out

    def _collect(self, refs: list[ray.ObjectRef], method: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0)))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"engine {index} did not finish {method!r} within {timeout_s:g}s") from None
            except ray.exceptions.RayError as error:
                raise RuntimeError(f"engine {index} failed in {method!r}: {error}") from None
        return results
