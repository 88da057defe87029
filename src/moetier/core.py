"""Plain-Python request types shared by the engine, the offline API and the server.

Holds no tensors and imports nothing else from the package except errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.errors import ConfigError


@dataclass
class SamplingParams:
    """How to pick tokens; temperature 0 means greedy (vLLM-shaped)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One sequence being generated; progress is `num_computed_tokens` against `num_tokens`."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    output_text: str = ""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """The result for one prompt: its ids and its completion(s)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
