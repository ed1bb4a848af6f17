"""An `eval.backend` that scores the snapshot with a standard harness, EleutherAI's lm-evaluation-harness
(`pip install 'verst[lm-eval]'`), on a task written from the run's own held-out prompts (no download):
greedy generation with `transformers`, exact match of the stripped reply against the label.

    verst train recipes/grpo_addition.toml --eval.backend examples.eval_backend.harness:score
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from verst.config import VerstConfig
from verst.eval.local import held_out_prompts

TASK = "verst_heldout"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{label}}}}"
generation_kwargs:
  until: []
  do_sample: false
  max_gen_toks: {max_tokens}
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(\\\\S+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def score(snapshot_dir: str, step: int, config: VerstConfig) -> dict[str, float]:
    """`eval/harness_exact_match`: the share of held-out prompts whose greedy reply starts with the label."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(snapshot_dir)
    prompts = held_out_prompts(config)
    max_tokens = config.eval.max_response_tokens or config.rollout.max_response_tokens
    with tempfile.TemporaryDirectory(prefix="verst-harness-") as tmp:
        data = Path(tmp) / "heldout.jsonl"
        data.write_text("".join(json.dumps({"text": render(p.prompt, tokenizer, config), "label": str(p.label)}) + "\n"
                                for p in prompts))
        (Path(tmp) / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data, max_tokens=max_tokens))
        out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={snapshot_dir},dtype=float32",
                                      tasks=[TASK], task_manager=TaskManager(include_path=tmp), batch_size=16,
                                      device=device(config))
    result = out["results"][TASK]
    return {"harness_exact_match": float(result["exact_match,strip"]), "n_prompts": float(len(prompts))}


def device(config: VerstConfig) -> str:
    if config.cluster.device != "auto":
        return config.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def render(prompt: str | list[dict], tokenizer, config: VerstConfig) -> str:
    """The prompt text the rollout engines see: the chat template applied when the run applies it."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = prompt
    if config.data.apply_chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)
