"""The dashboard in a real headless Chromium (Playwright driving Debian's /usr/bin/chromium), as a person uses it.

Skipped when that browser is missing, unless JOBTRAIL_REQUIRE_BROWSER=1 (CI), which makes it a failure.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from jobtrail import ConflictingJobIds, Store
from jobtrail.domain.redact import Secret
from jobtrail.interfaces.dashboard import dashboard_app

from helpers import S, op_in, serve_asgi

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "browser-test-token-9876543210"


def _browser_missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401 - only whether it imports
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    problem = _browser_missing()
    if problem is not None:
        if os.environ.get("JOBTRAIL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"JOBTRAIL_REQUIRE_BROWSER=1 but {problem}")
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM))
        yield chromium
        chromium.close()


@contextmanager
def serve(store: Store, token: str | None = None) -> Iterator[str]:
    with serve_asgi(dashboard_app(store, token=Secret(token, redactor=store.redactor) if token else None)) as base:
        yield base


@contextmanager
def other_site(html: str) -> Iterator[str]:
    """Another origin (another port of 127.0.0.1) serving one page."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Store]:
    store = Store.open(str(tmp_path / "browser.db"))
    yield store
    store.close()


def needs_attention(store: Store, key: str) -> str:
    op = op_in(store, S.CREATE_PENDING, operation_key=key, caller="bob")
    return store.transition(
        op,
        S.NEEDS_ATTENTION,
        ConflictingJobIds(first_job_id="job-a", second_job_id="job-b"),
        actor="worker",
        changes={"state_reason": "the same token answered with two job ids"},
    ).operation_id


def sign_in(page: Any, base: str) -> None:
    page.goto(base + "/")
    assert page.url.endswith("/login")
    page.fill("input[name=token]", TOKEN)
    page.click("button:has-text('Sign in')")
    page.wait_for_url(base + "/")


def listed(page: Any) -> list[str]:
    return [a.inner_text() for a in page.query_selector_all("#rows td.op > a")]


def test_the_list_filters_by_state_and_key(browser: Any, ledger: Store) -> None:
    op_in(ledger, S.SUCCEEDED, operation_key="nightly-1")
    op_in(ledger, S.FAILED, operation_key="nightly-2")
    op_in(ledger, S.FAILED, operation_key="weekly-1")
    needs_attention(ledger, "stuck-1")
    with serve(ledger) as base:
        page = browser.new_page()
        page.goto(base + "/")
        assert listed(page) == ["stuck-1", "weekly-1", "nightly-2", "nightly-1"]
        page.select_option("select[name=state]", "failed")
        page.click("button:has-text('Filter')")
        page.wait_for_url("**state=failed**")
        assert listed(page) == ["weekly-1", "nightly-2"]
        page.fill("input[name=key]", "nightly-2")
        page.click("button:has-text('Filter')")
        page.wait_for_url("**key=nightly-2**")
        assert listed(page) == ["nightly-2"]
        page.click("a:has-text('clear')")
        page.click(".counts a:has-text('needs_attention')")  # the count by state is a filter too
        page.wait_for_url("**state=needs_attention**")
        assert listed(page) == ["stuck-1"]


def test_an_operations_timeline_shows_its_history_in_order_with_its_deadlines(browser: Any, ledger: Store) -> None:
    op = op_in(ledger, S.OBSERVING, operation_key="timed")
    ledger.add_observation(op.operation_id, kind="status_poll", raw={}, http_status=200, remote_state="running")
    history = ledger.history(op.operation_id)
    with serve(ledger) as base:
        page = browser.new_page()
        page.goto(base + "/")
        page.click("a:has-text('timed')")
        page.wait_for_url(f"{base}/ops/{op.operation_id}")
        seqs = [int(li.get_attribute("data-seq")) for li in page.query_selector_all("#timeline li[data-seq]")]
        assert seqs == [e.seq for e in history]
        items = page.query_selector_all("#timeline ol.events > li")
        texts = [li.inner_text() for li in items]
        for name in ("create deadline", "result deadline", "cancel deadline", "now"):
            assert any(name in t for t in texts), texts
        times = [t.split(" ", 2)[:2] for t in texts]
        assert times == sorted(times)  # one time axis: every item, deadlines included, in time order
        assert len(page.query_selector_all("#timeline svg line.mark")) == 4  # three deadlines and now on the axis
        assert page.inner_text(".advice").startswith("wait: a worker will poll the remote job")


