"""`Orchestration`: the Ray session, the placement group and every actor group of one run, started
from `ClusterConfig` and shut down together in reverse order, even on failure.

    with Orchestration(cfg.cluster, schedule=cfg.schedule) as orch:
        engines = orch.start_engines(cfg.model.path, wait=False)  # servers start while the trainer does
        rollout = orch.start_rollout_manager(None, parts_factory)  # so does the manager's process
        trainer = orch.start_trainer(functools.partial(FSDP2Backend, cfg.model, cfg.trainer, device=orch.device))
        rollout.start(engines.wait_ready().urls)

A trainer-only run (SFT over N ranks) passes `engines=False`: the placement holds the trainer ranks only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from verst.config.rules import fully_async_needs_disaggregated, transport_reaches_the_engines
from verst.config.schema import ClusterConfig
from verst.monitor.heap import settle_heap
from verst.monitor.stacks import arm_stack_dump
from verst.orchestration.capacity import check_fits, ray_nodes
from verst.orchestration.engine_actors import EngineActorGroup, check_engine_type
from verst.orchestration.handles import TrainBatchRef
from verst.orchestration.placement import BundlePlan, Placement, Role, plan_bundles
from verst.orchestration.ray_session import RaySession
from verst.rollout.manager import PartsFactory, RolloutManager, RouterSpec
from verst.types import Group
from verst.types.cores import CoreShare


class Orchestration:
    """Everything Ray-side of one run. Use as a context manager; `shutdown()` is safe to call twice.

    Joins `cluster.ray_address`, or starts a local Ray sized for the placement (or reuses the Ray
    already initialised in this process, leaving it running on exit).
    """

    def __init__(
        self,
        cluster: ClusterConfig,
        *,
        schedule: str = "sync",
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        log_dir: str | Path | None = None,
        engines: bool = True,
        teacher_engines: int = 0,
        eval_engines: int = 0,
        plugins: tuple[str, ...] | list[str] = (),
    ):
        fully_async_needs_disaggregated(schedule, cluster)  # a config's rule, for orchestrations built without one
        check_engine_type(cluster.engine)
        self.cluster, self.schedule, self.engines = cluster, schedule, engines
        self.teacher_engines, self.eval_engines = teacher_engines, eval_engines
        self.plugins = tuple(plugins)  # the config's: every engine actor imports them (an engine kind of its own)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.session: RaySession | None = None
        self.placement: Placement | None = None
        self.device: Literal["cpu", "cuda"] | None = None
        self.node: str | None = None  # the driver's Ray node address, once started
        self._stack: list[Any] = []  # started parts, shut down last-first

    def start(self) -> Orchestration:
        if self.placement is not None:
            return self
        try:
            cpu_plan = self._plan("cpu")  # sizes a local Ray; a GPU plan asks for no slots
            self.session = RaySession(self.cluster.ray_address, slots=cpu_plan.slots(), num_cpus=cpu_plan.cpus())
            self.session.start()
            self.device = self._resolve_device()
            self.node = ray.util.get_node_ip_address()
            plan = self._plan(self.device)
            check_fits(plan, ray_nodes())  # an impossible placement is refused by name, not waited for
            self.placement = Placement.create(plan, timeout_s=self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self

    def __enter__(self) -> Orchestration:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- the actor groups ----------------------------------------------------------------
    def start_trainer(self, factory: Callable[[], Any], *, wait: bool = True, shares: list[CoreShare] | None = None):
        """`cluster.trainer_ranks` rank actors hosting `factory()` (see `TrainerActorGroup`). With
        `wait=False` they start in the background until the group's first call or `wait_ready()`. `shares`:
        on CPU, each rank's cores and threads."""
        from verst.orchestration.trainer_actors import TrainerActorGroup

        group = TrainerActorGroup(factory, self._placed(), device=self.device, timeout_s=self.timeout_s,
                                  start_timeout_s=self.start_timeout_s, wait=wait, shares=shares,
                                  log_dir=self.log_dir)
        self._stack.append(group)
        return group

    def start_engines(self, model: str | Path, *, args: list[str] | None = None, wait: bool = True,
                      shares: list[CoreShare] | None = None) -> EngineActorGroup:
        """`cluster.num_engines` engine actors serving `model`; `args` go to the server command line.
        With `wait=False` the servers start in the background until `group.wait_ready()`. `shares`: on CPU,
        each engine's cores and threads (an engine kind that takes them)."""
        if not self.engines:
            raise RuntimeError("this orchestration was planned without engines (engines=False)")
        return self._engine_group(model, args, wait, "engine", shares)

    def start_teacher_engines(self, model: str | Path, *, args: list[str] | None = None,
                              wait: bool = True) -> EngineActorGroup:
        """The `teacher_engines` engine actors serving the teacher `model` (on-policy distillation), in
        bundles of their own; never in the weight sync."""
        if not self.teacher_engines:
            raise RuntimeError("this orchestration was planned without teacher engines (teacher_engines=0)")
        return self._engine_group(model, args, wait, "teacher")

    def start_eval_engines(self, model: str | Path, *, args: list[str] | None = None,
                           wait: bool = True) -> EngineActorGroup:
        """The `eval_engines` engine actors of the evaluation fleet, serving `model` until a snapshot is loaded,
        in bundles of their own; never in the weight sync."""
        if not self.eval_engines:
            raise RuntimeError("this orchestration was planned without evaluation engines (eval_engines=0)")
        return self._engine_group(model, args, wait, "eval")

    def _engine_group(self, model: str | Path, args: list[str] | None, wait: bool, role: Role,
                      shares: list[CoreShare] | None = None) -> EngineActorGroup:
        """The engine actors of the placement's `role` bundles, stopped with the orchestration."""
        group = EngineActorGroup(self.cluster.engine, model, self._placed(), device=self.device, args=args,
                                 plugins=self.plugins, shares=shares,
                                 startup_timeout_s=self.start_timeout_s, log_dir=self.log_dir, wait=wait, role=role)
        self._stack.append(group)
        return group

    def start_rollout_manager(
        self, engine_urls: list[str] | None, parts_factory: PartsFactory, *, router: RouterSpec | None = RouterSpec(),
        prepare: Callable[[], Any] | None = None,
    ) -> RolloutManagerHandle:
        """The rollout manager actor in front of `engine_urls`, started (router up, parts built). With
        `engine_urls=None` the actor only starts its process (imports, `prepare()`) until `handle.start(urls)`."""
        self._placed()
        index = sum(isinstance(part, RolloutManagerHandle) for part in self._stack)  # multi-LoRA: one per adapter
        log_path = self.log_dir / f"rollout-manager{f'-{index}' if index else ''}.log" if self.log_dir else None
        handle = RolloutManagerHandle(engine_urls, parts_factory, router=router, prepare=prepare,
                                      timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s,
                                      log_path=log_path)
        self._stack.append(handle)
        return handle

    def check_transport(self, transport: str) -> None:
        """Refuse a transport that hands weights over in memory on one machine when an engine was placed on a
        machine other than trainer rank 0's (`rules.transport_reaches_the_engines`)."""
        if not self.engines:
            return
        address = {node.node_id: node.address for node in ray_nodes()}
        trainer = address.get(self._placed().nodes_of("trainer")[0])
        engines = [address.get(node) for node in self._placed().nodes_of("engine")]
        transport_reaches_the_engines(transport, trainer, engines)

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the actor groups (last started first), remove the placement group, end a Ray we started."""
        errors = []
        while self._stack:
            try:
                self._stack.pop().shutdown()
            except Exception as error:  # keep stopping the rest; raised below
                errors.append(error)
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self.session is not None:
            self.session.shutdown()
            self.session = None
        if errors:
            raise RuntimeError(f"orchestration shutdown: {len(errors)} part(s) failed to stop: {errors}")

    # ---- internals -----------------------------------------------------------------------
    def _plan(self, device: Literal["cpu", "cuda"]) -> BundlePlan:
        num_engines = self.cluster.num_engines if self.engines else 0
        return plan_bundles(self.cluster.placement, self.cluster.trainer_ranks, num_engines, device,
                            teacher_engines=self.teacher_engines, eval_engines=self.eval_engines,
                            trainer_resources=self.cluster.trainer_resources,
                            engine_resources=self.cluster.engine_resources)

    def _resolve_device(self) -> Literal["cpu", "cuda"]:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        if self.cluster.device == "auto":
            return "cuda" if gpus > 0 else "cpu"
        if self.cluster.device == "cuda" and gpus <= 0:
            raise RuntimeError("cluster.device = 'cuda' but the Ray cluster offers no GPU "
                               f"(resources: {ray.cluster_resources()})")
        return self.cluster.device

    def _placed(self) -> Placement:
        if self.placement is None:
            raise RuntimeError("the orchestration is not started (use it as a context manager or call start())")
        return self.placement


class _RolloutManagerActor(RolloutManager):
    """The manager as an actor process: its stacks can be read by a hang report; its output goes to
    `log_path` (RUN/logs/rollout-manager.log) when given."""

    def __init__(self, *args: Any, log_path: str | None = None, **kwargs: Any):
        arm_stack_dump(log_path)
        super().__init__(*args, **kwargs)

    async def start(self, engine_urls: list[str] | None = None, teacher_urls: list[str] | None = None) -> str | None:
        """`RolloutManager.start`; the call that builds the parts then settles the process's start-up heap
        (`verst.monitor.heap`)."""
        building = self._parts is None
        url = await super().start(engine_urls, teacher_urls)
        if building:
            settle_heap(owned=True)
        return url


_RemoteRolloutManager = ray.remote(max_restarts=0, max_task_retries=0)(_RolloutManagerActor)
# It mostly waits on HTTP; a CPU request would compete with the bundles on small machines.
MANAGER_CPUS = 0


class RolloutManagerHandle:
    """The driver's handle of the rollout manager actor: blocking calls with a timeout. Await
    `handle.actor.<method>.remote(...)` instead from an asyncio driver."""

    def __init__(self, engine_urls: list[str] | None, parts_factory: PartsFactory, *, router: RouterSpec | None,
                 prepare: Callable[[], Any] | None = None, timeout_s: float = 600.0, start_timeout_s: float = 300.0,
                 log_path: str | Path | None = None):
        self.timeout_s = timeout_s
        self._closed = False
        # On the driver's node: the driver calls the router it starts, and surveys its processes, there.
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node = ray.util.get_node_ip_address()
        here = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        self.actor = _RemoteRolloutManager.options(num_cpus=MANAGER_CPUS, scheduling_strategy=here).remote(
            list(engine_urls) if engine_urls is not None else None, parts_factory, router=router, prepare=prepare,
            log_path=str(log_path) if log_path else None)
        self.router_url: str | None = None
        self.pids: dict[str, int | None] = {}
        self._start_timeout_s = start_timeout_s
        if engine_urls is not None:
            self.start()

    def start(self, engine_urls: list[str] | None = None, teacher_urls: list[str] | None = None) -> str | None:
        """Start the router and build the parts (in front of `engine_urls` when not given before; with the
        teacher's engines at `teacher_urls`); returns the router URL. A failure shuts the actor down."""
        try:
            self.router_url = self._call("start", engine_urls, teacher_urls, timeout_s=self._start_timeout_s)
            self.pids = self._call("pids")
        except BaseException:
            with contextlib.suppress(Exception):  # the start-up error is the one to report
                self.shutdown()
            raise
        return self.router_url

    def generate_batch(self, rollout_id: int, weight_version: int) -> list[Group]:
        return self._call("generate_batch", rollout_id, weight_version)

    def start_async(self) -> None:
        self._call("start_async")

    def generate_train_batch(self, rollout_id: int, weight_version: int) -> tuple[TrainBatchRef, dict[str, float]]:
        """One rollout step: a reference to its groups, which stay in the object store for the trainer
        ranks to fetch, and its metrics."""
        return self._batch("generate_train_batch", rollout_id, weight_version)

    def take_batch(self, n: int, version: int, timeout: float | None = None,
                   ) -> tuple[TrainBatchRef, dict[str, float] | None]:
        """Fully async: fresh groups into the train batch the manager assembles, waiting at most `timeout`;
        once it holds n, a reference to it (as `generate_train_batch`) and its metrics; before, an empty
        reference counting the groups it holds, and None."""
        wait = self.timeout_s if timeout is None else timeout + 30.0
        return self._batch("take_batch", n, version, timeout, timeout_s=wait)

    def progress(self) -> str:
        """Fully async: what the worker made of its groups so far."""
        return self._call("progress")

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def stop_async(self) -> int:
        return self._call("stop_async")

    def metrics(self) -> dict[str, float]:
        return self._call("metrics")

    def engine_urls(self) -> list[str]:
        return self._call("engine_urls")

    def evaluate(self, version: int) -> dict[str, float]:
        return self._call("evaluate", version)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def save_state(self, path: str) -> dict[str, int]:
        return self._call("save_state", path)

    def load_state(self, path: str) -> None:
        self._call("load_state", path)

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop the worker, the parts and the router inside the actor, then kill the actor."""
        if self._closed:
            return
        self._closed = True
        try:
            ray.get(self.actor.shutdown.remote(), timeout=grace_s)
        finally:
            ray.kill(self.actor, no_restart=True)  # Ray also ends a router the shutdown did not stop

    def _batch(self, method: str, *args: Any, timeout_s: float | None = None) -> tuple[TrainBatchRef, dict[str, float]]:
        """Call a method returning (groups, summary) as two objects: only the summary comes here."""
        self._check_open(method)
        groups, summary = getattr(self.actor, method).options(num_returns=2).remote(*args)
        num_groups, metrics = self._get(summary, method, timeout_s or self.timeout_s)
        return TrainBatchRef(groups, num_groups), metrics

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self._check_open(method)
        return self._get(getattr(self.actor, method).remote(*args), method, timeout_s or self.timeout_s)

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"the rollout manager is shut down; cannot {method}")

    @staticmethod
    def _get(ref: ray.ObjectRef, method: str, timeout_s: float) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout manager: {method!r} did not finish within {timeout_s:g}s") from None
        except ray.exceptions.RayTaskError as error:
            raise error.as_instanceof_cause() from None
