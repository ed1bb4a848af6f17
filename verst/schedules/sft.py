"""SFT: imitate each prompt's label as the assistant reply, or its gold tool-using conversation (loss
on assistant tokens only); evaluate held-out greedy accuracy (or, with `rollout.agent_fn`, greedy agent
success through the session server) before, during and after; save, export, summarise.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.config.rules import check_sft_rules
from verst.data import PromptSource, load_prompts_from_config
from verst.data.calculator import CONVERSATION_KEY
from verst.eval import evaluate_greedy, hf_greedy_generate
from verst.eval.agentic import SCORE_WORDS, evaluate_agentic_local, score_key
from verst.models import load_model, load_tokenizer
from verst.models.prompts import encode_sft_conversation, encode_sft_example
from verst.monitor import MetricsLogger, prepare_run_dir, write_summary
from verst.monitor.diagnosis import cause_text
from verst.monitor.postmortem import summary_of, write_stopped
from verst.monitor.progress import RunProgress
from verst.monitor.report import write_report
from verst.monitor.segments import FINISHED, Segments
from verst.run.checkpointer import ResumePoint, prepare_resume
from verst.run.sft_checkpoints import finish_sft, restore_sft, save_sft
from verst.run.signals import STOP
from verst.run.trainer_setup import load_weights_into, open_trainer
from verst.trainer import sft_loss_fn
from verst.types import Sample, Status

log = logging.getLogger(__name__)


def run_sft(cfg: VerstConfig) -> tuple[dict[str, Any], Path]:
    check_sft_rules(cfg)
    resume = prepare_resume(cfg)  # refused before anything starts
    run_dir = prepare_run_dir(cfg)
    segments = Segments(run_dir, time.perf_counter(), time.time())
    try:
        return _run_sft(cfg, resume, run_dir, segments)
    except BaseException as error:  # a failure or an interrupt: summary.json and the report tell what ran
        end = f"interrupted by {STOP.signum.name if STOP.signum else 'SIGINT'}" if isinstance(
            error, KeyboardInterrupt) else f"failed: {cause_text(error)}"
        with contextlib.suppress(OSError):
            segments.close(end)
        log.info("%s; %s", end, "; ".join(write_stopped(run_dir, summary_of(run_dir, segments.all, end, rl=False))))
        raise


def _run_sft(cfg: VerstConfig, resume: ResumePoint | None, run_dir: Path,
             segments: Segments) -> tuple[dict[str, Any], Path]:
    tokenizer = load_tokenizer(cfg.model.path)
    source = PromptSource.from_config(cfg.data, "train")
    test_prompts = load_prompts_from_config(cfg.data, "test")[: cfg.eval.max_prompts]
    eval_model = load_model(cfg.model.path)
    max_new = cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens

    score = score_key(cfg)
    scored_by = SCORE_WORDS[score]

    def evaluate(trainer=None) -> dict[str, float]:
        if trainer is not None:
            load_weights_into(eval_model, trainer.named_weights(cfg.sync.bucket_bytes))
        if cfg.rollout.agent_fn:
            return evaluate_agentic_local(cfg, eval_model, tokenizer, test_prompts)
        generate = hf_greedy_generate(eval_model, tokenizer, max_new, cfg.eval.batch_size)
        return evaluate_greedy(test_prompts, generate, tokenizer, cfg.reward, cfg.data, max_new)

    segments.begin(resume.version if resume is not None else 0)
    logger = MetricsLogger.for_run(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                   wandb_project=cfg.logging.wandb_project, name=cfg.name)
    # Off a terminal, a line every 5% of the run (and at each evaluation).
    progress = RunProgress("sft", cfg.sft.num_steps, mode="auto" if cfg.logging.progress else "off",
                           line_every=max(1, cfg.sft.num_steps // 20))
    with logger, open_trainer(cfg, total_steps=cfg.sft.num_steps) as trainer:
        if resume is None:
            before = evaluate()
            logger.log(before, step=0)
            log.info("step 0: held-out %s %.1f%%", scored_by, 100 * before[score])
            history, first = [(0, before[score])], 1
        else:
            history = restore_sft(trainer, source, resume)
            before, first = {score: history[0][1]}, resume.version + 1
        encoded: dict[int, Sample] = {}  # data_index -> training sample; each prompt is rendered once
        metrics: dict[str, float] = {}
        with progress:
            for step in range(first, cfg.sft.num_steps + 1):
                started = time.perf_counter()
                batch = [_cached(encoded, p, lambda p=p: sft_sample(tokenizer, p, cfg))
                         for p in source.next_prompts(cfg.sft.batch_size)]
                metrics = trainer.train_step(batch, sft_loss_fn)
                if cfg.sft.eval_interval and step % cfg.sft.eval_interval == 0 and step != cfg.sft.num_steps:
                    metrics.update(evaluate(trainer))
                metrics["perf/step_time_s"] = time.perf_counter() - started
                if score in metrics:
                    history.append((step, metrics[score]))
                logger.log(metrics, step=step)
                segments.update(step)
                progress.step(step, metrics)
                if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step != cfg.sft.num_steps:
                    seconds = save_sft(trainer, source, cfg, run_dir, step, history)
                    logger.log({"time/checkpoint_s": seconds}, step=step)
        after = evaluate(trainer)
        logger.log(after, step=cfg.sft.num_steps)
        history.append((cfg.sft.num_steps, after[score]))
        finish_sft(trainer, source, cfg, run_dir, history)
    summary = {
        f"{score}_before": before[score],
        f"{score}_after": after[score],
        "train/loss": metrics.get("train/loss", float("nan")),  # nan: resumed at its last step
        "train/steps": cfg.sft.num_steps,
    }
    segments.update(cfg.sft.num_steps)
    segments.close(FINISHED)
    summary |= {"time/total_s": segments.total_s, "segments": [segment.row() for segment in segments.all]}
    write_summary(run_dir, summary)
    log.info("held-out greedy %s %.1f%% -> %.1f%% in %.0f s; run directory %s", scored_by, 100 * before[score],
             100 * after[score], summary["time/total_s"], run_dir)
    log.info("report %s", write_report(run_dir))
    return summary, run_dir


def _cached(cache: dict[int, Sample], prompt: Sample, make) -> Sample:
    key = prompt.metadata["data_index"]
    if key not in cache:
        cache[key] = make()
    return cache[key]


def sft_sample(tokenizer: Any, prompt: Sample, cfg: VerstConfig) -> Sample:
    """A training Sample imitating the prompt's gold conversation (`metadata['conversation']`: assistant
    turns, tool calls and tool results; loss on assistant turns only), else its label as one reply."""
    conversation = prompt.metadata.get(CONVERSATION_KEY)
    if conversation is not None:
        if not cfg.data.apply_chat_template:
            raise ValueError(f"prompt {prompt.index} carries a gold conversation; rendering its turns needs "
                             "data.apply_chat_template = true")
        ids, mask = encode_sft_conversation(tokenizer, prompt.prompt, conversation,
                                            system_prompt=cfg.data.system_prompt, tools=prompt.metadata.get("tools"))
    else:
        if not isinstance(prompt.label, str):
            raise ValueError(f"SFT needs a text label to imitate; prompt {prompt.index} has label {prompt.label!r}")
        ids, n = encode_sft_example(
            tokenizer, prompt.prompt, prompt.label, apply_chat_template=cfg.data.apply_chat_template,
            system_prompt=cfg.data.system_prompt, tools=prompt.metadata.get("tools"),
        )
        mask = [1] * n
    n = len(mask)
    return Sample(tokens=ids, response_length=n, loss_mask=mask, rollout_logprobs=[0.0] * n,
                  status=Status.COMPLETED, index=prompt.index, group_index=prompt.group_index,
                  prompt=prompt.prompt, label=prompt.label).validate()
