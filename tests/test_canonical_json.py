"""canonical_json, the text every event's chain hash and every state's sha256 is taken over, is
written by msgspec where it writes what json.dumps(sort_keys=True, separators=(",", ":"),
ensure_ascii=False, allow_nan=False) writes, and by json elsewhere. A stored hash, a receipt's
source_state_sha256 and a hash a user computes with the standard library must keep agreeing, so
the two are held byte-for-byte equal here: over every code point, floats of every magnitude, and
generated JSON values.
"""
from __future__ import annotations

import json
import math
import struct
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  (the module under test, imported from the checkout)


def reference(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def test_every_code_point_is_written_as_json_writes_it():
    for start in range(0, 0x110000, 0x800):
        text = "".join(chr(c) for c in range(start, start + 0x800) if not 0xD800 <= c <= 0xDFFF)
        assert actae.canonical_json({text: text}) == reference({text: text}), hex(start)


def test_floats_of_every_magnitude_are_written_as_json_writes_them():
    for exponent in range(-324, 309):
        for mantissa in (1.0, 1.5, 2.2250738585072014, 4.9406564584124654, 9.999999999999998):
            value = mantissa * 10.0 ** exponent if exponent < 308 else mantissa * 1e308 / 10
            if math.isfinite(value):
                for number in (value, -value):
                    assert actae.canonical_json([number, {"k": number}]) == reference([number, {"k": number}])
    for bits in range(0, 2 ** 64, 2 ** 64 // 20011):        # spread over every float's bit pattern
        number = struct.unpack("<d", struct.pack("<Q", bits))[0]
        if math.isfinite(number):
            assert actae.canonical_json(number) == reference(number), repr(number)


@pytest.mark.parametrize("value", [
    "\ud800 a lone surrogate", {"key": "\udfff"},            # json writes them, msgspec refuses
    {1: "an int key", 2: "sorted as numbers"},              # json sorts and stringifies them
    {"b": None, "a": [None, True, False, 0, -0.0, 5.0]},     # null is written by json: it may be NaN
    {"text": "version 0.00001, e-mail e5"},                 # text that looks like a float in exponent form
    (1, [2, (3,)]), 2 ** 64, -(2 ** 63), 10 ** 40,
])
def test_values_msgspec_writes_otherwise_or_refuses_are_written_by_json(value):
    assert actae.canonical_json(value) == reference(value)


@pytest.mark.parametrize("value", [float("nan"), {"x": float("inf")}, [-float("inf")], {"x": object()}])
def test_what_json_refuses_is_refused(value):
    with pytest.raises((ValueError, TypeError)):
        reference(value)
    with pytest.raises((ValueError, TypeError)):
        actae.canonical_json(value)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=40)


@settings(max_examples=1500, deadline=None, database=None)
@given(JSON_VALUES)
def test_generated_json_values_are_written_as_json_writes_them(value):
    assert actae.canonical_json(value) == reference(value)
