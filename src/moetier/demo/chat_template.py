"""The demo model's chat template: SmolLM2's ChatML plus a Hermes-style tools section.

Without `tools` it renders exactly what SmolLM2-135M-Instruct's own template renders (the demo's
routers are fit and checked on those prompts). With `tools` the system turn lists them inside
`<tools></tools>` and asks for `<tool_call>{...}</tool_call>` blocks, the format Qwen2.5 and
Hermes 2 Pro use (tools/parsers.py's `hermes`); past calls and tool results render the
same way Qwen2.5's template renders them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TEMPLATE_VERSION = 1
TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{%- if not tools and loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_chat_template(model_dir: Path) -> None:
    """Install the template into a checkpoint directory (atomically: readers see the old or the
    new file, never half of one)."""
    target = model_dir / TEMPLATE_FILE
    partial = target.with_name(f".{TEMPLATE_FILE}.partial-{os.getpid()}")
    partial.write_text(CHAT_TEMPLATE)
    partial.replace(target)


def refresh_chat_template(model_dir: Path, info_name: str) -> None:
    """Bring a demo built with an older template (or SmolLM2's own) to this one: the weights do
    not depend on it, so an old build is updated in place instead of rebuilt."""
    info_path = model_dir / info_name
    info = json.loads(info_path.read_text())
    if info.get("chat_template_version") == TEMPLATE_VERSION:
        return
    write_chat_template(model_dir)
    info["chat_template_version"] = TEMPLATE_VERSION
    partial = info_path.with_name(f".{info_path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(info, indent=2) + "\n")
    partial.replace(info_path)
