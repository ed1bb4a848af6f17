"""Connectors to agent and environment libraries, each plugged into one of the three rollout layers and
installed as an optional extra (`pip install 'verst[<name>]'`); docs/agentic.md lists them."""
