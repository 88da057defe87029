"""guided_choice / guided_regex: exact token masks on a byte tokenizer, SamplingParams' checks,
and LLM.generate honouring them on a tiny random checkpoint."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.core import SamplingParams, StructuredOutput
from moetier.engine.structured import GrammarMasks, choice_grammar, compile_grammar
from moetier.errors import ConfigError
from tests.server.tiny import EOS, VOCAB, make_tiny_server_model, save_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _walk(masks: GrammarMasks, rid: int, text: str) -> list[list[int]]:
    """The allowed tokens before each character of `text` and after the last."""
    allowed = []
    for ch in text + "\0":
        row = masks.apply(torch.zeros(1, VOCAB), [rid])[0]
        allowed.append(torch.isfinite(row).nonzero().flatten().tolist())
        if ch != "\0":
            masks.advance([rid], [ord(ch)])
    assert masks.take_errors() == {}
    return allowed


def test_regex_mask_is_the_whole_match(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    masks.add(1, StructuredOutput(regex=r"[0-9]{2}-(ab|c)"))
    digits = [ord(c) for c in "0123456789"]
    got = _walk(masks, 1, "42-ab")
    assert got == [digits, digits, [ord("-")], [ord("a"), ord("c")], [ord("b")], [EOS]]


def test_choice_mask_branches_and_escapes(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    masks.add(2, StructuredOutput(choice=["yes", "yellow", 'a"b\\']))
    got = _walk(masks, 2, "yel")
    assert got[:3] == [[ord("a"), ord("y")], [ord("e")], [ord("l"), ord("s")]]
    assert got[3] == [ord("l")]  # "yel" -> only "yellow" remains
    masks.add(3, StructuredOutput(choice=["yes", "yellow", 'a"b\\']))
    assert _walk(masks, 3, 'a"b\\')[-1] == [EOS]
    assert choice_grammar(['a"b', "é"]) == 'start: "a\\"b" | "é"'


def test_sampling_params_guided_fields() -> None:
    p = SamplingParams(guided_choice=["a", "b"])
    assert p.structured == StructuredOutput(choice=["a", "b"])
    p = SamplingParams(guided_regex=r"\d+")
    assert p.structured == StructuredOutput(regex=r"\d+")
    # replace() re-runs the checks on the filled-in params: still one constraint, not two
    assert replace(p, skip_special_tokens=False).structured == StructuredOutput(regex=r"\d+")
    with pytest.raises(ConfigError, match="guided_choice and guided_regex"):
        SamplingParams(guided_choice=["a"], guided_regex="a")
    with pytest.raises(ConfigError, match="guided_regex cannot be combined with structured"):
        SamplingParams(guided_regex="a", structured=StructuredOutput(json_object=True))
    with pytest.raises(ConfigError, match="guided_choice must be a non-empty list"):
        SamplingParams(guided_choice=[])
    with pytest.raises(ConfigError, match="guided_choice must be a non-empty list"):
        SamplingParams(guided_choice="ab")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="guided_regex must be a string"):
        SamplingParams(guided_regex=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingParams(guided_regex="a", ignore_eos=True)
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])


def test_bad_regex_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"(?s)unsupported regex: .*unclosed character class"):
        compile_grammar(StructuredOutput(regex="[a-z"))
    compile_grammar(StructuredOutput(regex="a/b"))  # a slash needs no escaping


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from moetier import LLM

    path = make_tiny_server_model(tmp_path_factory.mktemp("tiny") / "tiny-moe")
    return LLM(path, device="cpu", progress=False)


def test_generate_honours_guided_choice_and_regex(llm: Any) -> None:
    choices = ["yes", "no", "maybe so"]
    texts = set()
    for seed in range(6):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, guided_choice=choices)
        (out,) = llm.generate(["hello"], params)
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
        texts.add(out.outputs[0].text)
    assert len(texts) > 1  # sampled, yet always one of the choices
    pattern = r"[0-9]{3}-[a-c]{1,4}"
    for seed in range(4):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, guided_regex=pattern)
        (out,) = llm.generate(["hello"], params)
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    with pytest.raises(ConfigError, match="regex"):
        llm.generate(["hello"], SamplingParams(guided_regex="(a"))
