"""Grammar masks: exact allowed tokens on a byte tokenizer, one batched mask for the constrained
rows only, matchers advanced by the sampler, and refusals as ConfigErrors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.core import SamplingParams, StructuredOutput
from moetier.engine.sampler import Sampler
from moetier.engine.structured import GrammarMasks, compile_grammar
from moetier.errors import ConfigError
from tests.server.tiny import EOS, VOCAB, save_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _allowed(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_masks_only_constrained_rows_exactly(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    masks.add(7, StructuredOutput(grammar='start: "ab" | "ac"'))
    masks.add(9, StructuredOutput(json={"enum": ["x", "y"]}))
    logits = torch.zeros(3, VOCAB)
    out = masks.apply(logits, [7, 8, 9])
    assert out is not logits and torch.equal(logits, torch.zeros(3, VOCAB))  # input untouched
    assert _allowed(out[0]) == [ord("a")]
    assert _allowed(out[1]) == list(range(VOCAB))  # unconstrained row
    assert _allowed(out[2]) == [ord('"')]
    masks.advance([7, 8, 9], [ord("a"), 5, ord('"')])
    out = masks.apply(torch.zeros(3, VOCAB), [7, 8, 9])
    assert _allowed(out[0]) == [ord("b"), ord("c")]
    assert _allowed(out[2]) == [ord("x"), ord("y")]
    masks.advance([7], [ord("c")])
    assert _allowed(masks.apply(torch.zeros(1, VOCAB), [7])[0]) == [EOS]  # done: only EOS


def test_unconstrained_batches_pay_nothing(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    masks.add(1, StructuredOutput(json_object=True))
    logits = torch.zeros(2, VOCAB)
    assert masks.apply(logits, [2, 3]) is logits
    masks.forget(1)
    assert masks.apply(logits, [1]) is logits


def test_sampler_follows_the_grammar_at_temperature(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    sampler = Sampler(0, masks)
    spec = StructuredOutput(json={"type": "object", "properties": {"n": {"enum": [10, 20]}},
                                  "required": ["n"], "additionalProperties": False})  # fmt: skip
    params = [SamplingParams(temperature=1.0, seed=s, structured=spec) for s in range(4)]
    for rid in range(4):
        masks.add(rid, spec)
    outs: list[list[int]] = [[] for _ in range(4)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        logits = torch.randn(4, VOCAB, generator=gen)
        for rid, tok in enumerate(sampler.sample(logits, [0, 1, 2, 3], params)):
            outs[rid].append(tok)
    texts = {bytes(t for t in o if t < 256).decode() for o in outs}
    assert texts <= {'{"n": 10}', '{"n": 20}'} and all(o[9] == EOS for o in outs)
    assert masks.take_errors() == {}


def test_refused_token_is_recorded(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    masks.add(3, StructuredOutput(grammar='start: "a"'))
    masks.advance([3], [ord("z")])
    assert list(masks.take_errors()) == [3] and masks.take_errors() == {}


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="Invalid type: frob"):
        compile_grammar(StructuredOutput(json={"type": "frob"}))
    with pytest.raises(ConfigError, match="grammar"):
        compile_grammar(StructuredOutput(grammar="start: (("))
    with pytest.raises(ConfigError, match="not valid JSON"):
        StructuredOutput(json="{nope")
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutput(json={"type": "object"}, json_object=True)
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput(json_object=True))
    with pytest.raises(ConfigError, match="StructuredOutput"):
        SamplingParams(structured={"json": {}})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tokenizer"):
        GrammarMasks(None, 10, set()).add(0, StructuredOutput(json_object=True))
