"""The dashboard over real HTTP (uvicorn on 127.0.0.1), on SQLite and PostgreSQL: what it lists, shows,
refuses, and the one thing it writes (a person's decision, through the same path as `jobtrail resolve`)."""

from __future__ import annotations

import html
import http.client
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from jobtrail import ConflictingJobIds, Store
from jobtrail.domain.redact import Secret
from jobtrail.interfaces.dashboard import dashboard_app
from jobtrail.ledger import browse
from jobtrail.ledger.migrate import UNREACHABLE

from helpers import S, op_in, serve_asgi, sql, succeed

TOKEN = "dash-token-for-tests-0123456789"
EXAMPLE = Path(__file__).parent.parent / "examples" / "fake.toml"


@contextmanager
def serve(store: Store, token: str | None = None) -> Iterator[str]:
    with serve_asgi(dashboard_app(store, token=Secret(token, redactor=store.redactor) if token else None)) as base:
        yield base


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str


def call(base: str, method: str, path: str, *, form: dict[str, str] | None = None, **headers: str) -> Answer:
    """One request, redirects not followed (a test asserts where they point)."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    body = urlencode(form).encode() if form is not None else None
    sent = {k.replace("_", "-"): v for k, v in headers.items()}
    if body is not None:
        sent["Content-Type"] = "application/x-www-form-urlencoded"
    conn.request(method, path, body=body, headers=sent)
    resp = conn.getresponse()
    answer = Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode())
    conn.close()
    return answer


def listed_ids(html: str) -> list[str]:
    return re.findall(r'<td class="op"><a href="/ops/(op_[0-9A-Z]+)"', html)


def stuck(store: Store, key: str = "stuck", reason: str = "two job ids") -> str:
    op = op_in(store, S.CREATE_PENDING, operation_key=key, caller="bob")
    op = store.transition(
        op,
        S.NEEDS_ATTENTION,
        ConflictingJobIds(first_job_id="a", second_job_id="b"),
        actor="worker",
        changes={"state_reason": reason},
    )
    return op.operation_id


def test_the_list_filters_counts_and_searches(store: Store) -> None:
    """Filters by state, provider, caller and key; the search finds by id or key prefix, caller, job id."""
    done = op_in(store, S.SUCCEEDED, operation_key="nightly-1", caller="alice")
    failed = op_in(store, S.FAILED, operation_key="nightly-2", caller="bob")
    running = op_in(store, S.OBSERVING, operation_key="report", caller="carol")
    waiting = stuck(store)
    with serve(store) as base:
        everything = call(base, "GET", "/")
        assert everything.status == 200
        assert listed_ids(everything.text) == [waiting, running.operation_id, failed.operation_id, done.operation_id]
        assert "<b>1</b> needs_attention" in everything.text and "Needs a person first" in everything.text
        assert listed_ids(call(base, "GET", "/?state=failed").text) == [failed.operation_id]
        assert listed_ids(call(base, "GET", "/?state=failed&state=succeeded").text) == [
            failed.operation_id,
            done.operation_id,
        ]
        assert listed_ids(call(base, "GET", "/?key=report").text) == [running.operation_id]
        assert listed_ids(call(base, "GET", "/?caller=bob&state=failed").text) == [failed.operation_id]
        assert listed_ids(call(base, "GET", "/?q=nightly-").text) == [failed.operation_id, done.operation_id]
        assert listed_ids(call(base, "GET", f"/?q={done.operation_id[:20]}").text) == [done.operation_id]
        assert running.remote_job_id  # found by its remote job id
        assert listed_ids(call(base, "GET", f"/?q={running.remote_job_id}").text) == [running.operation_id]
        assert listed_ids(call(base, "GET", "/?provider=nobody").text) == []
        assert call(base, "GET", "/?state=bogus").status == 400
        rows = call(base, "GET", "/?state=failed&part=rows", HX_Request="true")
        assert rows.text.lstrip().startswith('<section id="rows"') and listed_ids(rows.text) == [failed.operation_id]


def test_keyset_paging_sees_every_operation_once(store: Store) -> None:
    made = [op_in(store, S.FAILED, operation_key=f"k{i}").operation_id for i in range(5)]
    seen: list[str] = []
    before = None
    while True:
        page = browse.list_page(store, browse.Filters(states=(S.FAILED,)), before=before, limit=2)
        seen += [op.operation_id for op in page.operations]
        if page.next_before is None:
            break
        before = page.next_before
    assert seen == sorted(made, reverse=True)
    assert browse.count_matching(store, browse.Filters(states=(S.FAILED,))) == 5


def test_an_operation_page_shows_its_timeline_deadlines_advice_and_result(store: Store) -> None:
    op = op_in(store, S.RESULT_COLLECTING, operation_key="with-result")
    store.add_observation(
        op.operation_id, kind="status_poll", raw={"s": "done"}, http_status=200, remote_state="succeeded"
    )
    op = succeed(store, store.get(op.operation_id))
    with serve(store) as base:
        page = call(base, "GET", "/ops/with-result")  # by key, as the CLI accepts
        assert page.status == 200
        seqs = [int(s) for s in re.findall(r'data-seq="(\d+)"', page.text)]
        assert seqs == [e.seq for e in store.history(op.operation_id)]  # every entry, in order
        assert "status read" in page.text and "create attempt 1" in page.text
        for name in ("create deadline", "result deadline", "cancel deadline", "<b>now</b>"):
            assert name in page.text
        assert "fetch the result (get_result, or jobtrail result)" in page.text  # domain/explain.py's advice
        assert re.search(r"[0-9a-f]{64}", page.text) and "Escalation bundle" in page.text
        assert call(base, "GET", "/ops/op_NOSUCHTHING").status == 404


def test_provider_text_is_escaped_and_pages_carry_a_content_security_policy(store: Store) -> None:
    stuck(store, key="<img src=x onerror=alert(1)>", reason="<script>alert('reason')</script>")
    with serve(store) as base:
        for path in ("/", "/queue"):
            page = call(base, "GET", path)
            assert "<script>alert" not in page.text and "&lt;script&gt;alert" in page.text
            assert "<img src=x" not in page.text
            csp = page.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
            assert page.headers["x-frame-options"] == "DENY"
        assert 'src="https://' not in call(base, "GET", "/").text  # nothing from a CDN
        assert call(base, "GET", "/static/htmx.min.js").status == 200


def test_read_only_shows_no_form_and_refuses_every_write(store: Store) -> None:
    op_id = stuck(store)
    with serve(store) as base:
        queue = call(base, "GET", "/queue")
        assert queue.status == 200 and "read-only" in queue.text and "/resolve" not in queue.text
        form = {"to_state": "failed", "by": "mallory", "reason": "x", "csrf": ""}
        refused = call(base, "POST", f"/ops/{op_id}/resolve", form=form, Origin=base)
        assert refused.status == 403 and "read-only" in refused.text
        assert call(base, "POST", "/login", form={"token": ""}, Origin=base).status == 403
    assert store.get(op_id).state is S.NEEDS_ATTENTION


def test_a_person_decides_only_signed_in_from_the_dashboard_with_its_csrf_token(store: Store) -> None:
    """Token, same origin and the session's CSRF token are each required; the history records who and why."""
    op_id = stuck(store)
    decision = {"to_state": "accepted", "job_id": "b", "by": "alice", "reason": "kept b, cancelled a by hand"}
    with serve(store, token=TOKEN) as base:
        assert call(base, "GET", "/").headers["location"] == "/login"  # nothing shows before signing in
        assert call(base, "GET", "/healthz").status == 200  # but health does
        assert call(base, "POST", "/login", form={"token": "wrong"}, Origin=base).status == 403
        assert call(base, "POST", "/login", form={"token": TOKEN}, Origin="http://evil.example").status == 403
        signed = call(base, "POST", "/login", form={"token": TOKEN}, Origin=base)
        assert signed.status == 303
        cookie = signed.headers["set-cookie"].split(";")[0]
        flags = signed.headers["set-cookie"].lower()
        assert "httponly" in flags and "samesite=strict" in flags
        queue = call(base, "GET", "/queue", Cookie=cookie)
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', queue.text)
        assert csrf is not None and f'action="/ops/{op_id}/resolve"' in queue.text
        path = f"/ops/{op_id}/resolve"
        good = {**decision, "csrf": csrf.group(1)}

        no_session = call(base, "POST", path, form=good, Origin=base)
        other_site = call(base, "POST", path, form=good, Cookie=cookie, Origin="http://127.0.0.1:1")
        no_origin = call(base, "POST", path, form=good, Cookie=cookie)
        foreign_referer = call(base, "POST", path, form=good, Cookie=cookie, Referer="http://evil.example/x")
        no_csrf = call(base, "POST", path, form=decision, Cookie=cookie, Origin=base)
        forged_cookie = call(base, "POST", path, form=good, Cookie=cookie[:-4] + "0000", Origin=base)
        for refused in (no_session, other_site, no_origin, foreign_referer, no_csrf, forged_cookie):
            assert refused.status == 403
        assert store.get(op_id).state is S.NEEDS_ATTENTION

        bad = call(base, "POST", path, form={**good, "job_id": ""}, Cookie=cookie, Origin=base)
        assert bad.status == 409 and "needs the remote job id" in bad.text  # the state machine's own refusal
        turned = call(base, "POST", path, form={**good, "by": "\u202eecila\u202c"}, Cookie=cookie, Origin=base)
        assert turned.status == 409 and "U+202E" in turned.text  # shown as "alice", stored as another name
        assert store.get(op_id).state is S.NEEDS_ATTENTION
        good["reason"] = "kept b,\r\ncancelled a   by hand"  # a textarea's lines: one line in every listing
        done = call(base, "POST", path, form=good, Cookie=cookie, Referer=f"{base}/queue")
        assert done.status == 303 and done.headers["location"] == f"/ops/{op_id}"
    op = store.get(op_id)
    assert op.state is S.ACCEPTED and op.remote_job_id == "b"
    last = store.history(op_id)[-1]
    assert last.actor == "person:alice (dashboard)"
    evidence = json.loads(last.evidence)
    assert evidence["kind"] == "human_decision" and evidence["reason"] == "kept b, cancelled a by hand"


