"""What one engine step tells its caller per request: new tokens, new text, finish or error.

Plain data only (picklable, crosses the engine-process boundary to the server); no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestDelta:
    """What changed for one request in one step; `text` is safe to show (stop strings held back).

    finish_reason: "stop", "length", "abort" or "error" (then `error` says why) once finished.
    """

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens reused from the KV prefix cache at admission
