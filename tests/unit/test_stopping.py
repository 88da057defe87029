"""Stop strings are cut and held back from streaming until they can no longer match."""

from __future__ import annotations

from moetier.core import Request, SamplingParams
from moetier.engine.stopping import StopChecker


class CharTokenizer:
    """Token i decodes to chr(i); 0 is a special token '<s>' (skipped unless asked)."""

    all_special_tokens = ["<s>"]
    eos_token_id = 1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else chr(i) for i in ids)


def _run(text: str, params: SamplingParams) -> tuple[list[str], Request]:
    checker = StopChecker(CharTokenizer())
    req = Request(0, [65], params)
    deltas = []
    for ch in text:
        req.output_token_ids.append(ord(ch) if ch != "^" else 0)
        done = checker.check(req)
        deltas.append(checker.take_text(req))
        if done:
            break
    return deltas, req


def test_partial_stop_is_held_back_then_released() -> None:
    deltas, req = _run("abXYcXYZd", SamplingParams(max_tokens=20, stop=["XYZ"]))
    # "XY" after "ab" could start "XYZ": held until "c" rules it out; "XYZ" then stops.
    assert deltas == ["a", "b", "", "", "XYc", "", "", ""]
    assert req.output_text == "abXYc" and req.finish_reason == "stop"
    assert "".join(deltas) == req.output_text


def test_length_finish_flushes_held_text() -> None:
    deltas, req = _run("abX", SamplingParams(max_tokens=3, stop=["XYZ"]))
    assert deltas == ["a", "b", "X"] and req.finish_reason == "length"


def test_stop_naming_a_special_token_matches_it() -> None:
    _, req = _run("ab^cd", SamplingParams(max_tokens=20, stop=["<s>c"]))
    assert req.output_text == "ab" and req.finish_reason == "stop"
    _, req = _run("ab^cd", SamplingParams(max_tokens=5, stop=["bc"]))
    assert req.output_text == "a" and req.finish_reason == "stop"  # special skipped: "abc"


def test_eos_finishes_with_stop() -> None:
    checker = StopChecker(CharTokenizer())
    req = Request(0, [65], SamplingParams(max_tokens=20))
    for tok in (97, 1):
        req.output_token_ids.append(tok)
        done = checker.check(req)
    assert done and req.finish_reason == "stop" and req.output_text.startswith("a")
