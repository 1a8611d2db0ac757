"""The fingerprint's bytes are pinned: a change here would orphan every stored record."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobtrail import UsageError, ValidatedResult
from jobtrail.domain.canonical import (
    MAX_ANSWER_DEPTH,
    _write,
    canonical_json,
    compact_json,
    es_number,
    floatless_json,
    nesting,
    parse_answer,
    parse_json,
    request_fingerprint,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({"b": 1, "a": [True, None, "x"]}, '{"a":[true,null,"x"],"b":1}'),
        ({"é": "ü", "a\n": "\u2028"}, '{"a\\n":"\u2028","é":"ü"}'),
        ({"n": 2.0, "m": -0.0, "big": 10**30}, '{"big":1000000000000000000000000000000,"m":0,"n":2}'),
        ([1e21, 1e20, 1e-7, 1e-6, 0.1, 5e-324], "[1e+21,100000000000000000000,1e-7,0.000001,0.1,5e-324]"),
        ('quote"back\\slash', '"quote\\"back\\\\slash"'),
    ],
)
def test_canonical_json_golden_vectors(value: object, text: str) -> None:
    assert canonical_json(value) == text


def test_fingerprint_golden_vectors() -> None:
    assert (
        request_fingerprint(
            "openai",
            "org-1",
            "POST /v1/batches",
            {
                "input_file_id": "file-abc",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"k": "é"},
            },
        )
        == "83b038308c9ac1ded453b6887d331e112fbdecee728b70148f5f4507a5ac6e7b"
    )
    assert request_fingerprint("fake", "t", "POST /v1/jobs", {"n": 3, "x": 1.5, "b": [True, None]}) == (
        "7b20f56344e729a91f900575ac70e13a97738a88e71285cafe07f123c0571dff"
    )


def test_fingerprint_ignores_key_order_and_integral_float_spelling() -> None:
    a = request_fingerprint("p", "t", "e", {"x": 1.5, "n": 3})
    assert a == request_fingerprint("p", "t", "e", {"n": 3.0, "x": 1.5})


@pytest.mark.parametrize("field", ["provider", "target", "endpoint", "body"])
def test_fingerprint_changes_with_every_part(field: str) -> None:
    parts = {"provider": "p", "target": "t", "endpoint": "e", "body": {"a": 1}}
    changed = {**parts, field: {"a": 2} if field == "body" else "other"}
    assert request_fingerprint(**parts) != request_fingerprint(**changed)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {1: "int key"}, b"bytes", {"s": {1, 2}}])
def test_values_without_a_json_form_are_refused(bad: object) -> None:
    with pytest.raises(UsageError):
        canonical_json(bad)


def test_es_number_matches_ecmascript() -> None:
    assert [es_number(x) for x in (123456789012345680000.0, 1.7976931348623157e308, -2.5, 100.0)] == [
        "123456789012345680000",
        "1.7976931348623157e+308",
        "-2.5",
        "100",
    ]


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from('\x00\x1f\x7f\u2028\ud800"\\')),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def _json_module(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@settings(max_examples=400, deadline=None)
@given(_JSON_VALUES)
def test_stored_json_is_what_the_json_module_writes(value: object) -> None:
    """Every stored document and hashed row is written by orjson where it can: the same bytes as before,
    whatever the value (NaN still refused, huge integers, lone surrogates, floats with exponents)."""
    try:
        expected = _json_module(value)
    except ValueError:
        with pytest.raises(ValueError):
            compact_json(value)
        return
    assert compact_json(value) == expected


@settings(max_examples=400, deadline=None)
@given(_JSON_VALUES)
def test_canonical_json_is_the_same_on_every_path(value: object) -> None:
    """The fast path (orjson, no floats) and the writer by hand agree byte for byte."""
    parts: list[str] = []
    try:
        _write(value, parts)
    except UsageError:
        with pytest.raises(UsageError):
            canonical_json(value)
        return
    assert canonical_json(value) == "".join(parts)


_FLOATLESS = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_FLOATLESS)
def test_entries_and_seals_are_written_as_compact_json_writes_them(value: object) -> None:
    assert floatless_json(value) == compact_json(value)


def test_a_value_that_contains_itself_is_refused_not_walked_forever() -> None:
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(ValueError, match="Circular"):
        compact_json(looped)
    deep: object = "x"
    for _ in range(300):
        deep = [deep]
    assert compact_json(deep) == _json_module(deep)  # past orjson's depth, json writes it as before


def test_an_answer_nested_past_every_parsers_depth_is_an_error_not_a_crash() -> None:
    # orjson stops at 1,024 levels and json then runs out of stack: a provider's answer is data, and
    # each caller handles a ValueError (an unparsed body, a failed check), where a RecursionError escaped
    deep = b"[" * 5000 + b"]" * 5000
    with pytest.raises(ValueError, match="nested too deep"):
        parse_json(deep)
    with pytest.raises(ValueError, match="nested too deep"):
        parse_json(deep.decode())


@pytest.mark.parametrize("value", [{"t": datetime.now(UTC)}, {"d": ValidatedResult(sha256="0" * 64, size=1)}])
def test_what_json_refuses_stays_refused(value: object) -> None:
    """orjson would write datetimes and dataclasses; the ledger's encoder refuses them as json does."""
    for encode in (compact_json, floatless_json):
        with pytest.raises(TypeError):
            encode(value)


