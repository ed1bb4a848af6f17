"""The rules of the run's core budget on CPU (`cluster.cores`, `cluster.trainer_threads`,
`cluster.engine_threads`): part of `verst.config.rules.RULES`, plus the start-up check against the cores
this machine gives the run.
"""

from __future__ import annotations

from verst.config.devices import on_cuda
from verst.config.registries import ENGINE_KINDS
from verst.config.runtime import ClusterConfig
from verst.config.training import AlgorithmConfig

CORE_FIELDS = ("cores", "trainer_threads", "engine_threads")


def core_budget_is_for_the_cpu(cluster: ClusterConfig) -> None:
    given = _given(cluster, CORE_FIELDS)
    if given and on_cuda(cluster.device):
        raise ValueError(f"{given} set the CPU's core budget, and cluster.device = {cluster.device!r} trains and "
                         "generates on GPUs; leave them unset or use cluster.device = 'cpu'")


def core_budget_is_one_machines(cluster: ClusterConfig) -> None:
    given = _given(cluster, CORE_FIELDS)
    if given and cluster.ray_address:
        raise ValueError(f"{given} plan the cores of the machine the run starts on, and cluster.ray_address = "
                         f"{cluster.ray_address!r} places the ranks and engines on a Ray cluster's nodes; leave them "
                         "unset there (each process then runs one thread)")


def engine_takes_its_core_share(cluster: ClusterConfig) -> None:
    given = _given(cluster, ("cores", "engine_threads"))
    if given and not ENGINE_KINDS.entry(cluster.engine).cpu_share:
        takers = " or ".join(repr(n) for n in ENGINE_KINDS if ENGINE_KINDS.entry(n).cpu_share)
        raise ValueError(f"{given} with cluster.engine = {cluster.engine!r}: that engine sets its own threads (vLLM: "
                         f"VLLM_CPU_OMP_THREADS_BIND); leave them unset or use cluster.engine = {takers}")


def true_on_policy_trains_on_one_thread(algorithm: AlgorithmConfig, cluster: ClusterConfig) -> None:
    """The engine scores each sequence on one thread, and a kernel's reduction order may follow its threads."""
    threads = cluster.trainer_threads
    if algorithm.true_on_policy and threads is not None and threads > 1:
        raise ValueError(f"cluster.trainer_threads = {threads} with algorithm.true_on_policy = true: the trainer's "
                         "logprobs are bitwise the engine's only on one thread each (reduction order); set "
                         "cluster.trainer_threads = 1 or leave it unset")


CORE_RULES = (core_budget_is_for_the_cpu, core_budget_is_one_machines, engine_takes_its_core_share, true_on_policy_trains_on_one_thread)


def cores_exist(cores: int | None, usable: tuple[int, ...]) -> None:
    """At start-up: `cluster.cores` against the cores this process may run on."""
    if cores is not None and cores > len(usable):
        raise ValueError(f"cluster.cores = {cores}, but this process may run on {len(usable)} core(s) "
                         f"({list(usable)}); set cluster.cores <= {len(usable)} or leave it unset (every core)")


def _given(cluster: ClusterConfig, fields: tuple[str, ...]) -> str:
    return ", ".join(f"cluster.{name} = {getattr(cluster, name)}" for name in fields if getattr(cluster, name) is not None)
