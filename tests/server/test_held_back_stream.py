"""Streaming while the detokenizer holds text back (a partial stop string or UTF-8 sequence):
with `return_token_ids` every step's tokens still go out in their own chunk (empty text), so a
client timing tokens sees each one when it is made; without it the ids ride with the next text."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from moetier.engine.outputs import RequestDelta
from moetier.metrics import ServerMetrics
from moetier.server.app import ServerSettings, create_app
from tests.server.test_errors_inprocess import ScriptedClient


class HeldBackClient(ScriptedClient):
    """Three steps: tokens 7 and 8 with text held back, then token 9 releases "xyz" and ends."""

    def submit(self, rid: int, ids: list[int], params: Any, out: Any, index: int,
               logprobs: int | None = None) -> None:  # fmt: skip
        out.put_nowait((index, RequestDelta(rid, [7], "", num_output_tokens=1)))
        out.put_nowait((index, RequestDelta(rid, [8], "", num_output_tokens=2)))
        end = RequestDelta(rid, [9], "xyz", True, "length", num_output_tokens=3)
        out.put_nowait((index, end))


def _chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    app = create_app(HeldBackClient(), None, ServerSettings("m"), ServerMetrics("m"))  # type: ignore[arg-type]
    text = TestClient(app).post("/v1/completions", json=body).text
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_token_ids_stream_per_step_while_text_is_held() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True,
            "return_token_ids": True}  # fmt: skip
    got = [(c["choices"][0]["text"], c["choices"][0]["token_ids"]) for c in _chunks(body)]
    assert got == [("", [7]), ("", [8]), ("xyz", [9])]


def test_without_token_ids_held_tokens_ride_with_the_next_text() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True}
    chunks = _chunks(body)
    assert [c["choices"][0]["text"] for c in chunks] == ["xyz"]
    assert "token_ids" not in chunks[0]["choices"][0]
