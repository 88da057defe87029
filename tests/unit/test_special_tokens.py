"""skip_special_tokens=False: special tokens show in the text, but the EOS that ends it does not."""

from __future__ import annotations

from moetier.core import Request, SamplingParams
from moetier.engine.stopping import StopChecker
from tests.unit.test_stopping import CharTokenizer


def _text(ids: list[int], params: SamplingParams) -> tuple[str, str | None]:
    checker = StopChecker(CharTokenizer())
    req = Request(0, [65], params)
    for tok in ids:
        req.output_token_ids.append(tok)
        if checker.check(req):
            break
    return req.output_text, req.finish_reason


def test_specials_show_but_not_the_final_eos() -> None:
    ids = [97, 0, 98, 1]  # a <s> b EOS
    assert _text(ids, SamplingParams(max_tokens=9)) == ("a" + "b" + "\x01", "stop")
    assert _text(ids, SamplingParams(max_tokens=9, skip_special_tokens=False)) == ("a<s>b", "stop")
    stop_id = SamplingParams(max_tokens=9, skip_special_tokens=False, stop_token_ids=[98])
    assert _text(ids, stop_id) == ("a<s>", "stop")
