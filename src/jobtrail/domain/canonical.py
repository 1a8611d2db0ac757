"""Canonical JSON bytes, the request fingerprint and the time format we hash.

The encoding is the subset of RFC 8785 (JCS) we can state in three rules:

* objects have string keys sorted by Unicode code point, no whitespace
  anywhere, strings escaped as ``json.dumps(ensure_ascii=False)`` does, UTF-8;
* integers are written in full; ``true``/``false``/``null`` as usual;
* floats must be finite and are written as ECMAScript writes numbers
  (shortest round-trip digits; an integral float below 1e21 has no fraction,
  so ``2.0`` and ``2`` encode alike; exponent form outside 1e-6..1e21).

NaN and infinities are refused: they have no JSON form.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

import orjson

from jobtrail.domain.errors import UsageError

FINGERPRINT_VERSION = "jobtrail/request/v1"
_FLAT = frozenset({str, int, bool, type(None)})
_FLAT_OR_FLOAT = _FLAT | {float}
_CONSTANTS = {None: "null", True: "true", False: "false"}
#: one encoder for every write (json.dumps with options builds a new one per call)
_COMPACT = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
#: datetimes and dataclasses are refused (as json refuses them), not written
_ORJSON_SORTED = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
#: deeper than this, json decides (orjson stops at 255; a value that contains itself never ends)
_PLAIN_DEPTH = 200
#: a number orjson might read as a float where json reads an integer (2**63 has 19 digits)
#: every byte to "." but the digits, which become "0": a run of 19 digits is then a plain substring, found at
#: a fiftieth of a regex search's cost (0.9 ms for a 64 KiB result)
_DIGITS_AS_ZEROS = bytes(ord("0") if ord("0") <= b <= ord("9") else ord(".") for b in range(256))
_NINETEEN_DIGITS = b"0" * 19
#: orjson writes integers in this range; a larger one goes to the json module
_I64 = (-(2**63), 2**64 - 1)


def canonical_json(value: Any) -> str:
    """Return the canonical text of ``value`` (see the module docstring)."""
    if _plain(value, False):  # no float anywhere: orjson writes exactly the canonical bytes
        return _orjson(value)
    if type(value) is dict and all(type(k) is str for k in value):
        types = {type(v) for v in value.values()}
        if types <= _FLAT:
            # a flat object without floats (the ledger's rows): the C encoder writes exactly these bytes
            return compact_json(value)
        if types <= _FLAT_OR_FLOAT:  # a row with a float (a progress): only the floats need writing by hand
            return "{" + ",".join(f"{encode_basestring(k)}:{_scalar(v)}" for k, v in sorted(value.items())) + "}"
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts)


def canonical_bytes(value: Any) -> bytes:
    return canonical_json(value).encode("utf-8")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        # Python reads it as infinity, orjson and Go refuse it, JavaScript reads Infinity, a decimal reader
        # keeps it: no reading of it is shared, and an infinity can be neither stored nor fingerprinted
        raise ValueError(
            f"the number {literal[:40]} is past a 64-bit float's range: JSON readers disagree on its value "
            "(infinity, an error, the decimal itself)"
        )
    return value


def parse_json(text: str | bytes) -> Any:
    """Parse JSON from outside (providers, webhooks, results) strictly: ``NaN``/``Infinity`` are refused,
    and so is a number past a 64-bit float's range (``1e999``), which Python reads as infinity.

    Python's parser accepts them, but nothing that holds them can be stored or fingerprinted.

    Every provider answer is parsed here, so orjson (several times faster) parses what it parses
    exactly as ``json`` does; whatever it refuses (NaN, lone surrogates, other encodings, too deep)
    goes to ``json``, and so does any text with a run of 19 digits or more: orjson turns an integer
    past 64 bits into a float, where ``json`` keeps it exact.
    """
    data = text.encode("utf-8", errors="surrogatepass") if isinstance(text, str) else bytes(text)
    digits = data.translate(_DIGITS_AS_ZEROS)  # (beyond ASCII, UTF-8 has no byte below 128)
    if _NINETEEN_DIGITS not in digits:
        try:
            return orjson.loads(text)
        except (ValueError, TypeError):
            pass
    # Python reads no integer of more digits than its limit (4300 unless set otherwise), and its refusal tells
    # the reader to raise the limit: sent back to whoever sent the text, that is advice about our interpreter.
    # Only a text with so long a run of digits gets a reader of its own, which says what is wrong with the text
    limit = sys.get_int_max_str_digits()
    whole = _whole if limit and b"0" * (limit + 1) in digits else None
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite, parse_int=whole)
    except RecursionError:  # a provider's answer is data: an error any caller handles, not a crash
        raise ValueError(_TOO_DEEP) from None


def _whole(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:  # (the scanner hands over a sign and digits only: nothing but their count is refused)
        raise ValueError(
            f"a number with more than {sys.get_int_max_str_digits()} digits ({len(literal.lstrip('-'))}): "
            "too long to be read as a number"
        ) from None


#: the deepest a provider's answer or a webhook may nest: far past any API's answers, and far short of the
#: depth at which what follows the parse (canonical JSON, redaction, the pipe to the writer process) recurses
#: past Python's limit (arrays some 950 deep failed every write of an answer that parse_json had read)
MAX_ANSWER_DEPTH = 128
#: a JSON string (the loop unrolled: a third of the time of one alternation per character)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: each string, and after a key the colon that makes it one (found: b":"; else b"")
_STRING_OR_KEY = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"[ \t\n\r]*(:?)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_RAW_SURROGATE = re.compile(b"\xed[\xa0-\xbf]")


def nesting(text: str | bytes) -> int:
    """How deep a JSON text nests, without parsing it (no recursion, linear time)."""
    data = text.encode("utf-8", errors="surrogatepass") if isinstance(text, str) else bytes(text)
    depth = deepest = 0
    for b in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        if b in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def parse_answer(text: str | bytes) -> Any:
    """:func:`parse_json` for what a provider answers (and a webhook carries): what the flows act on and
    the ledger stores. Refused besides (``ValueError``, saying why; the answer is then unreadable):

    - an object that names a key twice: this parser keeps the last value, others the first or refuse
      it, so a job could be declared succeeded, or given another job's id, on a reading that another
      parser would not share;
    - a lone surrogate (``"\\ud800"``): no UTF-8 text holds it, so no ledger could store the answer;
    - nesting past :data:`MAX_ANSWER_DEPTH`.
    """
    if not isinstance(text, str) and (encoding := json.detect_encoding(text)) not in ("utf-8", "utf-8-sig"):
        # UTF-16 or -32, which json reads: the checks below read UTF-8 (in UTF-16, U+3A22 is the bytes '":')
        text = bytes(text).decode(encoding, errors="surrogatepass")
    data = text.encode("utf-8", errors="surrogatepass") if isinstance(text, str) else bytes(text)
    # (as many brackets as that, strings included, cannot nest deeper: most answers are not looked at twice)
    if data.count(b"[") + data.count(b"{") > MAX_ANSWER_DEPTH and nesting(data) > MAX_ANSWER_DEPTH:
        raise ValueError(f"nested deeper than {MAX_ANSWER_DEPTH} levels")
    value = parse_json(data)
    # every key the text names makes an entry, unless its object named it already: fewer entries than
    # names is a key named twice (the strings are read in order, so each match is a whole string)
    names = _STRING_OR_KEY.findall(data)
    if len(names) - names.count(b"") != _entries(value):
        raise ValueError("an object names the same key twice (parsers disagree on which value counts)")
    # orjson reads no lone surrogate: only what json read may hold one, as an escape or as a str's own
    # character (which surrogatepass wrote as the bytes ED A0-BF, never found in UTF-8)
    if (b"\\u" in data or _RAW_SURROGATE.search(data)) and holds_lone_surrogate(value):
        raise ValueError("a lone surrogate (\\ud800-\\udfff), which no UTF-8 text can hold")
    return value


def _entries(value: Any) -> int:
    """How many members the objects in ``value`` hold, all told."""
    if type(value) is dict:
        if not any(type(item) is dict or type(item) is list for item in value.values()):
            return len(value)  # (a flat object, most answers: no walk)
    elif type(value) is not list:
        return 0
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            count += len(item)
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return count


def holds_lone_surrogate(value: Any) -> bool:
    """Does a string of ``value`` (a key or a value) hold a lone surrogate (``"\\ud800"`` read by json)?
    No UTF-8 text can, and readers disagree on what one is (kept, replaced by U+FFFD, refused)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is str:
            if _LONE_SURROGATE.search(item):
                return True
        elif type(item) is dict:
            stack.extend(item)
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return False


