"""JSON text exactly as `json.dumps(doc, indent=2)` writes it, several times faster.

With `indent`, the standard library encodes in pure Python, one generator per
nesting level: the native discovery document of a large host (3,000 mdev
types, 1.4 MB) spends more time there than in reading sysfs. Here the
containers that hold only scalars (almost all of them: a type, a vGPU, a VF,
an address) go through the C encoder in one call, with the newline and
indentation of their depth as the item separator; only the few containers
above them are walked in Python. The text is byte for byte what
`json.dumps(doc, indent=2)` gives (a property test holds the two together).
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

_SCALARS = frozenset({str, int, float, bool, type(None)})


class _NotPlain(Exception):
    """A container this module does not render itself (a key that is not a string)."""


# depth -> an encoder whose item separator starts a line at that depth
_ENCODERS: dict[int, Callable[[Any], str]] = {}


def _encoder(depth: int) -> Callable[[Any], str]:
    enc = _ENCODERS.get(depth)
    if enc is None:
        enc = _ENCODERS[depth] = _make_encoder(",\n" + "  " * depth)
    return enc


def _make_encoder(item_separator: str) -> Callable[[Any], str]:
    std = json.JSONEncoder(separators=(item_separator, ": "))
    # The C encoder object itself, made once: `JSONEncoder.encode` makes a new
    # one per call, which costs more than encoding a small container. It is
    # what `encode` would use, with the same arguments (no cycle check: the
    # containers given here hold only scalars).
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return std.encode
    try:
        c_enc = make(None, std.default, json.encoder.encode_basestring_ascii, None, ": ",
                     item_separator, False, False, True)
    except TypeError:  # another signature: the public way
        return std.encode

    def encode(obj: Any) -> str:
        return "".join(c_enc(obj, 0))

    return encode


def _flat(values: Any) -> bool:
    return all(type(v) in _SCALARS for v in values)


def _write(obj: Any, depth: int, out: list[str]) -> None:
    if isinstance(obj, dict):
        if not obj:
            out.append("{}")
            return
        inner = "\n" + "  " * (depth + 1)
        if _flat(obj.values()):
            # '{"a": 1,<inner>"b": 2}' from C; its braces get their own lines.
            text = _encoder(depth + 1)(obj)
            out.append("{" + inner + text[1:-1] + "\n" + "  " * depth + "}")
            return
        sep = "{" + inner
        for key, value in obj.items():
            if type(key) is not str:
                raise _NotPlain
            out.append(sep + json.encoder.encode_basestring_ascii(key) + ": ")
            sep = "," + inner
            _write(value, depth + 1, out)
        out.append("\n" + "  " * depth + "}")
    elif isinstance(obj, (list, tuple)):
        if not obj:
            out.append("[]")
            return
        inner = "\n" + "  " * (depth + 1)
        if _flat(obj):
            text = _encoder(depth + 1)(list(obj))
            out.append("[" + inner + text[1:-1] + "\n" + "  " * depth + "]")
            return
        if all(type(v) is dict and v and _flat(v.values()) for v in obj):
            # Dicts of scalars (a GPU's types, vGPUs, VFs) in one C call, their
            # items separated at depth + 2. Where one dict ends and the next
            # begins ("},<newline><indent>{": encoded text never holds a raw
            # newline, so nowhere else) go the line breaks of depth + 1.
            outer = "\n" + "  " * (depth + 1)
            inner = outer + "  "
            text = _encoder(depth + 2)(list(obj))
            body = text[2:-2].replace("}," + inner + "{", outer + "}," + outer + "{" + inner)
            out.append("[" + outer + "{" + inner + body + outer + "}\n" + "  " * depth + "]")
            return
        sep = "[" + inner
        for value in obj:
            out.append(sep)
            sep = "," + inner
            _write(value, depth + 1, out)
        out.append("\n" + "  " * depth + "]")
    else:
        out.append(_encoder(0)(obj))


def dumps(doc: Any) -> str:
    """`json.dumps(doc, indent=2)`, the same text (documents without cycles)."""
    out: list[str] = []
    try:
        _write(doc, 0, out)
    except _NotPlain:
        return json.dumps(doc, indent=2)
    return "".join(out)
