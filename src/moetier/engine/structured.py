"""Structured output: one grammar matcher per constrained request and the token masks they give.

Owns the compiled grammars (llguidance: JSON schemas, Lark grammars, regexes, choices of literal
strings), each constrained request's matcher (advanced with every token the request accepts) and
the batched masking of logits; it never chooses tokens (the sampler does) and costs nothing when
no request of a step is constrained.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from moetier.core import StructuredOutput
from moetier.errors import ConfigError

log = logging.getLogger(__name__)

# JSON is generated compact but readable: one space after ':' and ',', no other whitespace. A
# sampled model is not free to pad the output with newlines until max_tokens runs out.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package: only a broken install lacks it
        raise ConfigError(
            "structured output needs the llguidance package: pip install llguidance"
        ) from exc
    return llguidance


def json_grammar_text(schema: dict[str, Any] | str | bool) -> str:
    """A schema as the inline `%json {...}` of a Lark rule, with JSON_OPTIONS applied."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema)


_COMPILED: dict[str, str] = {}  # spec key -> grammar (the server, admission and start all ask)
_COMPILED_MAX = 256


def compile_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec`; ConfigError naming the problem if the library rejects
    it (an unsupported keyword, a bad regex, a Lark syntax error). Needs no tokenizer."""
    key = json.dumps(
        [spec.json, spec.json_object, spec.grammar, spec.regex, spec.choice], sort_keys=True
    )
    grammar = _COMPILED.get(key)
    if grammar is None:
        grammar = _compile(spec)
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = grammar
    return grammar


def _compile(spec: StructuredOutput) -> str:
    lib = _llguidance()
    what = "JSON schema"
    if spec.grammar is not None:
        grammar, what = lib.LLMatcher.grammar_from_lark(spec.grammar), "grammar"
    elif spec.regex is not None:
        grammar, what = lib.LLMatcher.grammar_from_regex(spec.regex), "regex"
    elif spec.choice is not None:
        grammar, what = lib.LLMatcher.grammar_from_lark(choice_grammar(spec.choice)), "choice"
    else:
        schema = ANY_OBJECT if spec.json_object else spec.json
        assert schema is not None
        try:
            grammar = lib.LLMatcher.grammar_from_lark("start: " + json_grammar_text(schema))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"invalid JSON schema: {exc}") from exc
    error = lib.LLMatcher.validate_grammar(grammar)
    if error:
        raise ConfigError(f"unsupported {what}: {error.strip()}")
    return str(grammar)


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices` (literal strings, JSON-escaped)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMasks:
    """Matchers of the constrained requests; `apply` masks their rows of a step's logits."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._lltok: Any = None  # built on the first constrained request (~1 s for big vocabs)
        self._executor: Any = None
        self._matchers: dict[int, Any] = {}
        self.errors: dict[int, str] = {}  # request id -> why its matcher failed (for the engine)

    def _lltokenizer(self) -> Any:
        if self._lltok is None:
            if self.tokenizer is None:
                raise ConfigError("structured output needs the checkpoint's tokenizer")
            lib = _llguidance()
            import llguidance.hf

            if len(self.tokenizer) > self.vocab_size:
                raise ConfigError(
                    f"the tokenizer has {len(self.tokenizer)} tokens, more than the model's "
                    f"{self.vocab_size}: structured output is not supported for this checkpoint"
                )
            try:
                self._lltok = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None
                )
            except ValueError as exc:  # a slow (pure Python) tokenizer
                raise ConfigError(f"structured output is not supported here: {exc}") from exc
            self._executor = lib.LLExecutor(num_threads=1)
        return self._lltok

    def add(self, request_id: int, spec: StructuredOutput) -> None:
        """Start a matcher for the request; ConfigError if the grammar is rejected."""
        grammar = compile_grammar(spec)
        matcher = _llguidance().LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(f"structured output rejected: {matcher.get_error()}")
        self._matchers[request_id] = matcher

    def apply(self, logits: torch.Tensor, request_ids: list[int]) -> torch.Tensor:
        """logits [N, V] -> the same tensor when no row is constrained, else a copy whose
        constrained rows allow only their grammar's next tokens (one batched masked_fill)."""
        if not self._matchers:
            return logits
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return logits
        matchers = [self._matchers[request_ids[i]] for i in rows]
        words = (self.vocab_size + 31) // 32
        bits = torch.zeros(len(rows), words, dtype=torch.int32)  # [n, ceil(V/32)], host
        self._executor.unsafe_compute_mask_ptr(
            [(m, j) for j, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(rows)
        )
        for j, m in enumerate(matchers):
            if m.is_error():  # no token allowed: leave the row free, the engine fails it
                self.errors[request_ids[rows[j]]] = m.get_error()
                bits[j] = -1
        bits = bits.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool()  # [n, W, 32]
        allowed = allowed.reshape(len(rows), -1)[:, : logits.shape[-1]]  # [n, V]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        return logits.index_copy(0, index, masked)

    def advance(self, request_ids: list[int], tokens: list[int]) -> None:
        """Feed each constrained request its sampled token; a refused token is recorded in
        `errors` (it cannot happen under the mask unless the matcher ran out of resources)."""
        if not self._matchers:
            return
        for rid, tok in zip(request_ids, tokens):
            m = self._matchers.get(rid)
            if m is not None and not m.consume_token(tok):
                self.errors[rid] = m.get_error() or f"token {tok} does not match the grammar"

    def take_errors(self) -> dict[int, str]:
        out, self.errors = self.errors, {}
        return out

    def forget(self, request_id: int) -> None:
        self._matchers.pop(request_id, None)
        self.errors.pop(request_id, None)
