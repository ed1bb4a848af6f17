"""One Harbor trial, run by `verst.connectors.harbor` in Harbor's own Python (>= 3.12) environment: reads
a job from stdin, writes the trial's outcome as JSON to the file named by argv[1].

The job names the task folder, the agent (a harbor agent name such as "terminus-2", or `module:Class`)
with its options, and the environment (a harbor environment type such as "docker", or `module:Class`).
The agent's inference endpoint is the episode's session on verst's session server: harbor's `base_url`
override, or the agent option the job names. Imports nothing from verst.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from typing import Any


def _named(spec: str) -> dict[str, str]:
    """A harbor name or type, or an import path (`module:Class`)."""
    return {"import_path": spec} if ":" in spec else {"name": spec}


def trial_config(job: dict[str, Any], trials_dir: str) -> Any:
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig

    agent_kwargs = dict(job.get("agent_kwargs", {}))
    agent: dict[str, Any] = {**_named(job["agent"]), "model_name": job["model_name"], "kwargs": agent_kwargs}
    if job.get("base_url_option"):
        agent_kwargs[job["base_url_option"]] = job["base_url"]
    else:
        agent["base_url"] = job["base_url"]
    environment = job["environment"]
    env = ({"import_path": environment} if ":" in environment else {"type": environment})
    return TrialConfig(task=TaskConfig(path=job["task_path"]), trials_dir=trials_dir, agent=AgentConfig(**agent),
                       environment=EnvironmentConfig(**env, kwargs=job.get("environment_kwargs", {})))


async def run_trial(job: dict[str, Any]) -> dict[str, Any]:
    from harbor.trial.trial import Trial

    with tempfile.TemporaryDirectory(prefix="harbor-trials-") as trials_dir:
        trial = await Trial.create(trial_config(job, trials_dir))
        result = await trial.run()
    verifier = result.verifier_result
    agent = result.agent_result
    return {
        "rewards": verifier.rewards if verifier is not None else None,
        "exception": None if result.exception_info is None else result.exception_info.model_dump(mode="json"),
        "agent_metadata": agent.metadata if agent is not None else None,
        "trial_name": result.trial_name,
    }


def main() -> None:
    # LiteLLM's OpenAI route wants a key; the session server takes none, so any value serves
    os.environ.setdefault("OPENAI_API_KEY", "verst-session")
    # LiteLLM's packaged model cost map, not a download at start-up (which retries for seconds offline)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    result = asyncio.run(run_trial(json.load(sys.stdin)))
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
