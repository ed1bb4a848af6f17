"""The Harbor example's agent fns. `run`: the stand-in answer agent (examples/harbor/answer_agent.py) in the
stand-in host environment (examples/harbor/local_env.py), for machines without a container runtime.
`run_docker`: harbor's own terminus-2 agent in harbor's docker environment, for machines with one."""

from pathlib import Path

from verst.connectors.harbor import HarborAgent

TASK = Path(__file__).with_name("tasks") / "add"

run = HarborAgent("examples.harbor.answer_agent:AnswerAgent", environment="examples.harbor.local_env:LocalEnvironment",
                  task=TASK, base_url_option="api_base", agent_kwargs={"max_turns": 3})
run_docker = HarborAgent("terminus-2", environment="docker", task=TASK, agent_kwargs={"max_turns": 10})