def test_behind_a_tls_proxy_forms_from_the_public_origin_are_accepted(store: Store) -> None:
    """--origin names the origin people use when a proxy forwards plain HTTP; other origins stay refused."""
    op_id = stuck(store)
    app = dashboard_app(store, token=Secret(TOKEN, redactor=store.redactor), public_origin="https://dash.example.com")
    with serve_asgi(app) as base:
        signed = call(base, "POST", "/login", form={"token": TOKEN}, Origin="https://dash.example.com")
        assert signed.status == 303 and "secure" in signed.headers["set-cookie"].lower()
        cookie = signed.headers["set-cookie"].split(";")[0]
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', call(base, "GET", "/queue", Cookie=cookie).text)
        assert csrf is not None
        form = {"to_state": "failed", "by": "alice", "reason": "never ran", "csrf": csrf.group(1)}
        path = f"/ops/{op_id}/resolve"
        assert call(base, "POST", path, form=form, Cookie=cookie, Origin="https://evil.example.com").status == 403
        assert call(base, "POST", path, form=form, Cookie=cookie, Origin="https://dash.example.com").status == 303
    assert store.get(op_id).state is S.FAILED


def test_a_page_renamed_to_the_dashboards_address_is_refused(store: Store) -> None:
    """Found by a probe: DNS rebinding. A site the operator visits renames itself to 127.0.0.1; its requests
    then reach the dashboard as same-origin ones, naming the site in Host (and Origin). The read-only pages
    were answered to it, and with a session its decision passed the Origin check, which read our origin off
    that Host. Only the address the dashboard is reached at, localhost for a loopback one, and --origin's host
    are answered."""
    op_id = stuck(store)
    with serve(store, token=TOKEN) as base:
        port = urlsplit(base).port
        evil = f"attacker.example:{port}"
        for path in ("/queue", "/healthz", "/login"):
            refused = call(base, "GET", path, Host=evil)
            assert refused.status == 421 and "--origin" in refused.text and op_id not in refused.text
        guess = call(base, "POST", "/login", form={"token": TOKEN}, Host=evil, Origin=f"http://{evil}")
        assert guess.status == 421 and "set-cookie" not in guess.headers
        for name in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
            assert call(base, "GET", "/login", Host=name).status == 200, name
        for odd in (f"127.0.0.1:{port + 1}", "127.0.0.1", f"user@127.0.0.1:{port}", f"127.0.0.1:{port}/x", ""):
            assert call(base, "GET", "/login", Host=odd).status == 421, odd
    app = dashboard_app(store, token=Secret(TOKEN, redactor=store.redactor), public_origin="https://dash.example.com")
    with serve_asgi(app) as base:
        for name in ("dash.example.com", "dash.example.com:443"):
            assert call(base, "GET", "/login", Host=name).status == 200, name
        assert call(base, "GET", "/login", Host="dash.example.com:8443").status == 421
        assert call(base, "GET", "/login", Host="evil.example.com").status == 421


