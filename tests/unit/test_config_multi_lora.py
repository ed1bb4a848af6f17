"""Multi-LoRA configs: each adapter's run config from the run's, and the combinations refused at load
with the field named."""

import pytest
from pydantic import ValidationError

from verst.cli.preflight import PreflightError, preflight
from verst.config import VerstConfig, batch_plan
from verst.config.adapters import adapter_lora_configs, adapter_run_config

TWO = [{"name": "add"}, {"name": "rev", "rank": 2, "target_modules": "q_proj", "lr": 3e-3, "batch_size": 2,
                         "n_samples_per_prompt": 4, "num_rollouts": 5,
                         "data": {"train_path": "rev/train.jsonl", "test_path": "rev/test.jsonl"},
                         "reward": {"type": "exact_match"}}]


def config(**extra) -> VerstConfig:
    tree = {"schedule": "fully_async", "lora": {"enabled": True, "rank": 8, "adapters": TWO}}
    for key, value in extra.items():
        section, _, field = key.partition("__")
        if field:
            tree.setdefault(section, {})[field] = value
        else:
            tree[key] = value
    return VerstConfig.model_validate(tree)


def test_each_adapter_runs_under_its_own_settings_and_the_runs_others():
    cfg = config(rollout__batch_size=4, rollout__n_samples_per_prompt=2, trainer__lr=1e-3)
    add, rev = adapter_run_config(cfg, "add"), adapter_run_config(cfg, "rev")
    assert (add.lora.name, add.lora.rank, add.lora.adapters, add.trainer.lr) == ("add", 8, [], 1e-3)
    assert add.data == cfg.data and add.reward == cfg.reward and add.eval.path == cfg.eval.path
    assert (rev.lora.name, rev.lora.rank, rev.lora.target_modules, rev.trainer.lr) == ("rev", 2, ["q_proj"], 3e-3)
    assert (rev.data.train_path, rev.reward.type, rev.eval.path) == ("rev/train.jsonl", "exact_match", None)
    assert batch_plan(rev).samples_per_rollout == 8 and batch_plan(rev).total_train_steps == 5
    assert rev.lora.served_adapter == "rev" and rev.algorithm == cfg.algorithm
    assert {name: lora.rank for name, lora in adapter_lora_configs(cfg.lora).items()} == {"add": 8, "rev": 2}
    with pytest.raises(KeyError, match="no adapter 'sum'"):
        adapter_run_config(cfg, "sum")


@pytest.mark.parametrize("extra, message", [
    ({"lora": {"enabled": True, "adapters": [{"name": "a"}, {"name": "a"}]}}, r"names \['a'\] appear more than once"),
    ({"lora": {"enabled": True, "sync": "merged", "adapters": TWO}}, r"lora.sync = 'merged'"),
    ({"lora": {"enabled": False, "adapters": TWO}}, r"lora.enabled = false"),
    ({"schedule": "one_step_off"}, r"schedule = 'one_step_off'"),
    ({"checkpoint__merge_lora": True}, r"checkpoint.merge_lora"),
    ({"eval__backend": "pkg.mod:fn"}, r"eval.backend"),
    ({"eval__num_engines": 1}, r"eval.num_engines = 1 with lora.adapters"),
    ({"sync__interval": 2}, r"sync.interval = 2"),
    ({"lora": {"enabled": True, "adapters": [{"name": "a.b"}]}}, r"lora.adapters.0.name"),
    ({"lora": {"enabled": True, "adapters": [{"name": "a", "rank": 0}]}}, r"lora.adapters.0.rank"),
    ({"lora": {"enabled": True, "adapters": [{"name": "a", "reward": {"type": "custom"}}]}},
     r"lora.adapters\[0\] \('a'\): reward.type = 'custom' needs reward.path"),
    ({"lora": {"enabled": True, "adapters": [{"name": "a", "target_modules": []}]}},
     r"lora.adapters\[0\].target_modules = \[\] names no module"),
    ({"lora": {"enabled": True, "adapters": [{"name": f"a{i}"} for i in range(9)]}}, r"at most 8 resident"),
    ({"schedule": "sync", "lora": {"enabled": True, "adapters": [{"name": "a", "global_batch_size": 128}]}},
     r"lora.adapters\[0\] \('a'\): 2 optimizer steps per rollout batch"),
])
def test_refused_at_load_naming_the_field(extra, message):
    with pytest.raises(ValidationError, match=message):
        config(**extra)


def test_sft_refuses_adapters_and_rl_preflight_checks_each_adapters_files(tmp_path):
    cfg = config(run_dir=str(tmp_path / "run"))
    with pytest.raises(PreflightError, match="multi-LoRA trains with RL only"):
        preflight(cfg, rl=False)
    with pytest.raises(PreflightError, match=r"lora.adapters\[1\].data.train_path = 'rev/train.jsonl' does not exist"):
        preflight(cfg, rl=True)


def test_the_multi_lora_recipe_loads_with_each_adapters_own_data():
    from pathlib import Path

    from verst.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes" / "grpo_multi_lora.toml")
    add, chain = (adapter_run_config(cfg, name) for name in ("add", "chain"))
    assert (cfg.schedule, [a.name for a in cfg.lora.adapters]) == ("fully_async", ["add", "chain"])
    assert add.data.train_path.endswith("addition/train.jsonl")
    assert chain.data.train_path.endswith("chain_addition/train.jsonl") and chain.eval.path is None
    assert batch_plan(add).total_train_steps == batch_plan(chain).total_train_steps == 30
