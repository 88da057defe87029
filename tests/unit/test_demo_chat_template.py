"""The demo's chat template: without tools it renders exactly SmolLM2's own; old builds are
brought up to date in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from moetier.demo.chat_template import (
    CHAT_TEMPLATE,
    TEMPLATE_FILE,
    TEMPLATE_VERSION,
    refresh_chat_template,
)

# SmolLM2-135M-Instruct's template, as its GGUF carries it
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],  # fmt: skip
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


def _render(template: str, messages: list[dict[str, str]], **kw: object) -> str:
    out, _ = render_jinja_template(conversations=[messages], chat_template=template, **kw)
    return out[0]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_without_tools_it_is_smollm2s(messages: list[dict[str, str]], gen: bool) -> None:
    assert _render(CHAT_TEMPLATE, messages, add_generation_prompt=gen) == _render(
        SMOLLM2, messages, add_generation_prompt=gen
    )


def test_tools_call_and_result_render_hermes_style() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ]
    text = _render(CHAT_TEMPLATE, messages, tools=[tool], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert text.endswith(
        '<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "f", '
        '"arguments": {"a": 1}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n42\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_old_builds_get_the_template_in_place(tmp_path: Path) -> None:
    (tmp_path / "info.json").write_text(json.dumps({"recipe_version": 1}))
    (tmp_path / TEMPLATE_FILE).write_text(SMOLLM2)
    refresh_chat_template(tmp_path, "info.json")
    assert (tmp_path / TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
    info = json.loads((tmp_path / "info.json").read_text())
    assert info == {"recipe_version": 1, "chat_template_version": TEMPLATE_VERSION}
    (tmp_path / TEMPLATE_FILE).write_text("kept")
    refresh_chat_template(tmp_path, "info.json")  # up to date: left alone
    assert (tmp_path / TEMPLATE_FILE).read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == [TEMPLATE_FILE, "info.json"]