def test_a_person_resolves_a_needs_attention_operation_through_the_form(browser: Any, ledger: Store) -> None:
    op_id = needs_attention(ledger, "conflict")
    with serve(ledger, token=TOKEN) as base:
        page = browser.new_context().new_page()
        sign_in(page, base)
        page.click("nav a:has-text('Needs a person')")
        card = page.locator(f"li#{op_id}")
        card.locator("select[name=to_state]").select_option("accepted")
        card.locator("input[name=job_id]").fill("job-b")
        card.locator("input[name=by]").fill("Alice Example")
        card.locator("input[name=reason]").fill("job-b is the one in the console; cancelled job-a by hand")
        card.locator("button:has-text('Record decision')").click()
        page.wait_for_url(f"{base}/ops/{op_id}")
        assert "accepted" in page.inner_text("h1")
        last = page.query_selector_all("#timeline li[data-seq]")[-1].inner_text()
        assert "needs_attention → accepted" in last and "person:Alice Example (dashboard)" in last
    entry = ledger.history(op_id)[-1]
    assert entry.actor == "person:Alice Example (dashboard)"
    evidence = json.loads(entry.evidence)
    assert evidence["decided_by"] == "Alice Example (dashboard)"
    assert evidence["reason"] == "job-b is the one in the console; cancelled job-a by hand"
    assert ledger.get(op_id).remote_job_id == "job-b"


def test_a_request_without_the_token_or_from_another_origin_is_refused(browser: Any, ledger: Store) -> None:
    op_id = needs_attention(ledger, "target")
    with serve(ledger, token=TOKEN) as base:
        stranger = browser.new_context().new_page()
        stranger.goto(base + "/queue")
        assert stranger.url == base + "/login" and stranger.locator("form.decide").count() == 0

        context = browser.new_context()
        page = context.new_page()
        sign_in(page, base)
        page.goto(base + "/queue")
        csrf = page.locator("input[name=csrf]").first.get_attribute("value")
        # even with the session's own CSRF token, a form on another origin is refused (by its Origin header)
        forged = (
            f'<form method="post" action="{base}/ops/{op_id}/resolve">'
            f'<input name="csrf" value="{csrf}"><input name="to_state" value="failed">'
            '<input name="by" value="mallory"><input name="reason" value="forged">'
            '<button id="go">go</button></form>'
        )
        with other_site(forged) as evil:
            page.goto(evil)
            with page.expect_navigation() as sent:
                page.click("#go")
            answer = sent.value
            assert answer is not None and answer.status == 403
            assert "not sent from this dashboard" in page.inner_text("body")
    assert ledger.get(op_id).state is S.NEEDS_ATTENTION
    assert all("mallory" not in e.actor for e in ledger.history(op_id))


@pytest.mark.long
def test_htmx_refreshes_a_live_timeline_under_the_content_security_policy(browser: Any, ledger: Store) -> None:
    """The vendored htmx runs under the CSP (no inline script, no eval) and brings new events in by itself."""
    op = op_in(ledger, S.OBSERVING, operation_key="live")
    with serve(ledger) as base:
        page = browser.new_page()
        problems: list[str] = []
        page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
        page.goto(f"{base}/ops/{op.operation_id}")
        before = page.locator("#timeline li.ev").count()
        ledger.add_observation(op.operation_id, kind="status_poll", raw={}, http_status=200, remote_state="running")
        # (Playwright's wait_for_function evaluates a string: the CSP forbids that too)
        page.locator("#timeline li.ev").nth(before).wait_for(timeout=15_000)
        assert "status read" in page.locator("#timeline li.ev").last.inner_text()
        assert problems == []


def test_a_page_refreshing_itself_after_its_session_ended_goes_to_the_sign_in_page_whole(
    browser: Any, ledger: Store
) -> None:
    """Found by a probe: signed out in another tab, a live timeline's next refresh followed the redirect and put
    the whole sign-in page, header and all, inside the timeline, which then stopped refreshing. Now the
    page itself goes to the sign-in page."""
    op = op_in(ledger, S.OBSERVING, operation_key="live")
    with serve(ledger, token=TOKEN) as base:
        context = browser.new_context()
        try:
            page, other = context.new_page(), context.new_page()
            sign_in(page, base)
            page.goto(f"{base}/ops/{op.operation_id}")
            other.goto(f"{base}/queue")
            other.click("button:has-text('Sign out')")
            other.wait_for_url(base + "/login")
            page.wait_for_url(base + "/login", timeout=15_000)  # the timeline refreshes every 5 s
            assert page.locator("input[name=token]").count() == 1 and page.locator("header").count() == 1
        finally:
            context.close()
