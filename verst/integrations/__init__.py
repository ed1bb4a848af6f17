"""Connectors to agent and environment libraries: each plugs into one of verst's layers (an agent fn, a
generate fn or a rollout fn) and is an optional extra (`pip install 'verst[<name>]'`); docs/agentic.md."""
