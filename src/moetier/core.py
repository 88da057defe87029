"""Plain-Python request types shared by the engine, the offline API and the server.

Holds no tensors and imports nothing else from the package except errors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from moetier.errors import ConfigError

# Temperatures below this are greedy: dividing logits by 1e-40 overflows to inf and softmax
# gives NaN, while the limit of sampling as temperature -> 0 is argmax anyway (vLLM does the same).
GREEDY_TEMPERATURE = 1e-5
# A smaller top_p rounds to 0 in float32 and the sampler would drop every token. Any top_p at or
# below 1/vocab keeps the top token alone, so raising it to this floor picks the same tokens.
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class StructuredOutput:
    """What the generated text must match, enforced token by token while sampling.

    Exactly one of: `json` (a JSON Schema, as a dict or its JSON text), `json_object` (any JSON
    object), `grammar` (a Lark grammar in llguidance's syntax, which may embed JSON schemas
    with `%json {...}`), `regex` (the whole output matches it) or `choice` (the output is one of
    these strings). The shape of vLLM's StructuredOutputsParams; whether the grammar library
    accepts the schema or regex is checked when the request is queued.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    grammar: str | None = None
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        given = [
            self.json is not None,
            self.json_object is True,
            self.grammar is not None,
            self.regex is not None,
            self.choice is not None,
        ]
        if sum(given) != 1:
            raise ConfigError(
                "StructuredOutput takes exactly one of json=<schema>, json_object=True, "
                f"grammar=<lark>, regex=<pattern> or choice=<strings>; got {sum(given)}"
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise ConfigError(f"regex must be a string, got {self.regex!r}")
        if self.choice is not None:
            _check_choice("choice", self.choice)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ConfigError(f"json schema is not valid JSON: {exc}") from exc
            if not isinstance(schema, (dict, bool)):
                raise ConfigError("a JSON schema must be a JSON object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ConfigError(f"json must be a schema dict or its JSON text, got {self.json!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ConfigError(f"grammar must be a string, got {self.grammar!r}")


@dataclass
class SamplingParams:
    """How to pick tokens; temperature 0 (or below GREEDY_TEMPERATURE) means greedy (vLLM-shaped).

    Every field is checked here, so a bad value fails before any work starts.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    structured: StructuredOutput | None = None  # constrain the output (JSON schema, grammar)
    skip_special_tokens: bool = True  # False: special tokens show in the text (not the last EOS)
    # vLLM's guided decoding shorthands: the output is one of these strings / matches this regex
    # (each sets `structured`; at most one of them and `structured` may be given)
    guided_choice: list[str] | None = None
    guided_regex: str | None = None

    def __post_init__(self) -> None:
        self._guided()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_p = max(self.top_p, MIN_TOP_P)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
                raise ConfigError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError(f"stop must be a string or a list of strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise ConfigError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ConfigError(
                    f"structured must be a StructuredOutput, got {type(self.structured).__name__}"
                )
            if self.ignore_eos:
                # the grammar ends the output with EOS; past it nothing may be generated
                raise ConfigError("ignore_eos cannot be combined with structured output")

    def _guided(self) -> None:
        """guided_choice / guided_regex as `structured` (kept when `structured` already is what
        they ask for: dataclasses.replace runs this again on the filled-in params)."""
        if self.guided_choice is not None and self.guided_regex is not None:
            raise ConfigError("guided_choice and guided_regex cannot be combined; give one")
        if self.guided_choice is not None:
            _check_choice("guided_choice", self.guided_choice)
            guided, name = StructuredOutput(choice=list(self.guided_choice)), "guided_choice"
        elif self.guided_regex is not None:
            if not isinstance(self.guided_regex, str):
                raise ConfigError(f"guided_regex must be a string, got {self.guided_regex!r}")
            guided, name = StructuredOutput(regex=self.guided_regex), "guided_regex"
        else:
            return
        if self.structured is None:
            self.structured = guided
        elif self.structured != guided:
            raise ConfigError(
                f"{name} cannot be combined with structured={self.structured!r}; give one"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _check_choice(name: str, value: object) -> None:
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(c, str) for c in value)
    ):
        raise ConfigError(f"{name} must be a non-empty list of strings, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):  # type: ignore[arg-type]
        raise ConfigError(f"{name} must be a finite number, got {value!r}")


@dataclass
class Request:
    """One sequence being generated; progress is `num_computed_tokens` against `num_tokens`."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens its cached prefix blocks held at its first admission (None until admitted;
    # a readmission after preemption does not change it): usage's cached_tokens.
    num_cached_tokens: int | None = None
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
class ToolCall:
    """A tool call parsed from a model's output: the function's name and the JSON text of its
    arguments object exactly as the model wrote it."""

    name: str
    arguments: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt. From LLM.chat, `tool_calls` holds the calls
    parsed from `text` when tools were given (empty when the model answered in prose) and
    `content` the text before the first call (None when nothing precedes it), or the whole text
    when no call was made; `reasoning` the model's reasoning where its format sets it apart
    (gpt-oss's analysis channel), else None; generate() leaves them empty."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None
    reasoning: str | None = None


@dataclass
class RequestOutput:
    """The result for one prompt: its ids and its completion(s)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens reused from the KV prefix cache
