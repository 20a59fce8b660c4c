"""The state file's text: a JSON document as `json.dumps(doc, sort_keys=True,
indent=1, ensure_ascii=True, allow_nan=False)` writes it, byte for byte, in a
third of the time (every VM start writes the state file).

The same idea as `gpulib.jsontext` (discovery's indent-2 documents): the
containers that hold only scalars go through json's C encoder in one call;
only the few containers above them are walked in Python.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_string

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _Unusual(Exception):
    """A value json.dumps renders in a way `_render` does not (a non-text key)."""


_INFINITY = float("inf")


_SCALARS = frozenset({str, int, float, bool, type(None)})
_FLAT_ENCODERS: dict[str, json.JSONEncoder] = {}


def _flat_encoder(inner: str) -> json.JSONEncoder:
    """json's C encoder (used when indent is None) rendering a flat container's
    items one per line at `inner`."""
    encoder = _FLAT_ENCODERS.get(inner)
    if encoder is None:
        encoder = json.JSONEncoder(sort_keys=True, ensure_ascii=True, allow_nan=False,
                                   separators=(",\n" + inner, ": "))
        _FLAT_ENCODERS[inner] = encoder
    return encoder


def _render(value: Any, indent: str) -> str:
    """`value` as json.dumps(sort_keys=True, indent=1, ensure_ascii=True,
    allow_nan=False) renders it, nested at `indent`. Python's json renders an
    indented document in pure Python, one generator per level: this does the
    same in a third of the time, and every VM start writes the state file."""
    if isinstance(value, str):
        return _json_string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value or value == _INFINITY or value == -_INFINITY:
            raise ValueError("Out of range float values are not JSON compliant: "
                             + repr(value))
        return float.__repr__(value)
    inner = indent + " "
    if isinstance(value, dict):
        if not value:
            return "{}"
        if not all(type(k) is str for k in value):
            raise _Unusual()
        if all(type(v) in _SCALARS for v in value.values()):
            # A record of plain values (most of the file): one call into the C
            # encoder, whose item separator carries the newline and indent.
            flat = _flat_encoder(inner).encode(value)
            return "{\n" + inner + flat[1:-1] + "\n" + indent + "}"
        return "{\n" + inner + (",\n" + inner).join(
            [_json_string(k) + ": " + _render(v, inner) for k, v in sorted(value.items())]
        ) + "\n" + indent + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        return "[\n" + inner + (",\n" + inner).join([_render(v, inner) for v in value]) \
            + "\n" + indent + "]"
    raise _Unusual()


def render_json(doc: Any) -> str:
    """The state file's text of a JSON document (sorted keys, ASCII, indent 1,
    a final newline): byte for byte what json.dumps gives."""
    try:
        return _render(doc, "") + "\n"
    except (_Unusual, RecursionError):
        # Whatever json.dumps does with it (converts, or raises TypeError).
        return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True,
                          allow_nan=False) + "\n"

