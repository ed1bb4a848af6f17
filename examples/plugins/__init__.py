"""One small, runnable example per plug-in point; docs/plugins.md shows each with its signature.

tests/contracts/test_plugin_examples.py runs every example through its contract.
"""
