"""Schemas for structured-output and tool tests: two bounded tools, and random JSON schemas
from a seeded generator.

Every schema is strict (all properties required, no others) and bounded (short strings, small
arrays, integer ranges), so a valid answer always fits in a few dozen tokens.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "city", "count", "tags", "ok", "score", "kind", "items", "id", "note", "level"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "number", "boolean", "string", "enum", "nullable"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(2, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "yes", "no"], 3)}
    return {"type": ["string", "null"], "maxLength": 6}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 1-4 properties: leaves, short arrays and (once) a nested object."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    props: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if roll < 0.15 and depth == 0:
            props[name] = random_schema(rng, depth + 1)
        elif roll < 0.3:
            props[name] = {"type": "array", "items": _leaf(rng), "minItems": 0, "maxItems": 3}
        else:
            props[name] = _leaf(rng)
    return {
        "type": "object",
        "properties": props,
        "required": names,
        "additionalProperties": False,
    }


def random_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]


WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "Weather in Paris this week?"}]