@pytest.mark.parametrize(
    ("server", "host", "answered"),
    [
        (("::ffff:127.0.0.1", 8790), "127.0.0.1:8790", True),  # (found by a review) a dual-stack socket's IPv4 client
        (("::ffff:127.0.0.1", 8790), "localhost:8790", True),
        (("::1", 8790), "[::1]:8790", True),
        (("::1", 8790), "localhost:8790", True),
        (("::ffff:127.0.0.1", 8790), "attacker.example:8790", False),
        (("10.0.0.5", 8790), "localhost:8790", False),  # not a loopback address: only its own name
        (("10.0.0.5", 8790), "10.0.0.5:8790", True),
    ],
)
def test_the_host_a_request_names_is_checked_against_the_address_it_reached(
    server: tuple[str, int], host: str, answered: bool
) -> None:
    from jobtrail.interfaces.dashboard.security import host_allowed

    scope = {"type": "http", "server": server, "scheme": "http", "headers": [(b"host", host.encode())]}
    assert host_allowed(scope) is answered


def test_workers_providers_and_audit_pages(store: Store, tmp_path: Path) -> None:
    from jobtrail.ledger.audit import make_anchor

    op_in(store, S.SUCCEEDED)
    with serve_asgi(dashboard_app(store)) as base:  # none yet: how to start one, on this very ledger
        assert f"start one: <code>{store.command} worker" in html.unescape(call(base, "GET", "/workers").text)
    store.heartbeat("host-a:1", ["fake"])
    store.heartbeat("host-b:2", ["other"], stopped=True)
    anchor = tmp_path / "anchor.json"
    anchor.write_text(json.dumps(make_anchor(store)))
    app = dashboard_app(store, provider_files=[str(EXAMPLE)], anchor_path=str(anchor))
    with serve_asgi(app) as base:
        workers = call(base, "GET", "/workers").text
        assert "host-a:1" in workers and "running" in workers and "host-b:2" in workers and "stopped" in workers
        providers = call(base, "GET", "/providers").text
        assert "at-most-once creation" in providers and "cancel" in providers  # what `providers check` shows
        assert "In use in this ledger: fake." in providers  # the names, not the database's rows
        assert "Last run" not in call(base, "GET", "/audit").text  # the whole-ledger check runs when asked
        assert "Last run" not in call(base, "GET", "/audit?run=1").text  # and a link does not ask
        ran = call(base, "POST", "/audit", form={}, Origin=base)
        assert ran.status == 303 and ran.headers["location"] == "/audit"
        audit = call(base, "GET", "/audit").text
        assert "<b>OK</b> 1 operations" in audit and "anchor matches" in audit
        forged = json.loads(anchor.read_text())
        forged["root"] = "0" * 64
        anchor.write_text(json.dumps(forged))  # an anchor this ledger does not match: the page says so
        call(base, "POST", "/audit", form={}, Referer=f"{base}/audit")
        assert "TAMPERED" in call(base, "GET", "/audit").text


