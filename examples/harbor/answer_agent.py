"""A stand-in Harbor agent, written with harbor's `BaseAgent` API and its LiteLLM model client: it asks
the model for the answer, writes each reply to /app/answer.txt and runs the task's fixed checker
(/app/check.sh), whose output is the next message, until the checker says "correct" or `max_turns`.

It never runs model-written commands, so it is safe in the host stand-in environment (local_env.py);
harbor's own agents (terminus-2, ...) drive real environments. Runs in Harbor's environment, no verst.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.llms.base import OutputLengthExceededError
from harbor.llms.lite_llm import LiteLLM
from harbor.models.agent.context import AgentContext


class AnswerAgent(BaseAgent):
    def __init__(self, logs_dir: Path, model_name: str | None = None, *, api_base: str | None = None,
                 max_turns: int = 3, temperature: float = 1.0, llm_kwargs: dict | None = None, **kwargs):
        super().__init__(logs_dir, model_name, **kwargs)
        self.llm = LiteLLM(model_name=model_name, api_base=api_base, temperature=temperature, **(llm_kwargs or {}))
        self.max_turns = max_turns

    @staticmethod
    def name() -> str:
        return "verst-answer-agent"

    def version(self) -> str | None:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        """Nothing to install."""

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        history: list[dict] = []
        prompt = instruction
        for turn in range(self.max_turns):
            try:
                text = (await self.llm.call(prompt, message_history=history)).content or ""
            except OutputLengthExceededError as e:  # a reply cut at max_tokens is still an answer to check
                text = e.truncated_response or ""
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(text)
            await environment.upload_file(f.name, "/app/answer.txt")
            Path(f.name).unlink()
            checked = await environment.exec("bash /app/check.sh", timeout_sec=30)
            prompt = (checked.stdout or "").strip() or "no output"
            context.metadata = {"turns": turn + 1, "last_check": prompt}
            if prompt == "correct":
                break
