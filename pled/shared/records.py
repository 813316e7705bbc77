"""Frozen dataclasses read back from untrusted JSON (a region's manifest): exactly their fields, each of its type.

A record's field types are read from the dataclass itself (as strings: its module postpones annotations), so the
manifest's schema is written once, where the record is defined.
"""
from __future__ import annotations

import dataclasses
import json

from pled.shared.boundary import clip, in_time

_INT_LISTS = ("tuple[int, ...]", "tuple[int, int]")
_WANT = {"int": "an integer", "str": "a string", "tuple[str, ...]": "a list of strings",
         **{kind: "a list of integers" for kind in _INT_LISTS}}
_schemas: dict[type, tuple[dict[str, str], set[str]]] = {}


def _schema(cls: type) -> tuple[dict[str, str], set[str]]:
    if cls not in _schemas:
        fields = dataclasses.fields(cls)
        _schemas[cls] = ({f.name: str(f.type) for f in fields},
                         {f.name for f in fields if f.default is dataclasses.MISSING})
    return _schemas[cls]


def _all_of(values: list, kind: type) -> bool:
    """Every item of ``values`` exactly a ``kind``, the deadline looked at every 65,536 (a column of a million)."""
    for at in range(0, len(values), 65536):
        in_time()
        if not all(type(v) is kind for v in values[at:at + 65536]):
            return False
    return True


def fields_of(doc: object, cls: type, what: str) -> dict:
    """``doc`` if it is an object with exactly ``cls``'s fields (those with a default may be left out), each of its
    type: ints are ints (not booleans or floats), strings strings, tuples lists (of ints, for a shape or a range);
    ValueError says what is wrong, naming ``what``. Costs O(size of doc); boundary.OutOfTime past a deadline."""
    in_time(256)
    if type(doc) is not dict:
        raise ValueError(f"has {what} as {type(doc).__name__}, not an object")
    kinds, required = _schema(cls)
    if not required <= doc.keys() <= kinds.keys():
        unknown = [k for k in doc if k not in kinds]
        if unknown:
            raise ValueError(f"has an unknown key {clip(unknown[0], 80)!r} in {what}")
        raise ValueError(f"has no {sorted(required - doc.keys())[0]!r} in {what}")
    for key, value in doc.items():
        kind = kinds[key]
        if kind in ("int", "str"):
            ok = type(value) is (int if kind == "int" else str)
        else:
            want = int if kind in _INT_LISTS else str if kind == "tuple[str, ...]" else None
            ok = type(value) is list and (want is None or _all_of(value, want))
            if kind == "tuple[int, int]":
                ok = ok and len(value) == 2
        if not ok:
            raise ValueError(f"has {key} as {clip(json.dumps(value), 60)} in {what}, not {_WANT.get(kind, 'a list')}")
    return doc
