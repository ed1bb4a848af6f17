"""The "tiny" chat template: ChatML turns with tools, tool calls, tool results and reasoning.

Append-only by construction: rendering messages[:k] is a string prefix of rendering messages[:k+1].
"""

from __future__ import annotations

# Why append-only matters: the session server tokenizes only newly appended messages, so no turn may
# change how an earlier turn renders. Hence: every tool result is its own turn (grouping consecutive
# results would move an <|im_end|>), earlier reasoning is never stripped, and nothing renders for an
# empty message list (a tools block there would be rewritten once a system message arrives).
#
# A one-turn prompt renders as  <|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n
# (short, because a tiny model learns arithmetic through it) and an assistant turn ends with
# <|im_end|>\n. Tool calls use the Hermes/Qwen wire shape, so real-model tool parsers read them:
#   <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>
# Tool-call arguments may be a dict (rendered with tojson) or a JSON string (rendered verbatim).

TINY_CHAT_TEMPLATE = r"""
{%- macro render_content(message) -%}
  {%- if message.content is string -%}
    {{- message.content -}}
  {%- elif message.content is defined and message.content is not none -%}
    {{- raise_exception('chat template: content of a ' ~ message.role ~ ' message must be a string') -}}
  {%- endif -%}
{%- endmacro -%}

{%- if messages and tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}
    {{- render_content(messages[0]) ~ '\n\n' -}}
  {%- endif -%}
  {{- '# Tools\n\nYou can call these functions (JSON schemas, one per line):\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' ~ (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nTo call a function, write one block per call:\n' -}}
  {{- '<tool_call>\n{"name": <function name>, "arguments": <JSON object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}

{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- if not (loop.first and tools) -%}
      {{- '<|im_start|>system\n' ~ render_content(message) ~ '<|im_end|>\n' -}}
    {%- endif -%}
  {%- elif message.role == 'user' -%}
    {{- '<|im_start|>user\n' ~ render_content(message) ~ '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if message.reasoning_content is string -%}
      {{- '<think>\n' ~ message.reasoning_content ~ '\n</think>\n\n' -}}
    {%- endif -%}
    {{- render_content(message) -}}
    {%- for tool_call in message.tool_calls or [] -%}
      {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
      {%- if not loop.first or message.content -%}
        {{- '\n' -}}
      {%- endif -%}
      {{- '<tool_call>\n{"name": ' ~ (call.name | tojson) ~ ', "arguments": ' -}}
      {%- if call.arguments is string -%}
        {{- call.arguments -}}
      {%- else -%}
        {{- call.arguments | tojson -}}
      {%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {{- '<|im_start|>user\n<tool_response>\n' ~ render_content(message) ~ '\n</tool_response><|im_end|>\n' -}}
  {%- else -%}
    {{- raise_exception('chat template: unknown role ' ~ message.role
                        ~ '; expected system, user, assistant or tool') -}}
  {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()