def test_an_audit_runs_only_when_the_dashboards_own_page_asks_and_one_at_a_time(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a probe: GET /audit?run=1 re-read the whole ledger each time it was asked, 20 at once took the
    dashboard down (its connection pool empty, /healthz 503), and any page could ask with an <img>. Now only a
    POST from this dashboard's own page runs it, and while one runs no other starts: the asker sees its result."""
    import jobtrail.ledger.audit as audit_module

    op_in(store, S.SUCCEEDED)
    real, runs = audit_module.verify, []

    def slow_verify(*args: object, **kwargs: object) -> object:
        runs.append(1)
        time.sleep(1.0)  # long enough for the others to arrive while it runs
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(audit_module, "verify", slow_verify)
    with serve(store) as base:
        assert call(base, "POST", "/audit", form={}, Origin="http://evil.example").status == 403
        assert call(base, "POST", "/audit", form={}).status == 403  # neither Origin nor Referer
        assert not runs
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: call(base, "POST", "/audit", form={}, Origin=base), range(8)))
        assert [a.status for a in answers] == [303] * 8
        assert len(runs) == 1
        assert "<b>OK</b> 1 operations" in call(base, "GET", "/audit").text


def test_signing_out_ends_the_session_and_wrong_guesses_wait_their_turn(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a probe: a signed-out cookie still opened every page (a copy of it kept working for 12 hours),
    and 200 guesses at once were 45 wrong guesses a second, none of them logged. Now signing out ends the
    session itself; guesses are tried one at a time, a wrong one holding the next for half a second, each
    logged, and past 10 waiting a sign-in is answered 429 without its guess being tried."""
    with serve(store, token=TOKEN) as base:
        signed = call(base, "POST", "/login", form={"token": TOKEN}, Origin=base)
        cookie = signed.headers["set-cookie"].split(";")[0]
        page = call(base, "GET", "/queue", Cookie=cookie)
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
        assert page.status == 200 and csrf is not None
        out = call(base, "POST", "/logout", form={"csrf": csrf.group(1)}, Cookie=cookie, Origin=base)
        assert out.status == 303 and "samesite=strict" in out.headers["set-cookie"].lower()
        assert call(base, "GET", "/queue", Cookie=cookie).headers.get("location") == "/login"  # the copy too
        again = call(base, "POST", "/login", form={"token": TOKEN}, Origin=base)
        assert (
            again.status == 303
            and call(base, "GET", "/queue", Cookie=again.headers["set-cookie"].split(";")[0]).status == 200
        )

        caplog.set_level(logging.WARNING, logger="jobtrail.dashboard")
        started = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            wrong = list(
                pool.map(lambda i: call(base, "POST", "/login", form={"token": f"guess-{i}"}, Origin=base), range(6))
            )
        assert [w.status for w in wrong] == [403] * 6
        assert time.monotonic() - started >= 6 * 0.5  # one after another: never faster than two a second
        said = [r.getMessage() for r in caplog.records if "wrong access token" in r.getMessage()]
        assert len(said) == 6 and not any("guess-" in line for line in said), said

        with ThreadPoolExecutor(25) as pool:
            flood = list(
                pool.map(lambda i: call(base, "POST", "/login", form={"token": f"x{i}"}, Origin=base), range(25))
            )
        assert {f.status for f in flood} == {403, 429}
        assert sum(f.status == 403 for f in flood) <= 11


def test_healthz_on_the_dashboard_and_the_webhook_receiver(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 with JSON while the database answers with the current schema; 503 naming the cause when not."""
    from jobtrail.interfaces.webhooks import webhook_app
    from jobtrail.providers.webhooks import WebhookConfig

    monkeypatch.setenv("JT_DASH_WHSEC", "whsec_" + "A" * 32)
    receiver = webhook_app(store, {"fake": WebhookConfig(secrets=("env:JT_DASH_WHSEC",))})
    with serve(store) as dash, serve_asgi(receiver) as hooks:
        for base in (dash, hooks):
            fine = call(base, "GET", "/healthz")
            assert fine.status == 200 and json.loads(fine.text)["status"] == "ok"
        sql(store, "UPDATE alembic_version SET version_num = '0008'")
        for base in (dash, hooks):
            stale = call(base, "GET", "/healthz")
            body = json.loads(stale.text)
            assert stale.status == 503 and body["status"] == "unavailable" and "revision 0008" in body["cause"]


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_ledger_file_deleted_or_replaced_under_the_dashboard_is_said_and_no_decision_is_lost(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a probe: with the SQLite file deleted (or moved away and a copy put in its place) the pages
    still listed it, /healthz said ok, and a person's decision was answered 303 while it went into the
    unlinked file (or the old one), never the ledger at --db. Now every page, /healthz and the form say
    what happened, and the file at --db keeps what it had."""
    path = tmp_path / "jobs.db"
    with Store.open(str(path)) as first:
        op_id = stuck(first)
        entries = len(first.history(op_id))
    store = Store.open(str(path))
    try:
        with serve(store, token=TOKEN) as base:
            signed = call(base, "POST", "/login", form={"token": TOKEN}, Origin=base)
            cookie = signed.headers["set-cookie"].split(";")[0]
            queue = call(base, "GET", "/queue", Cookie=cookie)
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', queue.text)
            assert queue.status == 200 and csrf is not None and op_id in queue.text
            moved = tmp_path / "elsewhere.db"
            path.rename(moved)
            if how == "replaced":
                path.write_bytes(moved.read_bytes())
            with caplog.at_level(logging.WARNING, logger="jobtrail"):
                health = call(base, "GET", "/healthz")
            # the open endpoint says the ledger cannot be read, and where it is only to the log
            assert health.status == 503 and json.loads(health.text)["cause"] == UNREACHABLE, health.text
            assert str(tmp_path) not in health.text
            assert any("deleted or moved" in r.getMessage() for r in caplog.records)
            assert call(base, "GET", "/").status in (303, 401, 503) and str(tmp_path) not in call(base, "GET", "/").text
            page = call(base, "GET", "/", Cookie=cookie)
            assert page.status == 503 and "deleted or moved" in html.unescape(page.text)
            form = {"to_state": "failed", "by": "alice", "reason": "never ran", "csrf": csrf.group(1)}
            decided = call(base, "POST", f"/ops/{op_id}/resolve", form=form, Cookie=cookie, Origin=base)
            assert decided.status == 503 and "deleted or moved" in html.unescape(decided.text)
    finally:
        store.close()
    for kept in [moved] + ([path] if how == "replaced" else []):
        with Store.open(str(kept)) as after:
            assert after.get(op_id).state is S.NEEDS_ATTENTION and len(after.history(op_id)) == entries


def test_the_command_needs_its_extra_and_help_stays_light(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    Store.open(str(db)).close()
    code = (
        "import sys\n"
        "sys.modules['jinja2'] = None\n"
        f"sys.argv = ['jobtrail', '--db', {str(db)!r}, 'dashboard']\n"
        "from jobtrail.interfaces.entry import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "pip install 'jobtrail[dashboard]'" in done.stderr, done.stderr
    probe = (
        "import sys\nfrom jobtrail.interfaces.cli.main import cli\n"
        "heavy = ('starlette', 'jinja2', 'uvicorn', 'jobtrail.interfaces.dashboard')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    light = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert light.stdout.strip() == "[]"


def test_a_long_life_shows_both_ends_of_its_timeline_and_says_how_much_is_left_out(store: Store) -> None:
    """A job polled for days has thousands of reads: the page reads the first and the last, never all."""
    from jobtrail.ledger.store import Observe

    op = op_in(store, S.OBSERVING, operation_key="polled")
    store.apply(
        [
            Observe(operation_id=op.operation_id, kind="status_poll", raw={}, http_status=200, raw_state=f"poll {i}")
            for i in range(1000)
        ]
    )
    with serve(store) as base:
        page = call(base, "GET", "/ops/polled").text
    assert "… 650 events left out …" in page
    assert "(poll 0)" in page and "(poll 49)" in page and "(poll 50)" not in page
    assert "(poll 699)" not in page and "(poll 700)" in page and "(poll 999)" in page
    assert page.index("(poll 49)") < page.index("events left out") < page.index("(poll 700)")
    seqs = [int(s) for s in re.findall(r'data-seq="(\d+)"', page)]
    assert seqs == [e.seq for e in store.history(op.operation_id)]
