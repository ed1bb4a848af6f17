"""An engine's pass-through flag table (`[vllm]`, `[sglang]`) as its server's command line."""

from __future__ import annotations

import json
from typing import Any


def flag_argv(table: str, flags: dict[str, Any]) -> list[str]:
    """A pass-through table (`[vllm]`, `--vllm.<flag> VALUE`) as the server's command line, names unchanged:
    `true` is the bare flag, a list gives one value each; `false` is refused (write the flag's negative
    form, e.g. `no-enable-prefix-caching = true`)."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is False:
            raise ValueError(f"{table}.{name} = false: a pass-through flag is given or not; write its negative "
                             f"form (e.g. {table}.no-{name} = true) or leave it out")
        if value is None or isinstance(value, dict):
            raise ValueError(f"{table}.{name} = {value!r}: a flag value must be a string, number, true or a list")
        argv.append(f"--{name}")
        if value is True:
            continue
        argv += [_flag_value(v) for v in value] if isinstance(value, list) else [_flag_value(value)]
    return argv


def _flag_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)
