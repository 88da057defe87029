"""Hypothesis strategies from the JSON Schema subset FastAPI publishes in /openapi.json.

Covers $ref, anyOf, object (properties, required), array (items, minItems), string (minLength,
maxLength, enum, const), integer and number (minimum, maximum, exclusive bounds), boolean and
null. Optional properties are included at random; unknown properties are sometimes added (the
models ignore them). Values stay inside the schema, so the server's own checks past the schema
(model name, context length, vocabulary) are what the fuzz reaches.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Schema = dict[str, Any]


def from_openapi(schema: Schema, components: Schema) -> st.SearchStrategy[Any]:
    return _strategy(schema, components, depth=0)


def _strategy(s: Schema, comps: Schema, depth: int) -> st.SearchStrategy[Any]:
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return _strategy(comps["schemas"][name], comps, depth + 1)
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    if "anyOf" in s:
        return st.one_of([_strategy(x, comps, depth) for x in s["anyOf"]])
    kind = s.get("type")
    if kind == "object" or "properties" in s:
        return _object(s, comps, depth)
    if kind == "array":
        items = _strategy(s.get("items", {}), comps, depth + 1) if depth < 6 else st.integers()
        return st.lists(items, min_size=s.get("minItems", 0), max_size=s.get("maxItems", 4))
    if kind == "string":
        return st.text(min_size=s.get("minLength", 0), max_size=s.get("maxLength", 24))
    if kind == "integer":
        lo = s.get("minimum", s.get("exclusiveMinimum", -(2**70) - 1) + 1)
        hi = s.get("maximum", s.get("exclusiveMaximum", 2**70 + 1) - 1)
        edges = st.sampled_from([lo, hi, 0, 1, 2**63, 2**64]).filter(lambda v: lo <= v <= hi)
        return st.one_of(st.integers(lo, hi), st.integers(max(lo, -3), min(hi, 64)), edges)
    if kind == "number":
        return st.floats(
            min_value=s.get("minimum", s.get("exclusiveMinimum")),
            max_value=s.get("maximum", s.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in s,
            exclude_max="exclusiveMaximum" in s,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none() | st.booleans() | st.integers() | st.text(max_size=8)


def _object(s: Schema, comps: Schema, depth: int) -> st.SearchStrategy[dict[str, Any]]:
    props: Schema = s.get("properties", {})
    required = set(s.get("required", []))
    fields = {k: _strategy(v, comps, depth + 1) for k, v in props.items()}
    req = st.fixed_dictionaries({k: fields[k] for k in props if k in required})
    opt = st.fixed_dictionaries({}, optional={k: fields[k] for k in props if k not in required})
    extra = st.dictionaries(st.text(min_size=1, max_size=6), st.integers() | st.text(max_size=4),
                            max_size=2)  # fmt: skip
    return st.builds(lambda a, b, c: {**c, **b, **a}, req, opt, extra)
