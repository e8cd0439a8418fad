"""A config given as a JSON object on the command line (--speculative-config,
--kv-transfer-config) or as a dict in Python: parsed and checked against the dataclass's fields,
so that a typo is a ValueError naming the flag and the field rather than a TypeError."""

from __future__ import annotations

import dataclasses
import json


def json_object(value, name: str) -> dict:
    """value: JSON text or a dict -> the dict; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def fields_from_json(value, cls, name: str) -> dict:
    """value: JSON text, a dict, or a `cls` instance -> a dict of cls's fields (unknown ones refused)."""
    if isinstance(value, cls):
        return dict(value.__dict__)
    value = json_object(value, name)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    return value


def read_json_object(path: str, name: str) -> dict:
    """The JSON object in the file at `path`; ValueError starting with `name` when it is unreadable,
    not JSON, or not an object."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must hold a JSON object")
    return value
