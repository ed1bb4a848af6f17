"""A run's config made simulated: the engine kind and transport `sim`, the simulated data, reward and (agentic)
agent, the accounted source and buffer; and what a simulation cannot stand in for, refused by field."""

from __future__ import annotations

from verst.config import ConfigError, VerstConfig
from verst.monitor.run_dir import run_dir_of
from verst.sim.config import SimConfig
from verst.sim.fleet import FleetSpec
from verst.sim.kinds import register
from verst.sim.serve import vocab_size

PLUGIN = "verst.sim.plugin"
AGENTIC_GENERATE_FN = "verst.rollout.agentic:generate"
DATA_DIR = "sim_data"  # RUN/sim_data: the simulated data set
SOURCE, BUFFER = "verst.sim.accounting:AccountedSource", "verst.sim.accounting:AccountedBuffer"


def check_simulable(cfg: VerstConfig) -> None:
    """Refuse the settings whose parts are not simulated, naming each field (a simulated run's own config file,
    RUN/config.yaml, names the simulation's source and buffer, and is taken as it is)."""
    refused = {
        "lora.enabled": cfg.lora.enabled, "teacher.model_path": cfg.teacher.model_path is not None,
        "eval.backend": cfg.eval.backend is not None, "eval.num_engines": cfg.eval.num_engines > 0,
        "sync.check_weights": cfg.sync.check_weights, "algorithm.routing_replay": cfg.algorithm.routing_replay != "off",
        "algorithm.true_on_policy": cfg.algorithm.true_on_policy, "checkpoint.load": cfg.checkpoint.load is not None,
        "buffer.path": cfg.buffer.path not in (None, BUFFER), "data.source": cfg.data.source not in (None, SOURCE),
        "rollout.rollout_fn": cfg.rollout.rollout_fn is not None, "sandbox.provider": cfg.sandbox.provider is not None,
    }
    named = [field for field, set_ in refused.items() if set_]
    if named:
        raise ConfigError(f"verst sim: {', '.join(named)} {'is' if len(named) == 1 else 'are'} set, but a simulated "
                          "run has no such part (its trainer, engines, data, buffer and rollout fn are the "
                          "simulation's; docs/scale.md); unset them")


def simulated_config(cfg: VerstConfig, sim: SimConfig) -> VerstConfig:
    """`cfg` with simulated engines and transport, the simulated data set (RUN/sim_data, written when the run
    starts), its reward, and with `sim.agent_turns` the simulated agent through the session server."""
    check_simulable(cfg)
    register()
    if sim.agent_turns and cfg.rollout.generate_fn not in (None, AGENTIC_GENERATE_FN):
        raise ConfigError(f"verst sim: sim.agent_turns = {sim.agent_turns} runs the agentic generate fn, but "
                          f"rollout.generate_fn = {cfg.rollout.generate_fn!r}; unset it")
    data_dir = run_dir_of(cfg).resolve() / DATA_DIR
    agentic = {"generate_fn": AGENTIC_GENERATE_FN, "agent_fn": "verst.sim.workload:agent"} if sim.agent_turns else {}
    tree = cfg.model_dump()
    tree["plugins"] = [*cfg.plugins, PLUGIN] if PLUGIN not in cfg.plugins else list(cfg.plugins)
    tree["cluster"] |= {"engine": "sim", "engine_python": None}
    tree["sync"] |= {"transport": "sim"}
    tree["data"] |= {"source": SOURCE, "train_path": str(data_dir / "train.jsonl"),
                     "test_path": str(data_dir / "test.jsonl"), "label_key": "label", "metadata_key": "metadata",
                     "apply_chat_template": True}
    tree["reward"] |= {"type": "custom", "path": "verst.sim.workload:reward", "group": False, "key": None}
    tree["buffer"] |= {"path": BUFFER}
    tree["rollout"] |= agentic
    return VerstConfig.model_validate(tree)


def fleet_spec(cfg: VerstConfig, sim: SimConfig) -> FleetSpec:
    return FleetSpec(count=cfg.cluster.num_engines, costs=sim.engine_costs_inputs(), speedup=sim.speedup,
                     model_path=cfg.model.path, vocab_size=vocab_size(cfg.model.path),
                     response_tokens_mean=sim.response_tokens_mean, response_tokens_sigma=sim.response_tokens_sigma,
                     max_running=sim.max_running, restart_s=sim.engine_restart_s)
