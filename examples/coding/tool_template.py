"""Give a ChatML chat model a template that renders tools, tool calls and tool results:
`python -m examples.coding.tool_template artifacts/models/smollm2-135m-instruct artifacts/models/smollm2-135m-coding`.

SmolLM2-135M-Instruct's own template renders only each message's content: the tools' schemas and an assistant
turn's tool calls would vanish from the prompt, the SFT target and the session's re-render. verst's ChatML
template (`verst.models.chat_template`) renders them in the Hermes/Qwen shape the session server parses, with
the same <|im_start|> and <|im_end|> tokens, so the copy keeps the model's tokens and changes only the text
around tool use.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from verst.models.chat_template import TINY_CHAT_TEMPLATE


def with_tool_template(source: Path, out: Path) -> Path:
    """A copy of checkpoint folder `source` at `out` whose tokenizer_config.json carries verst's ChatML template
    with tools (a chat_template.jinja beside it is removed: it would take precedence)."""
    config_file = source / "tokenizer_config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} is missing: {source} is not a checkpoint folder with a tokenizer")
    shutil.copytree(source, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads(config_file.read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(with_tool_template(args.source, args.out))


if __name__ == "__main__":
    main()
