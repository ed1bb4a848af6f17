"""TRL's side of bench/vs_trl.py: GRPOTrainer on the verst recipe's model, prompts, reward, batch shape
and optimizer, with a callback that measures held-out greedy accuracy (verst's own scoring) every N steps.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.types import Sample


def prompt_rows(cfg: VerstConfig, tokenizer: Any, split: str) -> list[dict[str, Any]]:
    """`{"prompt": text, "label": label}` rows: the exact text verst's rollout encodes (raw prompt, or the
    rendered chat template), so TRL's "standard" (non-conversational) format sees the same ids."""
    from verst.data import load_prompts_from_config
    from verst.models.prompts import encode_prompt

    rows = []
    for p in load_prompts_from_config(cfg.data, split):
        ids = encode_prompt(tokenizer, p.prompt, apply_chat_template=cfg.data.apply_chat_template,
                            system_prompt=cfg.data.system_prompt, tools=p.metadata.get("tools"))
        text = tokenizer.decode(ids, skip_special_tokens=False)
        again = tokenizer(text=text)["input_ids"]  # what TRL's _tokenize_prompts does
        if again != ids:
            raise ValueError(f"prompt {p.prompt!r}: TRL would encode {text!r} as {again}, verst as {ids}")
        rows.append({"prompt": text, "label": p.label})
    return rows


def reward_fn(cfg: VerstConfig):
    """A TRL reward fn over the recipe's built-in reward (`reward.type`): one float per completion."""
    from verst.rewards import REWARDS

    if cfg.reward.type not in REWARDS:
        raise ValueError(f"reward.type = {cfg.reward.type!r}: the TRL side runs only registered rewards "
                         f"{REWARDS.names()}")
    score = REWARDS.load(cfg.reward.type)

    async def score_all(completions: list[str], labels: list[Any]) -> list[float]:
        samples = [Sample(tokens=[0], response=c, label=label, index=i)
                   for i, (c, label) in enumerate(zip(completions, labels, strict=True))]
        return [float(r) for r in await asyncio.gather(*(score(s) for s in samples))]

    def reward(prompts: list[str], completions: list[str], label: list[Any], **_: Any) -> list[float]:
        return asyncio.run(score_all(completions, label))

    reward.__name__ = cfg.reward.type  # TRL names the reward's metrics after the function
    return reward


