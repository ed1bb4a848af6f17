"""The NeMo Gym example's agent fn: NeMo Gym's simple agent over the stand-in `add` resources server
(examples/nemo_gym/resources.py), its policy model the session server; `verst.connectors.nemo_gym`."""

from verst.connectors.nemo_gym import NemoGymAgent

run = NemoGymAgent("examples.nemo_gym.resources:AddResourcesServer", agent_config={"max_steps": 4})