class _KeyTwice(ValueError):
    pass


_TOO_DEEP = "nested too deep to read whole (some thousand levels or more)"


def _each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise _KeyTwice
    return found


def names_a_key_twice(text: str | bytes) -> bool:
    """Does this JSON text (one :func:`parse_json` read) hold an object that names the same key twice?

    RFC 8259 leaves such an object's meaning open: this parser keeps the last value, others the first or
    refuse it, so a check made here could pass a value that the reader of the result never sees. One more
    parse, with the pairs in order (about twice :func:`parse_json`'s time). A text nested too deep for
    that parse (orjson reads deeper) raises ValueError: it cannot be told free of them.
    """
    quotes = text.count('"') if isinstance(text, str) else text.count(b'"')
    if quotes < 4:  # two keys need four quotes at least
        return False
    try:
        json.loads(text, object_pairs_hook=_each_key_once)
    except _KeyTwice:
        return True
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    except ValueError:  # what json cannot read, parse_json judged already
        return False
    return False


def compact_json(value: Any) -> str:
    """Deterministic compact JSON for storage (sorted keys, no whitespace, UTF-8, no NaN).

    For values made only of strings, integers, booleans, null, lists and objects
    this is byte-for-byte :func:`canonical_json`, at C speed; floats are written
    as Python writes them, which is why fingerprints use :func:`canonical_json`.

    Every write encodes several documents, so orjson writes those it writes exactly as
    ``json`` does (exact JSON types, string keys, 64-bit integers, finite floats that Python
    writes without an exponent): about twenty times faster. Anything else goes to ``json``.
    """
    if _plain(value, True):
        return _orjson(value)
    return _COMPACT.encode(value)


