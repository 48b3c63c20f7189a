"""Random JSON schemas for constrained-decoding tests: the shapes tool and response schemas take
(nested objects, arrays, enums, anyOf, $ref, const, bounds, additionalProperties false).

Strings and arrays carry bounds so that every generation ends within its token budget."""

from __future__ import annotations

import random

WORDS = ["city", "name", "count", "items", "unit", "mode", "tags", "price", "when", "note",
         "level", "kind", "target", "limit", "query", "flag", "score", "owner", "size", "id"]


def _leaf(rng: random.Random, defs: dict) -> dict:
    roll = rng.random()
    if roll < 0.22:
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if roll < 0.36:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if roll < 0.46:
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000]), "multipleOf": 0.25}
    if roll < 0.54:
        return {"type": "boolean"}
    if roll < 0.66:
        return {"enum": rng.sample(["red", "green", "blue", "c", "f", "fast", "slow", "x y"], rng.randint(1, 4))}
    if roll < 0.72:
        return {"const": rng.choice(["v1", 3, True])}
    if roll < 0.80:
        return {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer", "minimum": 0,
                                                              "maximum": 99}, {"type": "null"}]}
    if roll < 0.88 and defs:
        return {"$ref": f"#/$defs/{rng.choice(list(defs))}"}
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}


def _object(rng: random.Random, depth: int, defs: dict) -> dict:
    keys = rng.sample(WORDS, rng.randint(1, 4))
    props = {}
    for k in keys:
        if depth > 0 and rng.random() < 0.25:
            props[k] = _object(rng, depth - 1, defs)
        elif depth > 0 and rng.random() < 0.15:
            props[k] = {"type": "array", "items": _object(rng, depth - 1, defs),
                        "minItems": 1, "maxItems": 2}
        else:
            props[k] = _leaf(rng, defs)
    required = [k for k in keys if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def random_schema(rng: random.Random) -> dict:
    defs = {}
    if rng.random() < 0.4:
        defs["point"] = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}
    schema = _object(rng, 2, defs)
    if defs:
        schema["$defs"] = defs
    return schema
