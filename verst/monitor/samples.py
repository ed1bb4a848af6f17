"""Sample generations for the run report: the `samples.jsonl` format, its writer and reader, and the reader
of rollout dumps (`rollout.dump_dir`); the report shows a few of them at the first, a middle and the last step.

`samples.jsonl` lies in the run directory, one JSON object per line, one line per generated sample:

    {"step": 12, "prompt": "What is 3 + 4?", "response": "7", "reward": 1.0,
     "label": "7", "group": 3, "status": "completed", "weight_version": 11, "response_tokens": 2}

- `step` (int): the train step (weight version) whose rollout produced the sample;
- `prompt` (str, or a list of chat messages `{"role", "content"}`); `response` (str): the decoded text;
- `reward` (number, or an object of named numbers);
- optional: `label` (the reference answer), `group` (the sample's group: the samples of one prompt share it),
  `status` ("completed", "truncated", ...), `weight_version` (oldest version behind its tokens),
  `response_tokens` (int), `outcome` (str: what the episode ended with, which an agent fn reports as
  `metadata["outcome"]`, e.g. the coding agent's test results). Other keys are kept and ignored by the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.jsonl"
DUMP_GLOB = "rollout_*.samples"  # written by verst.rollout.rollout_fn.dump_batch
MAX_TEXT = 2000  # characters of a prompt or response shown
OUTCOME_KEY = "outcome"  # the sample metadata's text an agent fn reports its episode's end in


def sample_record(sample: Any, step: int) -> dict[str, Any]:
    """The samples.jsonl line of a `verst.types.Sample` produced for train step `step`."""
    return {
        "step": int(step), "prompt": sample.prompt, "response": sample.response, "reward": sample.reward,
        "label": sample.label if isinstance(sample.label, (str, int, float)) else None,
        "group": sample.group_index, "status": sample.status.value,
        "weight_version": min((int(v) for v in sample.weight_versions), default=None),
        "response_tokens": sample.response_length,
    } | ({"outcome": str(sample.metadata[OUTCOME_KEY])} if OUTCOME_KEY in sample.metadata else {})


def append_samples(run_dir: str | Path, step: int, samples: list[Any]) -> Path:
    """Append samples (`verst.types.Sample`) of train step `step` to the run's samples.jsonl."""
    path = Path(run_dir) / SAMPLES_FILE
    with path.open("a") as f:
        for sample in samples:
            f.write(json.dumps(sample_record(sample, step), default=str) + "\n")
    return path


def read_samples(run_dir: str | Path, dump_dir: str | Path | None = None) -> dict[int, list[dict[str, Any]]]:
    """{step: sample records} from RUN_DIR/samples.jsonl, else from the rollout dumps in `dump_dir`.
    Lines that are not objects with a step are skipped: the file may be in the middle of being written."""
    path = Path(run_dir) / SAMPLES_FILE
    by_step: dict[int, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                by_step.setdefault(rec["step"], []).append(rec)
        return by_step
    if dump_dir is not None and Path(dump_dir).is_dir():
        return read_dumps(Path(dump_dir))
    return by_step


def read_dumps(dump_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Sample records of `rollout_<step>.samples` dumps (the binary `encode_samples` form)."""
    from verst.types.codec import decode_samples

    files = sorted(dump_dir.glob(DUMP_GLOB))
    by_step = {}
    for file in pick_steps(files):
        step = int(file.name.removeprefix("rollout_").removesuffix(".samples"))
        by_step[step] = [sample_record(s, step) for s in decode_samples(file.read_bytes())]
    return by_step


def pick_steps(steps: list) -> list:
    """The first, a middle and the last of a sorted list (fewer when it is shorter)."""
    if len(steps) <= 3:
        return list(steps)
    return [steps[0], steps[len(steps) // 2], steps[-1]]


def examples(records: list[dict[str, Any]], prompts: int = 3, responses: int = 4) -> list[dict[str, Any]]:
    """Up to `prompts` distinct prompts of one step, each with up to `responses` of its responses:
    [{"prompt", "label", "responses": [{"response", "reward", "status", "outcome"}]}]."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        prompt = prompt_text(rec.get("prompt", ""))
        if prompt not in out:
            if len(out) == prompts:
                continue
            out[prompt] = {"prompt": prompt, "label": rec.get("label"), "responses": []}
        if len(out[prompt]["responses"]) < responses:
            out[prompt]["responses"].append({"response": clip(str(rec.get("response", ""))),
                                             "reward": rec.get("reward"), "status": rec.get("status"),
                                             "outcome": clip(str(rec.get("outcome") or ""))})
    return list(out.values())


def prompt_text(prompt: Any) -> str:
    """A prompt as text: chat messages as 'role: content' lines."""
    if isinstance(prompt, list):
        prompt = "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                           for m in prompt)
    return clip(str(prompt))


def clip(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit] + f" … ({len(text) - limit} more characters)"