def floatless_json(value: Any) -> str:
    """:func:`compact_json` of a document of the ledger's own making that holds no float (digests, ids,
    integers, null: an entry, what it covers, a seal): the same bytes, without looking at every value first."""
    return _orjson(value)


def _plain_scalar(item: Any, floats: bool, lo: int, hi: int) -> bool:
    kind = type(item)
    if kind is str or kind is bool or item is None:
        return True
    if kind is int:
        return bool(lo <= item <= hi)
    if kind is float:
        return floats and math.isfinite(item) and "e" not in repr(item)
    return False


def _orjson(value: Any) -> str:
    try:
        return orjson.dumps(value, option=_ORJSON_SORTED).decode("utf-8")
    except TypeError:  # a lone surrogate, which json writes as it is
        return _COMPACT.encode(value)


def _plain(value: Any, floats: bool) -> bool:
    """Is ``value`` made only of what orjson writes byte for byte as ``json.dumps(ensure_ascii=False,
    sort_keys=True)`` does: exact ``dict`` (string keys), ``list``, ``str``, ``bool``, ``None``, 64-bit
    ``int`` and (``floats``) a finite float that ``repr`` writes positionally?

    orjson writes NaN as null where json refuses it, ``1e-07`` as ``1e-7`` and refuses larger integers;
    subclasses (enums) and other mappings are json's to write, as before.
    """
    lo, hi = _I64
    if type(value) is not dict and type(value) is not list:
        return _plain_scalar(value, floats, lo, hi)
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        container, depth = stack.pop()
        if depth >= _PLAIN_DEPTH:
            return False
        if type(container) is dict:
            for key in container:
                if type(key) is not str:
                    return False
            children = container.values()
        else:
            children = container
        for item in children:
            kind = type(item)
            if kind is str or kind is bool or item is None:
                continue
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif not _plain_scalar(item, floats, lo, hi):
                return False
    return True


