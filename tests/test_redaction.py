"""Secrets never reach storage or logs: unit checks of the redactor and a canary scan."""

from __future__ import annotations

import base64
import json
import logging
import re
import secrets
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from jobtrail import (
    ConflictingJobIds,
    CreateAttempt,
    DefinitiveRejection,
    Secret,
    Store,
)
from jobtrail.domain.redact import REDACTED, NullRedactor, Redactor, install_log_redaction

from helpers import S, op_in, spec, valid_evidence


def test_headers_keep_names_and_mask_values_outside_the_allow_list() -> None:
    r = Redactor()
    out = r.headers(
        {
            "Authorization": "Bearer abc",
            "Cookie": "a=b",
            "X-Api-Key": "k",
            "X-Custom": "whatever",
            "Content-Type": "application/json",
            "Retry-After": "3",
            "X-Request-Id": "req_1",
            "Location": "https://u:p@h.example/jobs/1?sig=abc&page=2",
        }
    )
    assert out["Authorization"] == out["Cookie"] == out["X-Api-Key"] == out["X-Custom"] == REDACTED
    assert out["Content-Type"] == "application/json" and out["Retry-After"] == "3"
    assert out["X-Request-Id"] == "req_1"
    assert out["Location"] == "https://REDACTED:REDACTED@h.example/jobs/1?sig=[REDACTED]&page=2"