def _typed(value: object) -> object:
    """``value`` with every number tagged by its type: 1 and 1.0 compare equal, but are not the same JSON."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


@settings(max_examples=400, deadline=None)
@given(
    _JSON_VALUES,
    st.sampled_from([(",", ":"), (", ", ": ")]),
    st.booleans(),
    st.booleans(),
)
def test_a_provider_answer_parses_exactly_as_the_json_module_reads_it(
    value: object, separators: tuple[str, str], ascii_only: bool, as_bytes: bool
) -> None:
    """Answers are parsed by orjson where it reads them as json does: the same values, an integer
    past 64 bits still an integer, NaN and Infinity still refused, lone surrogates still read."""
    text = json.dumps(value, separators=separators, ensure_ascii=ascii_only)
    data: str | bytes = text.encode("utf-8", "surrogatepass") if as_bytes else text
    try:
        expected = json.loads(data, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except ValueError:
        with pytest.raises(ValueError):
            parse_json(data)
        return
    assert _typed(parse_json(data)) == _typed(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123456789012345678901234567890", 123456789012345678901234567890),
        ('{"n": 18446744073709551616}', {"n": 18446744073709551616}),
        ('{"n": -9223372036854775809}', {"n": -9223372036854775809}),
        ('"\\ud800"', "\ud800"),
        ("-0", 0),
    ],
)
def test_what_orjson_would_read_differently_is_read_by_json(text: str, expected: object) -> None:
    assert _typed(parse_json(text)) == _typed(expected)
    assert _typed(parse_json(text.encode())) == _typed(expected)


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a": -Infinity}'])
def test_nan_and_infinity_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not JSON"):
        parse_json(text)


@pytest.mark.parametrize(
    "text", ["1e999", "[1e400]", '{"a": -1.8e308}', b'{"a": 1e999}', '{"pad": "\\u00e9", "a": 2e308}']
)
def test_a_number_past_a_64_bit_floats_range_is_refused_not_read_as_infinity(text: str | bytes) -> None:
    """Python would read infinity, which no write can store and no fingerprint can hash: an answer holding
    one failed its write (a create's answer lost, a status answer polled again and again)."""
    with pytest.raises(ValueError, match="past a 64-bit float's range"):
        parse_json(text)
    assert parse_json("[1.7976931348623157e308, 1e-400]") == [1.7976931348623157e308, 0.0]  # the edges still read


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b'{"status": "running", "status": "succeeded"}', "names the same key twice"),
        (b'{"a": {"id": 1, "id": 2}}', "names the same key twice"),
        (b'{"id": "a\\ud800b"}', "lone surrogate"),
        (b'["\\udc00"]', "lone surrogate"),
        ('{"id": "a\ud800b"}', "lone surrogate"),  # a str holding one, not as an escape
        (b"[" * (MAX_ANSWER_DEPTH + 1) + b"]" * (MAX_ANSWER_DEPTH + 1), "nested deeper than"),
        (b'{"a": 1e999}', "past a 64-bit float's range"),
    ],
)
def test_an_answer_that_parsers_read_differently_or_no_ledger_can_hold_is_refused(text: str | bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_answer(text)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32-be"])
def test_an_answer_in_utf_16_or_32_is_checked_as_its_text_not_its_bytes(encoding: str) -> None:
    """json reads these encodings; counted as bytes, an honest answer looked like a key named twice, and in
    UTF-16 the character U+3A22 (the bytes '":') made up for a key that was."""
    assert parse_answer('{"id": "job_1"}'.encode(encoding)) == {"id": "job_1"}
    with pytest.raises(ValueError, match="same key twice"):
        parse_answer('{"status": "failed", "status": "succeeded", "x": "\u3a22\u3a22"}'.encode(encoding))


def test_an_answer_as_deep_as_allowed_with_surrogate_pairs_and_repeated_names_in_strings_is_read() -> None:
    deep = b'{"a": ' * MAX_ANSWER_DEPTH + b"1" + b"}" * MAX_ANSWER_DEPTH
    assert nesting(deep) == MAX_ANSWER_DEPTH and parse_answer(deep)
    text = b'{"note": "\\"id\\": 1, \\"id\\": 2 [[[[", "smile": "\\ud83d\\ude00", "id": "job-1"}'
    assert parse_answer(text) == {"note": '"id": 1, "id": 2 [[[[', "smile": "\U0001f600", "id": "job-1"}


_pieces = st.text(alphabet='ab":\\{}[], \u00e9', max_size=4)
_spaces = st.sampled_from(["", " ", "\n\t ", "\r\n"])
_trees = st.recursive(
    st.one_of(_pieces, st.integers(-5, 5), st.booleans(), st.none()),
    lambda inner: (
        st.lists(inner, max_size=3).map(lambda xs: ("list", xs))
        | st.lists(st.tuples(st.sampled_from(["a", "b", 'a"', "a:", "\\", ""]) | _pieces, inner), max_size=4).map(
            lambda pairs: ("object", pairs)
        )
    ),
    max_leaves=10,
)


def _render(tree: object, space: str) -> str:
    """JSON text by hand: an object may name a key twice, and the spacing is the generator's."""
    if isinstance(tree, tuple) and tree[0] == "list":
        return "[" + f",{space}".join(_render(x, space) for x in tree[1]) + "]"
    if isinstance(tree, tuple) and tree[0] == "object":
        return "{" + f",{space}".join(f"{json.dumps(k)}{space}:{space}{_render(v, space)}" for k, v in tree[1]) + "}"
    return json.dumps(tree)


@settings(max_examples=300)
@given(tree=_trees, space=_spaces)
def test_an_answer_is_refused_for_a_key_named_twice_exactly_when_the_pairs_show_one(tree: object, space: str) -> None:
    """parse_answer counts the keys its text names against the entries it read (a fast check); the pairs,
    read in order, are the truth it must agree with, whatever the strings hold (quotes, colons, escapes)."""
    from jobtrail.domain.canonical import names_a_key_twice

    text = _render(tree, space)
    twice = names_a_key_twice(text)
    try:
        parse_answer(text.encode())
    except ValueError as exc:
        assert twice and "same key twice" in str(exc), text
    else:
        assert not twice, text