def _scalar(value: str | int | float | bool | None) -> str:
    kind = type(value)
    if kind is str:
        return encode_basestring(value)  # type: ignore[arg-type]
    if kind is float:
        return es_number(value)  # type: ignore[arg-type]
    if kind is int:
        return str(value)
    return _CONSTANTS[value]  # type: ignore[index]


def _write(value: Any, out: list[str]) -> None:
    kind = type(value)
    # exact types first: nearly every value is one, and the ABC checks below cost more than the writing
    if kind is str:
        out.append(encode_basestring(value))
    elif kind is int:
        out.append(str(value))
    elif kind is float:
        out.append(es_number(value))
    elif value is None or value is True or value is False:
        out.append(_CONSTANTS[value])
    elif isinstance(value, str):
        out.append(encode_basestring(value))
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(es_number(value))
    else:
        _write_container(value, out)


def _write_container(value: Any, out: list[str]) -> None:
    if isinstance(value, Mapping):
        out.append("{")
        for i, key in enumerate(sorted(value)):
            if not isinstance(key, str):
                raise UsageError(f"JSON object keys must be strings, got {key!r}; convert the key to a string")
            if i:
                out.append(",")
            out.append(encode_basestring(key))
            out.append(":")
            _write(value[key], out)
        out.append("}")
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    else:
        raise UsageError(
            f"cannot encode {type(value).__name__} as JSON; "
            "use strings, integers, finite floats, booleans, null, lists and objects"
        )


def es_number(x: float) -> str:
    """Write a finite float the way ECMAScript's Number.prototype.toString does."""
    if math.isnan(x) or math.isinf(x):
        raise UsageError("NaN and infinite numbers have no JSON form; send them as strings")
    if x == 0:
        return "0"
    text = repr(x)
    if "e" not in text:
        # Python writes 1e-4 <= |x| < 1e16 positionally with the same shortest digits ECMAScript
        # chooses, and ECMAScript writes that range positionally too; only an integral ".0" differs
        return text[:-2] if text.endswith(".0") else text
    sign = "-" if x < 0 else ""
    _, digit_tuple, exponent = Decimal(repr(abs(x))).as_tuple()
    digits = "".join(map(str, digit_tuple)).rstrip("0") or "0"
    assert isinstance(exponent, int)
    # position of the decimal point relative to the start of ``digits``
    n = exponent + len("".join(map(str, digit_tuple)))
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    mantissa = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def request_fingerprint(provider: str, target: str, endpoint: str, body: Any) -> str:
    """sha256 (hex) of the canonical encoding of what we ask the provider to do."""
    doc = {
        "v": FINGERPRINT_VERSION,
        "provider": provider,
        "target": target,
        "endpoint": endpoint,
        "body": body,
    }
    return hashlib.sha256(canonical_bytes(doc)).hexdigest()


def rfc3339(us: int | None) -> str | None:
    """Microseconds since the epoch -> RFC 3339 UTC with microseconds (``...Z``)."""
    if us is None:
        return None
    seconds, micros = divmod(us, 1_000_000)
    return f"{_rfc3339_second(seconds)}.{micros:06d}Z"


@functools.lru_cache(maxsize=256)  # every write formats the current time: the second repeats
def _rfc3339_second(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")


def to_us(dt: datetime) -> int:
    if dt.tzinfo is None:
        raise UsageError("naive datetime given; pass an aware datetime (for example in UTC)")
    delta = dt - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return datetime.fromtimestamp(us // 1_000_000, tz=UTC).replace(microsecond=us % 1_000_000)


def span_text(span: timedelta) -> str:
    """``90 s``, ``45 min``, ``24 h``, ``1 day``, ``90 days``: a duration as a person reads it."""
    seconds = span.total_seconds()
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and (seconds % size == 0 or seconds >= 10 * size):
            value = seconds / size
            plural = "s" if unit == "day" and value != 1 else ""
            return f"{value:.3g} {unit}{plural}"
    return f"{seconds:g} s"