@pytest.mark.parametrize(
    ("text", "leak"),
    [
        ("Authorization: Bearer eyJhbGciOi.eyJzdWIiOiIx.sig123", "eyJzdWIiOiIx"),
        ("key AKIAABCDEFGHIJKLMNOP used", "AKIAABCDEFGHIJKLMNOP"),
        ("token ghp_0123456789abcdefghijABCDEFGHIJ", "ghp_0123456789abcdefghij"),
        ("slack xoxb-1234567890-abcdefghij", "xoxb-1234567890"),
        ("stripe sk_live_0123456789abcdef", "sk_live_0123456789"),
        ("anthropic sk-ant-api03-abcdefghijklmnop", "abcdefghijklmnop"),
        ("openai sk-proj0123456789abcdefgh", "sk-proj0123456789"),
        ("-----BEGIN PRIVATE KEY-----\nMIIBVgIBADANBg\n-----END PRIVATE KEY-----", "MIIBVgIBADANBg"),
        ('{"password": "hunter2", "user": "bob"}', "hunter2"),
        ("client_secret=s3cr3tv4lue&x=1", "s3cr3tv4lue"),
        ("postgres://admin:pa55word@db.internal/x", "pa55word"),
        ("webhook secret whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
    ],
)
def test_known_secret_formats_are_masked_in_text(text: str, leak: str) -> None:
    assert leak not in Redactor().text(text)


def test_json_fields_named_like_secrets_are_masked_recursively() -> None:
    out = Redactor().value(
        {"a": {"api_key": "x1", "items": [{"refresh_token": "x2"}]}, "max_tokens": 100, "author": "ann"}
    )
    assert out == {
        "a": {"api_key": REDACTED, "items": [{"refresh_token": REDACTED}]},
        "max_tokens": 100,
        "author": "ann",
    }


@pytest.mark.parametrize(
    "code", ["rate_limit_exceeded", "RESOURCE_EXHAUSTED", "ThrottlingException", "invalidRequest", "E1234"]
)
def test_an_errors_code_that_reads_as_a_name_is_kept_for_the_person_who_reads_it(code: str) -> None:
    """``code`` is also where an OAuth flow puts its one-time code, so the field was masked whatever it held,
    and an operator reading a provider's error saw ``{"code": "[REDACTED]"}`` where it said why."""
    error = {"error": {"code": code, "message": "slow down", "type": "requests"}}
    assert Redactor().value(error) == error


@pytest.mark.parametrize(
    "code",
    [
        "SplxlOBeZQQYbYS6WxSbIA",  # RFC 6749's example authorization code
        "4/0AX4XfWhxyz",  # Google's form
        "482913",  # a one-time code
        "abcd efgh ijkl mnop",  # an app password
        "ABCDEF-GHIJKL-MNOPQR-STUVWX",  # a recovery or licence code
        "abcdefghijklmnopqrstuvwxyz",
        "AbCdEfGhIjKl",
        "8a7Bc9-Xy12Zq",
        "a3f9c2d1e8b7a6f5c4d3e2f1a0b9c8d7",
        "ab12cd-ef34gh-ij56kl",
        "123e4567-e89b-12d3-a456-426614174000",
        "x" * 65,
    ],
)
def test_a_code_that_reads_as_a_token_is_masked_even_in_an_error(code: str) -> None:
    """(Shapes a review found kept by the first rule: a code is kept only when it reads as a name.)"""
    error = {"error": {"code": code, "message": "m"}, "nested": [{"code": code, "type": "t"}]}
    assert Redactor().value(error) == {
        "error": {"code": REDACTED, "message": "m"},
        "nested": [{"code": REDACTED, "type": "t"}],
    }


def test_a_code_outside_an_error_is_masked_whatever_it_reads_as() -> None:
    """An object with a code and nothing that says what went wrong (an OAuth callback's, say) is no error:
    its code is masked, as every field named like a credential is."""
    assert Redactor().value({"code": "rate_limit_exceeded", "state": "xyz"}) == {"code": REDACTED, "state": "xyz"}


def test_a_named_code_still_has_a_credential_in_it_masked() -> None:
    redactor = Redactor()
    redactor.register("sk-live-abcdefghijklmnop1234")
    assert redactor.value({"code": "sk-live-abcdefghijklmnop1234"}) == {"code": REDACTED}
    assert redactor.value({"code": {"inner": "x"}}) == {"code": REDACTED}


def test_injected_values_are_masked_in_every_encoding() -> None:
    r = Redactor()
    value = "plain-looking-value-42"
    Secret(value, redactor=r)
    for form in (
        value,
        base64.b64encode(value.encode()).decode(),
        urllib.parse.quote(value),
        value.encode().hex(),
    ):
        assert form not in r.text(f"error near {form}!"), form
    r.register_basic("svc", value)
    basic = base64.b64encode(f"svc:{value}".encode()).decode()
    assert basic not in r.text(f"Authorization: Basic {basic}")


def test_secret_type_never_shows_or_pickles() -> None:
    import json
    import pickle

    s = Secret("do-not-show-me-123", redactor=Redactor())
    assert "do-not-show" not in repr(s) and "do-not-show" not in f"{s}"
    with pytest.raises(TypeError):
        pickle.dumps(s)
    with pytest.raises(TypeError):
        json.dumps({"s": s})


# -- the canary scan -----------------------------------------------------------------------


def _forms(value: str) -> list[bytes]:
    raw = value.encode()
    return [raw, base64.b64encode(raw), urllib.parse.quote(value, safe="").encode(), raw.hex().encode()]


def _plant_and_run(store: Store, log_file: Path) -> list[str]:
    """Plant fresh canaries everywhere a secret could slip in; return them."""
    c = {
        name: f"jtcanary_{name}_{secrets.token_hex(8)}"
        for name in (
            "bearer",
            "cookie",
            "apikey",
            "userinfo",
            "query",
            "errbody",
            "injected",
            "exc",
            "problem",
        )
    }
    injected = Secret(c["injected"], redactor=store.redactor)  # as a provider of this ledger resolves it
    handler = logging.FileHandler(log_file)
    logger = logging.getLogger("jobtrail")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        op, _ = store.create_operation(spec(body={"doc": "safe"}))
        op = store.record(op, CreateAttempt(attempt=1), actor="worker", changes={"attempts": 1})
        response = {
            "headers": {
                "Authorization": f"Bearer {c['bearer']}",
                "Set-Cookie": f"sid={c['cookie']}",
                "X-Api-Key": c["apikey"],
            },
            "url": f"https://svc:{c['userinfo']}@api.example.com/jobs?token={c['query']}&page=2",
            "body": {"error": {"message": f"invalid credential {injected.reveal()}", "client_secret": c["errbody"]}},
        }
        store.add_observation(op.operation_id, kind="create_response", raw=response, http_status=409)
        try:
            raise ConnectionError(
                f"reset by peer while sending key={c['exc']} "
                f"auth {base64.b64encode(injected.reveal().encode()).decode()}"
            )
        except ConnectionError as exc:
            logger.exception("create failed for %s", op.operation_id)
            reason = str(exc)
        op = store.transition(
            op,
            S.NEEDS_ATTENTION,
            ConflictingJobIds(
                first_job_id="job-1",
                second_job_id="job-2",
                first_response=response,
                second_response={"detail": reason},
            ),
            actor="worker",
            changes={"state_reason": reason},
        )
        other, _ = store.create_operation(spec(body={"doc": "second"}))
        other = store.record(other, CreateAttempt(attempt=1), actor="worker", changes={"attempts": 1})
        store.transition(
            other,
            S.FAILED,
            DefinitiveRejection(
                http_status=401,
                problem={
                    "title": "unauthorized",
                    "detail": f"password={c['problem']}",
                    "echo": injected.reveal(),
                },
            ),
            actor="worker",
        )
        logger.warning("provider said %s", response)
        moving = op_in(store, S.CANCELLING, body={"doc": "third"})
        store.transition(moving, S.CANCELLED, valid_evidence(S.CANCELLING, S.CANCELLED, moving), actor="w")
    finally:
        handler.close()
        logger.removeHandler(handler)
    return list(c.values())


def _database_bytes(store: Store) -> bytes:
    if store.dialect == "sqlite":
        import sqlite3

        path = Path(str(store.engine.url.database))
        store.engine.dispose()
        raw = sqlite3.connect(path, isolation_level=None)
        assert raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        raw.close()
        files = [path, Path(f"{path}-wal"), Path(f"{path}-journal")]
        return b"".join(f.read_bytes() for f in files if f.exists())
    out = []
    with store.engine.connect() as conn:
        for table in ("operations", "history", "observations"):
            out += [str(row[0]).encode() for row in conn.execute(sa.text(f"SELECT t::text FROM {table} t"))]
    return b"\n".join(out)


def _hits(store: Store, canaries: list[str], log_file: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    haystacks = {
        "database": _database_bytes(store),
        "log file": log_file.read_bytes(),
        "caplog": caplog.text.encode(),
    }
    return [
        f"{canary} in {where}"
        for canary in canaries
        for where, data in haystacks.items()
        if any(form in data for form in _forms(canary))
    ]


def test_canary_secrets_reach_neither_storage_nor_logs(db_url: str, tmp_path: Path, caplog) -> None:
    store = Store.open(db_url)
    install_log_redaction(store.redactor)
    canaries = _plant_and_run(store, tmp_path / "jobtrail.log")
    assert _hits(store, canaries, tmp_path / "jobtrail.log", caplog) == []
    store.close()


def test_canary_scan_fails_when_the_redactor_is_off(
    db_url: str, tmp_path: Path, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan is real: with redaction switched off it finds the planted secrets."""
    null = NullRedactor()
    store = Store.open(db_url, redactor=null)
    install_log_redaction(store.redactor)
    canaries = _plant_and_run(store, tmp_path / "jobtrail.log")
    hits = _hits(store, canaries, tmp_path / "jobtrail.log", caplog)
    assert any("in database" in h for h in hits)
    assert any("in log file" in h for h in hits)
    store.close()


def test_redacted_evidence_keeps_its_shape(store: Store) -> None:
    op = op_in(store, S.CREATE_PENDING)
    moved = store.transition(
        op,
        S.FAILED,
        DefinitiveRejection(http_status=400, problem={"title": "bad", "api_key": "xyz-123-abc"}),
        actor="w",
    )
    entry = store.history(moved.operation_id)[-1].to_json()
    assert entry["evidence"]["problem"] == {"title": "bad", "api_key": REDACTED}


#: hint letters in both cases, and the letters whose case rules differ from ASCII's (long s, dotted I, Kelvin)
_HINT_LETTERS = "abeginrtokys_-:/KEYBASICTOKEN\u017f\u0130\u0131 \u212a="
_HINTED_TEXT = st.text(alphabet=st.sampled_from(_HINT_LETTERS) | st.characters(codec="utf-8"), max_size=30)


@settings(max_examples=500, deadline=None)
@given(_HINTED_TEXT)
def test_the_fast_hint_checks_find_what_the_case_insensitive_patterns_find(text: str) -> None:
    """The hint checks that decide whether a string is searched for credential formats lower ASCII text
    instead of matching without case: the same answer for every string, Unicode case rules included."""
    from jobtrail.domain import redact

    assert redact._strong_hint(text) == bool(_any_case(redact._STRONG_HINTS).search(text))
    assert redact._kv_hint(text) == bool(_any_case(redact._KV_HINTS).search(text))


def _any_case(hints: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(h) for h in hints), re.IGNORECASE)


def test_no_other_character_matches_a_hint_letter_without_case() -> None:
    """The hint checks map four characters beyond ASCII to the letters case-insensitive matching takes them
    for, and every other one to a character no hint has: every code point is checked against every letter."""
    from jobtrail.domain import redact

    beyond_ascii = "".join(chr(c) for c in range(0x80, 0x110000) if not 0xD800 <= c < 0xE000)
    letters = sorted(set("".join(redact._STRONG_HINTS) + "".join(redact._KV_HINTS)))
    taken_for = {found: letter for letter in letters for found in re.findall(re.escape(letter), beyond_ascii, re.I)}
    assert dict(redact._HINT_LOOKALIKES) == taken_for


#: pieces of every secret format, around which a pattern may or may not match
_FORMAT_PIECES_TEXT = (
    "Bearer |bearer\t|TOKEN |Basic |digest  |a1b2c3d4|abc.def~|eyJ|eyJhbGciOi.|AKIA|ASIA|ABCDEFGH23456789|ghp_|"
    "github_pat_|xoxb-|sk_live_|rk_test_|pk_|sk-|sk-ant-|whsec_|://|https://|git+ssh://|a.b-c+d://|_x://|\u017fk-|"
    "user:pw@|u@|/| |-----BEGIN RSA KEY-----|-----END RSA KEY-----|\u212aey|xxxxxxxxxxxxxxxxxxxx|Z9Z9Z9Z9Z9Z9Z9Z9Z9|"
    "_|.|é"
)
_FORMAT_PIECES = st.sampled_from(_FORMAT_PIECES_TEXT.split("|"))


@settings(max_examples=2000, deadline=None)
@given(st.lists(_FORMAT_PIECES | st.text(max_size=4), max_size=12).map("".join))
def test_a_secret_format_is_found_where_its_hint_is_as_a_search_of_the_whole_text_finds_it(text: str) -> None:
    """Each secret format is tried only where one of its hints occurs (and its match would start there):
    the same verdict as searching the whole text with every pattern."""
    from jobtrail.domain import redact

    assert redact._pattern_found(text) == any(pattern.search(text) for pattern, _ in redact._PATTERNS)
    assert Redactor()._strong(text) == _masked_by_every_pattern(text)


def _masked_by_every_pattern(text: str) -> str:
    from jobtrail.domain import redact

    for pattern, replacement in redact._PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _plain_decoded_forms(text: str) -> set[str]:
    """Every base64 and hex run decoded the plain way: both alphabets for each base64 run, whole byte pairs;
    also each base64 run wrapped in lines (:func:`_plain_wrapped_runs`), and the hex runs in it."""
    import binascii
    import re

    forms: set[str] = set()
    wrapped = _plain_wrapped_runs(text)
    for run in re.findall(r"[A-Za-z0-9+/_-]{8,}={0,2}", text) + wrapped:
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                forms.add(decode(run + "=" * (-len(run) % 4)).decode("utf-8", errors="replace"))
            except (binascii.Error, ValueError):
                continue
    for run in re.findall(r"(?:[0-9A-Fa-f]{2}){4,}", " ".join([text, *wrapped])):
        forms.add(bytes.fromhex(run).decode("utf-8", errors="replace"))
    return forms - {text}


def _plain_wrapped_runs(text: str) -> list[str]:
    """Base64 wrapped in lines, found the plain way: every line break as LF (JSON's escaped ones first), then a
    run of 16 characters or more before each break, and a run after the last, the breaks taken out."""
    lf = re.sub(r"\r\n|\r", "\n", re.sub(r"\\r\\n|\\n|\\r", "\n", text))
    return [
        w.replace("\n", "") for w in re.findall(r"(?<![A-Za-z0-9+/_-])(?:[A-Za-z0-9+/_-]{16,}\n)+[A-Za-z0-9+/_-]+", lf)
    ]


_RUNS = st.text(alphabet=st.sampled_from("aZ09+/_-=fF3 .\\%&\n\rnr"), max_size=60)
#: base64 lines of 16 characters and more, and breaks to fall between them
_LINE_PIECES = st.sampled_from(["QmVhcmVy" * 2, "c2stYWJj" * 3, "0123456789abcdef", "\n", "\r\n", "\\n", " "])
_LINES = st.lists(_LINE_PIECES).map("".join)
_BEARER_B64 = base64.b64encode(b"Bearer abcdefghijklmnop").decode()
_SECRETS_IN_RUNS = st.sampled_from(
    [
        "",
        _BEARER_B64,
        "sk-" + "a" * 24,
        (b"token=" + b"x" * 20).hex(),
        # in lines of 16 characters (the first ends five letters into the token): LF, CRLF, as JSON escapes
        *(brk.join(_BEARER_B64[i : i + 16] for i in range(0, len(_BEARER_B64), 16)) for brk in ("\n", "\r\n", "\\n")),
    ]
)


@settings(max_examples=500, deadline=None)
@given(_RUNS | _LINES, _SECRETS_IN_RUNS, _RUNS | _LINES)
def test_the_quick_decoding_finds_the_forms_the_plain_decoding_finds(before: str, secret: str, after: str) -> None:
    """A base64 run of letters and digits is decoded once (both alphabets read it alike) and hex runs are
    found by a plain class: the forms searched for credentials are the same; so is the verdict, which
    rules out the forms without a hint in one search."""
    from jobtrail.domain import redact

    text = before + secret + after
    quick = redact._decoded_forms(text, deep=True)
    assert set(quick) - set(redact._decoded_forms(text, deep=False)) == _plain_decoded_forms(text) - set(
        redact._decoded_forms(text, deep=False)
    )
    plain_verdict = any(
        len(c) >= redact._SHORTEST_PATTERN
        and redact._strong_hint(c)
        and any(pattern.search(c) for pattern, _ in redact._PATTERNS)
        for c in (text, *quick)
    )
    assert Redactor()._looks_like_credential(text) == plain_verdict
    # the runs decoded together hold every hint one of them holds decoded alone
    together = "\n".join(redact._decoded_forms(text, deep=True, together=True))
    if any(redact._strong_hint(form) for form in quick):
        assert redact._strong_hint(together)


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(
        _LINE_PIECES | st.sampled_from(["Zm9v", "a", "=", "+/-_", ".", "\\", "\r", "n", "r", "é"]), max_size=30
    ).map("".join)
)
def test_wrapped_base64_is_found_at_its_breaks_as_a_search_of_every_character_finds_it(text: str) -> None:
    """Base64 wrapped in lines is looked for from each line break only, not tried from every character:
    the same runs as a plain search, with the breaks taken out."""
    from jobtrail.domain import redact

    assert redact._wrapped_runs(text) == _plain_wrapped_runs(text)


def _mime(data: bytes) -> str:
    """``data`` as MIME base64 (RFC 2045): lines of 76 characters, each ended by LF."""
    return base64.encodebytes(data).decode()


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda mime: mime, id="lf"),
        pytest.param(lambda mime: mime.replace("\n", "\r\n"), id="crlf"),
        pytest.param(lambda mime: json.dumps({"attachment": mime}), id="json-escaped-lf"),
        pytest.param(lambda mime: json.dumps({"attachment": mime.replace("\n", "\r\n")}), id="json-escaped-crlf"),
        pytest.param(lambda mime: "z" + mime, id="after-a-base64-character"),
        pytest.param(lambda mime: urllib.parse.quote(json.dumps({"a": mime})), id="percent-encoded-json"),
    ],
)
def test_a_credential_in_mime_base64_is_found_across_its_line_breaks(wrap: Callable[[str], str]) -> None:
    """A hostile provider echoes ``Authorization: Bearer <credential>`` as MIME base64 (``base64.encodebytes``):
    a line break inside the credential's base64 hid it from every check, yet any decoder skips the break."""
    from jobtrail.domain import redact

    canary = f"jtcanary_cred_{secrets.token_hex(12)}"
    redactor = Redactor()
    redactor.register(canary)
    mime = _mime(f"Authorization: Bearer {canary}".encode())
    assert canary in base64.b64decode(mime).decode()
    assert not any(core in mime for core in redact._b64_cores(canary.encode())), "the break is not in the credential"
    text = wrap(mime)
    assert redactor.contains_secret(text) and redactor.contains_secret(text.encode())
    assert redactor.text(text) == REDACTED  # every string written (a status answer's, a log line's)
    assert redactor.value({"debug": text}) == {"debug": REDACTED}
    assert redactor.result_value({"attachment": text}) == {"withheld": redact.WITHHELD_CREDENTIAL}
    assert redactor.looks_like_credential(text) and redactor.secret_paths({"prompt": text}) == ["$.prompt"]


def test_a_credential_in_mime_base64_lines_split_across_strings_is_found() -> None:
    """MIME base64 as a JSON list of its lines, each with its line break."""
    canary = f"jtcanary_cred_{secrets.token_hex(12)}"
    redactor = Redactor()
    redactor.register(canary)
    lines = _mime(f"Authorization: Bearer {canary}".encode()).splitlines(keepends=True)
    assert redactor.contains_secret(json.dumps({"attachment": lines}))


@pytest.mark.parametrize(
    "shape",
    [
        lambda c: {"status": "succeeded", "note": [c[:13], c[13:26], c[26:]]},
        lambda c: {"a": c[:13], "b": {"c": c[13:26], "d": c[26:]}},
        lambda c: {"x": c[:13], c[13:26]: c[26:]},
        lambda c: [c[:13], "\n", c[13:26], "\n", c[26:]],
    ],
    ids=["two-strings", "two-values", "key-and-value", "mime-like-lines"],
)
def test_a_credential_cut_into_strings_too_short_to_mask_is_seen_in_the_value(shape: Callable[[str], Any]) -> None:
    """A provider's answer, kept as evidence, that carries the credential in thirds: each too short for
    value() to mask (a run of two thirds is); the value as a whole is what splits_a_credential() judges,
    and its caller withholds it."""
    canary = f"jtcanary_cred_{secrets.token_hex(12)}"
    redactor = Redactor()
    redactor.register(canary)
    answer = shape(canary)
    masked = redactor.value(answer)
    assert redactor.splits_a_credential(masked)
    assert not redactor.splits_a_credential({"status": "succeeded", "note": ["jtcanary", "cred", "nothing"]})
    assert not Redactor().splits_a_credential(masked)  # nothing registered, nothing to find


@pytest.mark.parametrize("cut", [20, 28, 33])
def test_a_credential_split_where_one_piece_is_masked_on_its_own_is_withheld_whole(cut: int) -> None:
    """Found by a probe: a credential in two strings, its first piece masked on its own (a key's format, or two
    thirds of it), kept the second piece, 23 of 43 characters: the split was looked for in the masked value,
    where the first piece no longer was. Looked for in the answer as it came, the answer is withheld whole;
    one string holding the whole credential is still only masked."""
    from jobtrail.domain import redact

    canary = "sk_live_" + secrets.token_urlsafe(26)
    redactor = Redactor()
    redactor.register(canary)
    kept = redactor.answer({"type": "t", "data": {"a": canary[:cut], "b": canary[cut:]}})
    assert kept == {"withheld": redact.WITHHELD_SPLIT_CREDENTIAL}, kept
    echoed = redactor.answer({"data": {"echo": f"Bearer {canary}", "id": "job-1"}})
    assert echoed == {"data": {"echo": f"Bearer {redact.REDACTED}", "id": "job-1"}}
    both = redactor.answer({"auth": f"Bearer {canary}", "a": canary[:cut], "b": canary[cut:]})
    assert both == {"withheld": redact.WITHHELD_SPLIT_CREDENTIAL}
    # (found by a review) a piece of the split in the very string that echoes the whole credential
    beside = redactor.answer({"x": f"{canary} {canary[:14]}", "y": canary[14:29], "z": canary[29:]})
    assert beside == {"withheld": redact.WITHHELD_SPLIT_CREDENTIAL}, beside


@pytest.mark.parametrize("width", [76, 64, 16])
def test_a_secret_format_in_base64_wrapped_in_lines_is_seen_across_the_breaks(width: int) -> None:
    """A known secret format (no credential registered) in base64 wrapped in lines, cut by a break so that no
    line decodes to it alone: seen once the lines are decoded as one run."""
    from jobtrail.domain import redact

    header = b"Authorization: Bearer sk"  # a line ends after "sk", the next starts "-ant-api03-..."
    plain = b"." * (-len(header) % (width // 4 * 3)) + header + b"-ant-api03-" + b"A1b2" * 10
    encoded = base64.b64encode(plain).decode()
    lines = [encoded[i : i + width] for i in range(0, len(encoded), width)]
    assert any(base64.b64decode(line).endswith(b"Bearer sk") for line in lines)
    for text in ("\n".join(lines), "\r\n".join(lines), json.dumps("\n".join(lines))):
        assert not any(redact.looks_secret(line) for line in lines)
        assert redact.looks_secret(text), text
        assert Redactor().secret_paths({"prompt": text}) == ["$.prompt"]


def test_prose_in_lines_is_not_read_as_wrapped_base64() -> None:
    """A word that ends a line is not taken for a line of base64: only a run of 16 characters or more is read
    on across a break (MIME's lines are 76, PEM's 64)."""
    from jobtrail.domain import redact

    prose = "Please categorise these customer\ncomplaints by severity and\nsummarise them.\n" * 100
    assert redact._wrapped_runs(prose) == []
    assert redact._wrapped_runs(json.dumps(prose)) == []


def test_a_long_prompt_is_checked_for_credentials_in_milliseconds_not_per_word() -> None:
    """A 64 KiB request body of prose: every long word is a base64 run to decode; a credential inside is
    still found. (What is counted is work, not time: the forms searched one by one.)"""
    from jobtrail.domain import redact

    prose = ("Please categorise these customer complaints by severity and summarise them. " * 1000)[: 64 * 1024]
    searched: list[str] = []
    real = redact._strong_hint

    def counting(text: str) -> bool:
        searched.append(text)
        return real(text)

    redact._strong_hint = counting  # type: ignore[assignment]
    try:
        assert Redactor().secret_paths({"prompt": prose}) == []
        assert len(searched) <= 3, f"{len(searched)} separate hint searches for one prompt"
        leaked = prose[:30_000] + " sk-" + "a1B2" * 10 + " " + prose[30_000:]
        assert Redactor().secret_paths({"prompt": leaked}) == ["$.prompt"]
    finally:
        redact._strong_hint = real  # type: ignore[assignment]


def test_a_long_run_before_a_url_separator_is_not_tried_from_every_position(monkeypatch) -> None:
    """A hostile answer of "a.a.a...://x" (100 KB) made the userinfo pattern start again at each of its
    50,000 word boundaries, each time scanning to the "://": minutes of one worker's CPU. The scheme's
    starts are tried only where a userinfo part follows, and then once per boundary at most."""
    from jobtrail.domain import redact

    tried: list[int] = []
    real = redact._scheme_starts

    def counting(text: str, at: int) -> list[int]:
        starts = real(text, at)
        tried.extend(starts)
        return starts

    monkeypatch.setattr(redact, "_scheme_starts", counting)
    hostile = "a." * 50_000 + "://x"
    assert Redactor().looks_like_credential(hostile) is False
    assert tried == []
    assert Redactor().looks_like_credential(hostile + "@host") is True
    assert Redactor().text("see " + hostile + "@host").endswith("://REDACTED:REDACTED@host")


def test_many_pem_beginnings_without_an_end_are_not_each_searched_to_the_end(monkeypatch) -> None:
    """A hostile answer of 20,000 "-----BEGIN A-----" lines and no END: the PEM pattern, tried from each,
    read on to the text's end every time (a tenth of it took a second). Once no END follows, none is tried."""
    from jobtrail.domain import redact

    tries: list[int] = []

    class Counting:
        def __init__(self, pattern: re.Pattern[str]) -> None:
            self.pattern = pattern

        def match(self, text: str, pos: int = 0) -> re.Match[str] | None:
            tries.append(pos)
            return self.pattern.match(text, pos)

    monkeypatch.setattr(redact, "_PATTERNS", tuple((Counting(p), r) for p, r in redact._PATTERNS))
    hostile = "-----BEGIN A-----\n" * 20_000
    assert redact._pattern_found(hostile) is False
    assert tries == []
    assert redact._pattern_found(hostile + "-----END A-----") is True
    assert len(tries) == 1  # the first BEGIN's block runs on to the END


def test_a_credential_cut_short_is_masked_but_a_basic_user_name_is_not_taken_for_one() -> None:
    """Two thirds of a credential or more, as quoted cut short, is masked; a Basic pair's start (its user name)
    is no credential, in what is masked or in a result that names the user."""
    redactor = Redactor()
    redactor.register_basic("reporting-service@example.com", "Zq8mK2pL9xR4wQ7e")
    assert redactor.text("cut: Zq8mK2pL9xR4w...") == f"cut: {REDACTED}..."
    assert redactor.text("by reporting-service@example.com") == "by reporting-service@example.com"
    owner = {"owner": "reporting-service@example.com"}
    assert redactor.result_value(owner) == owner and redactor.secret_paths(owner) == []
