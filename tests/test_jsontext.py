"""gpulib.jsontext writes the text json.dumps(doc, indent=2) writes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import jsontext

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(),
                    st.floats(allow_nan=True, allow_infinity=True))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=40)


@settings(max_examples=300)
@given(documents)
def test_same_text_as_the_standard_library(doc: Any) -> None:
    assert jsontext.dumps(doc) == json.dumps(doc, indent=2)


@given(st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none()),
                       st.lists(scalars, max_size=3), min_size=1, max_size=4))
def test_keys_that_are_not_strings_as_the_standard_library(doc: dict[Any, Any]) -> None:
    outer = {"x": [doc, {"y": doc}]}
    assert jsontext.dumps(outer) == json.dumps(outer, indent=2)


def test_non_ascii_and_control_characters_are_escaped() -> None:
    doc = {"name": "GRID \u00e9\x1b[31m\u2028", "list": ["\x00", "\ud83d"], "empty": {}}
    text = jsontext.dumps(doc)
    assert text == json.dumps(doc, indent=2)
    assert text.isascii() and "\x1b" not in text


@pytest.mark.parametrize("doc", [{"a": {1, 2}}, [object()], {"a": [{"b": b"bytes"}]}],
                         ids=["set", "object", "bytes"])
def test_unencodable_values_are_refused_as_by_the_standard_library(doc: Any) -> None:
    with pytest.raises(TypeError) as std:
        json.dumps(doc, indent=2)
    with pytest.raises(TypeError) as ours:
        jsontext.dumps(doc)
    assert str(ours.value) == str(std.value)