def accuracy_callback(cfg: VerstConfig, model: Any, tokenizer: Any, *, interval: int, target: float,
                      started: float, time_cap_s: float, record: dict[str, Any]):
    """A TrainerCallback: held-out greedy accuracy before training and every `interval` optimizer steps,
    appended to `record["evals"]` with wall-clock timestamps; stops training at the target or the time
    cap and says which in `record["stopped_by"]`."""
    from transformers import TrainerCallback

    from verst.data import load_prompts_from_config
    from verst.eval import evaluate_greedy, hf_greedy_generate

    test = load_prompts_from_config(cfg.data.model_copy(update={"test_path": cfg.eval.path or cfg.data.test_path}),
                                    "test")[: cfg.eval.max_prompts]
    max_new = cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens

    def evaluate(step: int) -> float:
        generate = hf_greedy_generate(model, tokenizer, max_new, cfg.eval.batch_size)
        metrics = evaluate_greedy(test, generate, tokenizer, cfg.reward, cfg.data, max_new)
        model.train()  # hf_greedy_generate leaves the model in eval mode
        record["evals"].append({"step": step, "time": time.time(), "accuracy": metrics["eval/accuracy"],
                      "eval_s": metrics["time/eval_s"]})
        print(f"[trl] step {step}: held-out greedy accuracy {metrics['eval/accuracy']:.1%}", flush=True)
        return metrics["eval/accuracy"]

    class HeldOutAccuracy(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if step % interval == 0 and evaluate(step) >= target:
                record["stopped_by"] = "target"
            elif time.time() - started > time_cap_s:
                record["stopped_by"] = "time cap"
            if record["stopped_by"] != "step cap":
                print(f"[trl] stopping the run: {record['stopped_by']} reached", flush=True)
                control.should_training_stop = True
            return control

    return HeldOutAccuracy()


def step_times_callback(record: dict[str, Any]):
    """A TrainerCallback appending each optimizer step's end time to `record["step_times"]`."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            record["step_times"].append(time.time())

    return StepTimes()


def run_trl(cfg: VerstConfig, *, target: float, max_steps: int, time_cap_s: float, eval_interval: int,
            threads: int, out_dir: str) -> dict[str, Any]:
    """Train with TRL until the target accuracy, `max_steps` or `time_cap_s`; returns the start time, each
    step's end time and the timestamped evaluations (the clock starts after the imports, before the model
    is loaded). `eval_interval` 0: no held-out evaluations, only `max_steps`."""
    import datasets
    import torch
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from verst.models import load_model, load_tokenizer
    from verst.trainer.optim import build_optimizer

    torch.set_num_threads(threads)
    r, t, algo = cfg.rollout, cfg.trainer, cfg.algorithm
    check_supported(cfg)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    started = time.time()
    tokenizer = load_tokenizer(cfg.model.path)
    tokenizer.padding_side = "left"  # TRL pads prompts itself; this keeps any other padding on the left too
    model = load_model(cfg.model.path)
    if cfg.lora.enabled:  # the same adapters as verst's trainer puts on its model (PEFT, lora.* settings)
        from verst.trainer.lora import add_adapters

        model = add_adapters(model, cfg.lora)
    train = datasets.Dataset.from_list(prompt_rows(cfg, tokenizer, "train"))
    args = GRPOConfig(
        output_dir=out_dir, report_to="none", use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=t.gradient_checkpointing, disable_tqdm=True, save_strategy="no",
        logging_steps=max_steps + 1, seed=t.seed, data_seed=cfg.data.seed, max_steps=max_steps,
        per_device_train_batch_size=r.batch_size * r.n_samples_per_prompt, gradient_accumulation_steps=1,
        num_generations=r.n_samples_per_prompt, num_iterations=1, max_completion_length=r.max_response_tokens,
        temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=max(r.sampling.top_k, 0),
        beta=0.0, epsilon=algo.eps_clip, epsilon_high=algo.eps_clip_high or algo.eps_clip,
        loss_type="dapo",  # token-level mean over the whole batch: verst's loss_aggregation = token_mean
        scale_rewards="group" if algo.grpo_std_normalization else "none",
        learning_rate=t.lr, max_grad_norm=t.grad_clip, dataloader_num_workers=0,
    )
    # verst's own AdamW and warm-up schedule, so the two sides step with identical learning rates.
    optimizer, scheduler = build_optimizer(model, t, total_steps=max_steps)
    record: dict[str, Any] = {"evals": [], "stopped_by": "step cap", "step_times": []}
    callbacks = [step_times_callback(record)]
    if eval_interval:
        callbacks.append(accuracy_callback(cfg, model, tokenizer, interval=eval_interval, target=target,
                                           started=started, time_cap_s=time_cap_s, record=record))
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn(cfg), args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=callbacks, optimizers=(optimizer, scheduler))
    trainer.remove_callback(PrinterCallback)  # the accuracy callback prints; TRL's log lines are noise here
    if trainer.eos_token_ids != [tokenizer.eos_token_id]:
        raise ValueError(f"TRL stops generation at {trainer.eos_token_ids}, verst at [{tokenizer.eos_token_id}]")
    trainer.train()
    return {"started": started, "finished": time.time(), "steps": trainer.state.global_step, **record,
            "threads": threads}


def check_supported(cfg: VerstConfig) -> None:
    """Fail loudly on recipe settings the TRL side does not reproduce."""
    algo, r = cfg.algorithm, cfg.rollout
    got = {
        "algorithm.advantage_estimator": (algo.advantage_estimator, "grpo"),
        "algorithm.policy_loss": (algo.policy_loss, "ppo_clip"),
        "algorithm.loss_aggregation": (algo.loss_aggregation, "token_mean"),
        "algorithm.kl_loss_coef": (algo.kl_loss_coef, 0.0),
        "algorithm.entropy_coef": (algo.entropy_coef, 0.0),
        "reward.group": (cfg.reward.group, False),
        # one optimizer step per rollout batch
        "trainer.global_batch_size": (cfg.trainer.global_batch_size or r.batch_size * r.n_samples_per_prompt,
                                      r.batch_size * r.n_samples_per_prompt),
    }
    wrong = {key: value for key, (value, supported) in got.items() if value != supported}
    if wrong:
        raise ValueError(f"the TRL side reproduces plain GRPO with one optimizer step per batch; unsupported: {wrong}")
