"""The pure parts of bench/vs_trl.py and its side helpers: time to the target accuracy (with and without
start-up), the TRL/verst ratios and verdict, the table, reading a metrics.jsonl mid-write, the TRL reward
fn and the refusal of recipe settings the TRL side cannot reproduce; the real-model mode's seconds per
step, its config and data, and the naming of a bench's processes by role."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from verst.config import load_config

_BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("vs_trl")
verst_side = _load("_verst_side")
trl_side = _load("_trl_side")
step_time = _load("_step_time")
memory = _load("_memory")


def _result(started, evals, steps):
    return {"started": started, "steps": steps,
            "evals": [{"step": s, "time": t, "accuracy": a, "eval_s": 1.0} for s, t, a in evals]}


def test_time_to_target_counts_from_start_and_from_the_step0_evaluation():
    result = _result(100.0, [(0, 130.0, 0.5), (5, 140.0, 0.6), (10, 150.0, 0.66), (15, 160.0, 0.7)], steps=15)
    t = bench.time_to_target(result, target=0.65)
    assert t["reached"] and t["steps"] == 10 and t["accuracy"] == 0.66
    assert t["wall_s"] == pytest.approx(50.0)
    assert t["wall_s_after_startup"] == pytest.approx(20.0)
    assert t["startup_s"] == pytest.approx(30.0)
    assert t["s_per_step"] == pytest.approx(2.0)
    assert t["eval_s_to_target"] == pytest.approx(3.0)  # evaluations at steps 0, 5, 10
    assert t["accuracy_step0"] == 0.5 and t["best_accuracy"] == 0.7


def test_time_to_target_ignores_step0_and_reports_not_reached():
    result = _result(0.0, [(0, 10.0, 0.9), (5, 20.0, 0.5)], steps=7)
    t = bench.time_to_target(result, target=0.8)  # step 0 is the start line, not a result
    assert not t["reached"] and t["steps"] is None and t["wall_s"] is None and t["wall_s_after_startup"] is None
    assert t["steps_run"] == 7 and t["best_accuracy"] == 0.9 and t["s_per_step"] == pytest.approx(2.0)


def test_time_to_target_needs_a_step0_evaluation():
    with pytest.raises(ValueError, match="start at step 0"):
        bench.time_to_target(_result(0.0, [(5, 20.0, 0.5)], steps=5), target=0.8)


def test_speedups_verdict_and_table():
    trl = bench.time_to_target(_result(0.0, [(0, 5.0, 0.5), (20, 65.0, 0.7)], 20), 0.65)
    fast = bench.time_to_target(_result(0.0, [(0, 10.0, 0.5), (10, 30.0, 0.7)], 10), 0.65)
    never = bench.time_to_target(_result(0.0, [(0, 10.0, 0.5), (10, 30.0, 0.6)], 10), 0.65)
    sides = {"trl": trl, "sync": never, "fully_async": fast}
    ratios = bench.speedups(sides)
    assert ratios["fully_async"]["wall_s"] == pytest.approx(65.0 / 30.0)
    assert ratios["fully_async"]["wall_s_after_startup"] == pytest.approx(60.0 / 20.0)
    assert ratios["sync"] == {"wall_s": None, "wall_s_after_startup": None}
    assert "2.17x (target >= 3x): NOT met" in bench.verdict(ratios)
    assert ": met" in bench.verdict({"fully_async": {"wall_s": 3.2}})
    assert "not measured" in bench.verdict({"fully_async": ratios["sync"]})
    table = bench.format_table(sides, ratios).splitlines()
    assert len(table) == 5 and "not reached" in table[3] and ">10" in table[3]
    assert table[4].split()[-2:] == ["2.17x", "3.00x"]


def test_complete_records_skips_a_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert verst_side.complete_records(path) == []
    whole = {"step": 0, "time": 1.0, "eval/accuracy": 0.5}
    path.write_text(json.dumps(whole) + "\n" + '{"step": 1, "ti')
    assert verst_side.complete_records(path) == [whole]
    assert verst_side.evals_of([whole, {"step": 1, "time": 2.0, "train/loss": 0.1}]) == [
        {"step": 0, "time": 1.0, "accuracy": 0.5, "eval_s": 0.0}]


def test_trl_reward_fn_scores_with_the_recipe_reward():
    reward = trl_side.reward_fn(load_config(None, ["--reward.type", "numeric_match"]))
    assert reward(prompts=["1+2=", "5+5=", "9+9="], completions=["3", " 10.0", "17"], label=["3", "10", "18"]) == [
        1.0, 1.0, 0.0]


def test_trl_side_refuses_what_it_cannot_reproduce():
    trl_side.check_supported(load_config(None))
    with pytest.raises(ValueError, match="algorithm.kl_loss_coef"):
        trl_side.check_supported(load_config(None, ["--algorithm.kl-loss-coef", "0.1"]))
    with pytest.raises(ValueError, match="trainer.global_batch_size"):
        trl_side.check_supported(load_config(None, ["--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4",
                                                    "--trainer.global-batch-size", "8"]))


@pytest.mark.parametrize("chat", [False, True])
def test_trl_prompts_are_the_text_verst_encodes(tmp_path, chat):
    from verst.models import TINY_CHAT_TEMPLATE, load_tokenizer
    from verst.models.prompts import encode_prompt
    from verst.models.tokenizer import save_tokenizer

    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "tok", TINY_CHAT_TEMPLATE))
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "12+34="}], "label": "46"}) + "\n")
    cfg = load_config(None, ["--data.test-path", str(data), "--data.apply-chat-template", str(chat).lower()])
    rows = trl_side.prompt_rows(cfg, tokenizer, "test")
    assert rows[0]["label"] == "46"
    if chat:
        assert "<|im_start|>" in rows[0]["prompt"] and "12+34=" in rows[0]["prompt"]
    else:
        assert rows[0]["prompt"] == "12+34="
    verst_ids = encode_prompt(tokenizer, [{"role": "user", "content": "12+34="}], apply_chat_template=chat)
    assert tokenizer(text=rows[0]["prompt"])["input_ids"] == verst_ids


@pytest.mark.parametrize("task", sorted(bench.TASKS))
def test_each_task_pairs_sft_recipes_with_an_rl_recipe_the_trl_side_reproduces(task):
    rl, stages = bench.recipes(task)
    rl_cfg, sft_cfg = load_config(rl), load_config(stages[-1])
    trl_side.check_supported(rl_cfg)
    assert rl_cfg.model.path == f"runs/{sft_cfg.name}/hf"  # the RL recipe starts from its SFT recipe's export
    assert (rl_cfg.data.test_path, rl_cfg.data.apply_chat_template) == (sft_cfg.data.test_path, False)


def test_the_task_option_names_the_work_dir_and_refuses_unknown_tasks():
    args = bench.parse_args(["--task", "addition"])
    assert args.work_dir.endswith("vs-trl/addition")
    assert bench.parse_args([]).task == "chain_addition"  # the long-tailed workload, by default
    with pytest.raises(SystemExit):
        bench.parse_args(["--task", "division"])


def test_seconds_per_step_skips_the_warm_up():
    got = step_time.seconds_per_step([10.0, 12.0, 15.0, 16.0, 18.0], warmup=2)
    assert got == {"s_per_step": pytest.approx(2.0), "steps_timed": 3, "each_s": [3.0, 1.0, 2.0]}
    for times, warmup in (([1.0, 2.0], 2), ([1.0, 2.0], 0)):
        with pytest.raises(ValueError, match="need at least one warm-up step"):
            step_time.seconds_per_step(times, warmup)


def test_the_real_model_config_is_one_grpo_batch_the_trl_side_reproduces(tmp_path):
    args = type("Args", (), {"work_dir": str(tmp_path), "prompts": 4, "samples": 8, "warmup": 2, "steps": 5,
                             "max_new_tokens": 8, "lora": False})()
    cfg = step_time.model_config("fully_async", tmp_path / "model", args)
    trl_side.check_supported(cfg)
    args.lora = True
    lora = step_time.model_config("fully_async", tmp_path / "model", args)
    assert lora.lora.enabled and lora.trainer.lr == 1e-4 and not cfg.lora.enabled
    assert (cfg.schedule, cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.num_rollouts,
            cfg.rollout.max_response_tokens) == ("fully_async", 4, 8, 7, 8)
    rows = [json.loads(line) for line in Path(cfg.data.train_path).read_text().splitlines()]
    test = [json.loads(line) for line in Path(cfg.data.test_path).read_text().splitlines()]
    assert len(rows) == 92 and len(test) == 8 and not {r["label"] for r in rows} - {str(n) for n in range(19)}
    assert not {r["prompt"][0]["content"] for r in rows} & {r["prompt"][0]["content"] for r in test}


def test_the_report_gives_each_run_and_the_spread(capsys):
    args = type("Args", (), {"warmup": 1, "lora": False, "prompts": 4, "samples": 8, "max_new_tokens": 8, "steps": 2,
                             "cores": (0, 1)})()

    def side(ends):
        return {"step_times": ends, "version": "v", "peak_rss_mib": {"p": 1.0}, "started": 0.0, "threads": 2}

    runs = [{"trl": side([1.0, 4.0, 7.0]), "fully_async": side([1.0, 3.0, 5.0])},
            {"trl": side([1.0, 4.0, 7.0]), "fully_async": side([1.0, 2.0, 3.0])}]
    summary = step_time.report(runs, args, Path("m"))
    assert summary["ratios"]["fully_async"] == [pytest.approx(1.5), pytest.approx(3.0)]
    out = capsys.readouterr().out
    assert "2.25x (runs: 1.50, 3.00; spread 1.50-3.00) (target >= 1.5x): met" in out
    assert "both sides on the same 2 cores" in out


def test_processes_are_named_by_role():
    assert memory.role_of("ray::TrainerRank.train_step") == "trainer rank"
    assert memory.role_of("/venv/bin/python -m verst.engine.server --model m --port 0") == "engine server"
    assert memory.role_of("ray::_RolloutManagerActor.run") == "rollout manager"
    assert memory.role_of("ray::IDLE").startswith("other")
