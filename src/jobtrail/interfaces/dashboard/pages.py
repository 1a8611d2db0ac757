"""The dashboard's pages: the list, one operation, the needs-a-person queue, workers, providers, audit.

Reads go through the ledger's browsing queries (:mod:`jobtrail.ledger.browse`) and the store's own
methods; the one write, a person's decision, goes through :func:`jobtrail.flows.resolve.decide`,
the code path of ``jobtrail resolve``. Sync handlers run in Starlette's thread pool, so a slow
database never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.errors import JobtrailError
from jobtrail.domain.explain import advice, next_action
from jobtrail.domain.redact import Secret
from jobtrail.domain.states import FINAL_STATES, State
from jobtrail.flows.escalation import bundle_markdown, escalation_bundle
from jobtrail.flows.resolve import DECISIONS, decide
from jobtrail.interfaces.dashboard.security import SESSION_COOKIE, SESSION_S, Access, same_origin
from jobtrail.interfaces.dashboard.timeline import build, when
from jobtrail.interfaces.health import health_response
from jobtrail.ledger import browse
from jobtrail.ledger.results import stored_result
from jobtrail.ledger.store import Store
from jobtrail.runtime.liveness import GONE_AFTER_S, no_worker

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

_US = 1_000_000
#: a name or a reason longer than this is refused (the history keeps what a person typed, not a file)
_MAX_NAME, _MAX_REASON = 100, 2000
#: how long the list's provider choices are reused before the ledger is asked again
_IN_USE_S = 30.0
#: what a person typed into the search box is cut here: the search is a lookup, not a scan
_MAX_TEXT = 200
#: sign-ins from one address waiting for their turn past this many are answered 429 at once (not tried)
_MAX_GUESSING = 10

_STALE_CSRF = "the form's CSRF token is missing or stale: reload the page and send it again"

_log = logging.getLogger("jobtrail.dashboard")


class Pages:
    """Every page's handler, over one store and one access policy."""

    def __init__(
        self,
        store: Store,
        access: Access,
        *,
        templates_dir: Path,
        provider_files: Sequence[str] = (),
        anchor_path: str | None = None,
        anchor_key: Secret | None = None,
        public_origin: str | None = None,
    ) -> None:
        import jinja2

        self.store = store
        self.access = access
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(templates_dir),
            autoescape=True,  # every value a provider or a caller wrote is untrusted text
            undefined=jinja2.StrictUndefined,
        )
        self.env.globals.update(when=when, next_action=next_action, states=[s.value for s in State])
        self.anchor_path = anchor_path
        self.public_origin = public_origin
        self.anchor_key = anchor_key
        self.provider_reports = [_provider_report(path) for path in provider_files]
        self.last_audit: dict[str, Any] | None = None
        #: (when, names): the providers in use change rarely, and finding them reads a whole index
        self._in_use: tuple[float, list[str]] = (0.0, [])
        self._one_guess = asyncio.Lock()
        self._guessing: dict[str, int] = {}  # sign-ins waiting their turn, by the address they come from
        self._wrong = 0
        #: held while an audit runs: one at a time, however many ask
        self._auditing = threading.Lock()
        self._audit_started: str | None = None

    # -- plumbing ---------------------------------------------------------------------------

    def _render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        from starlette.responses import HTMLResponse

        sid = self.access.session(request)
        html = self.env.get_template(name).render(
            path=request.url.path,
            writable=self.access.writable,
            signed_in=sid is not None,
            csrf=self.access.csrf_token(sid) if sid else "",
            **context,
        )
        return HTMLResponse(html, status_code=status, headers={"cache-control": "no-store"})

    def _gate(self, request: Request) -> Response | None:
        """With a token set, every page needs a signed-in session: a redirect to the sign-in page."""
        from starlette.responses import RedirectResponse, Response

        if self.access.writable and self.access.session(request) is None:
            if request.headers.get("hx-request"):
                # a page's own refresh: htmx would follow a redirect and put the whole sign-in page inside it,
                # so the whole page goes to the sign-in instead
                return Response(status_code=401, headers={"hx-redirect": "/login", "cache-control": "no-store"})
            return RedirectResponse("/login", status_code=303)
        return None

    def unavailable(self, request: Request, exc: Exception) -> Response:
        """The ledger could not be read or written (locked, unreachable, its file gone): 503, naming the cause."""
        return self._render(request, "unavailable.html", status=503, why=str(exc))

    def _refused(self, request: Request, why: str) -> Response:
        return self._render(request, "refused.html", status=403, why=why)

    def _write_check(self, request: Request, form: Any) -> str | None:
        """Why this POST may not write, or None: token set, signed in, our own origin, the session's CSRF token."""
        if not self.access.writable:
            return "this dashboard is read-only: start it with --token-env to let people record decisions"
        sid = self.access.session(request)
        if sid is None:
            return "sign in with the access token first"
        if not same_origin(request, self.public_origin):
            return "the form was not sent from this dashboard (its Origin or Referer is another site's)"
        if not self.access.csrf_matches(sid, str(form.get("csrf", ""))):
            return _STALE_CSRF
        return None

    # -- the list -----------------------------------------------------------------------------

    def operations(self, request: Request) -> Response:
        if (gate := self._gate(request)) is not None:
            return gate
        query = request.query_params
        try:
            chosen = tuple(State(s) for s in query.getlist("state") if s)
        except ValueError:
            return self._render(request, "refused.html", status=400, why="unknown state in the filter")
        filters = browse.Filters(
            states=chosen,
            provider=query.get("provider") or None,
            caller=query.get("caller") or None,
            key=query.get("key") or None,
            text=(query.get("q") or "").strip()[:_MAX_TEXT] or None,
        )
        store = self.store
        page = browse.list_page(store, filters, before=query.get("before") or None, limit=50)
        counts = browse.counts_by_state(store)
        filtered = bool(filters.states or filters.provider or filters.caller or filters.key or filters.text)
        total = browse.count_matching(store, filters) if filtered else sum(counts.values())
        context: dict[str, Any] = {
            "page": page,
            "total": total,
            "filters": filters,
            "chosen": {s.value for s in chosen},
            "query": [(k, v) for k, v in query.multi_items() if k not in ("before", "part") and v],
            "before": query.get("before") or "",
        }
        if request.headers.get("hx-request") and query.get("part") == "rows":
            return self._render(request, "_rows.html", **context)
        waiting = sum(counts.get(s, 0) for s in browse.PERSON_STATES)
        return self._render(
            request,
            "list.html",
            counts=[(s.value, counts[s]) for s in State if s in counts],
            needing=browse.needs_person(store, limit=5),
            waiting=waiting,
            providers=self._providers_in_use(),
            **context,
        )

    def _providers_in_use(self) -> list[str]:
        at, names = self._in_use
        if time.monotonic() - at > _IN_USE_S:
            names = browse.providers_in_use(self.store)
            self._in_use = (time.monotonic(), names)
        return names

    # -- one operation ----------------------------------------------------------------------------

    def operation(self, request: Request) -> Response:
        if (gate := self._gate(request)) is not None:
            return gate
        store = self.store
        try:
            op = store.resolve(request.path_params["operation_id"])
        except JobtrailError as exc:  # no such id or key, or a key several providers use
            return self._render(request, "refused.html", status=404, why=str(exc))
        history = store.history(op.operation_id)
        observations, left_out = browse.observation_window(store, op.operation_id)
        timeline = build(op, history, observations, store.clock(), left_out=left_out)
        context: dict[str, Any] = {"op": op, "timeline": timeline, "live": op.state not in FINAL_STATES}
        if request.headers.get("hx-request") and request.query_params.get("part") == "timeline":
            return self._render(request, "_timeline.html", **context)
        result = stored_result(store, op.operation_id)
        bundle = escalation_bundle(store, op.operation_id)
        return self._render(
            request,
            "operation.html",
            advice=advice(op),
            no_worker=no_worker(store, op),
            result=result,
            checks=(result or {}).get("checks") or [],
            summary=(result or {}).get("summary"),
            bundle=bundle,
            bundle_text=bundle_markdown(bundle),
            deadlines=[
                ("create", op.create_deadline_us),
                ("result", op.result_deadline_us),
                ("cancel", op.cancel_deadline_us),
            ],
            person=op.state in browse.PERSON_STATES,
            decisions=DECISIONS,
            **context,
        )

    # -- the needs-a-person queue, and deciding ------------------------------------------------------

    def queue(self, request: Request, *, error: str | None = None, status: int = 200) -> Response:
        if (gate := self._gate(request)) is not None:
            return gate
        waiting = browse.needs_person(self.store, limit=100)
        return self._render(request, "queue.html", status=status, waiting=waiting, decisions=DECISIONS, error=error)

    async def resolve(self, request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import RedirectResponse

        form = await request.form()
        why = self._write_check(request, form)
        if why is not None:
            return self._refused(request, why)
        to_state = str(form.get("to_state", ""))
        name = str(form.get("by", "")).strip()
        reason = str(form.get("reason", "")).strip()
        job_id = str(form.get("job_id", "")).strip() or None
        problem, status = None, 400
        if to_state not in DECISIONS:
            problem = f"choose one of {', '.join(DECISIONS)}"
        elif not name or len(name) > _MAX_NAME:
            problem = f"say who decides (your name, at most {_MAX_NAME} characters)"
        elif not reason or len(reason) > _MAX_REASON:
            problem = f"say why (at most {_MAX_REASON} characters): the history keeps it"
        ref = request.path_params["operation_id"]
        if problem is None:
            try:
                op = await run_in_threadpool(
                    decide, self.store, ref, to_state, decided_by=f"{name} (dashboard)", reason=reason, job_id=job_id
                )
            except JobtrailError as exc:  # the state machine's refusal, or no such operation
                problem, status = str(exc), 409
            else:
                return RedirectResponse(f"/ops/{op.operation_id}", status_code=303)
        return await run_in_threadpool(self.queue, request, error=f"{ref}: {problem}", status=status)

    # -- workers, providers, audit ------------------------------------------------------------------

    def workers(self, request: Request) -> Response:
        if (gate := self._gate(request)) is not None:
            return gate
        now = self.store.clock()
        rows = [
            {
                **w,
                "status": "stopped"
                if w["stopped_at_us"] is not None
                else ("running" if now - w["seen_at_us"] < GONE_AFTER_S * _US else "gone (no heartbeat)"),
                "ago": f"{(now - w['seen_at_us']) / _US:.0f} s ago",
            }
            for w in browse.recent_workers(self.store)
        ]
        return self._render(request, "workers.html", workers=rows, gone_after=GONE_AFTER_S, jobtrail=self.store.command)

    def providers(self, request: Request) -> Response:
        if (gate := self._gate(request)) is not None:
            return gate
        return self._render(request, "providers.html", reports=self.provider_reports, in_use=self._providers_in_use())

    def audit(self, request: Request) -> Response:
        if (gate := self._gate(request)) is not None:
            return gate
        running = self._audit_started if self._auditing.locked() else None
        return self._render(request, "audit.html", audit=self.last_audit, anchor_path=self.anchor_path, running=running)

    async def run_audit(self, request: Request) -> Response:
        """A POST from the audit page's own form (it reads the whole ledger: no other site may start it, nor a
        link, nor a reload), one at a time: asked while one runs, the page says so and shows its result."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import RedirectResponse

        form = await request.form()
        if (gate := self._gate(request)) is not None:
            return gate
        if not same_origin(request, self.public_origin):
            return self._refused(request, "the audit was not asked for from this dashboard's own page")
        sid = self.access.session(request)
        if sid is not None and not self.access.csrf_matches(sid, str(form.get("csrf", ""))):
            return self._refused(request, _STALE_CSRF)
        await run_in_threadpool(self._audit_once)
        return RedirectResponse("/audit", status_code=303)

    def _audit_once(self) -> None:
        if not self._auditing.acquire(blocking=False):
            return  # one is running: its result is what this asker will see
        try:
            self._audit_started = rfc3339(self.store.clock())
            self.last_audit = self._verify()
        finally:
            self._auditing.release()

    def _verify(self) -> dict[str, Any]:
        from jobtrail.ledger.audit import load_anchor, verify

        started = time.monotonic()
        out: dict[str, Any] = {"at": rfc3339(self.store.clock()), "anchor": None, "error": None, "report": None}
        try:
            anchor = load_anchor(self.anchor_path) if self.anchor_path else None
            if anchor is not None:
                out["anchor"] = {k: anchor.get(k) for k in ("created_at", "root", "operations", "entries", "hmac_key")}
            out["report"] = verify(self.store, anchor=anchor, key=self.anchor_key).to_json()
        except JobtrailError as exc:
            out["error"] = str(exc)
        out["seconds"] = f"{time.monotonic() - started:.1f}"
        return out

    # -- signing in ------------------------------------------------------------------------------

    def login_form(self, request: Request) -> Response:
        return self._render(request, "login.html", error=None)

    async def login(self, request: Request) -> Response:
        from starlette.responses import RedirectResponse

        form = await request.form()
        if not self.access.writable:
            return self._refused(request, "this dashboard is read-only: it has no access token to sign in with")
        if not same_origin(request, self.public_origin):
            return self._refused(request, "the sign-in form was not sent from this dashboard")
        # counted by address: one guesser's queue may not shut the others out (they wait their turn, no more)
        client = request.client.host if request.client else ""
        if self._guessing.get(client, 0) >= _MAX_GUESSING:
            return self._render(
                request, "login.html", status=429, error="too many sign-ins at once: wait a moment and try again"
            )
        self._guessing[client] = self._guessing.get(client, 0) + 1
        try:
            # one guess at a time for the whole dashboard, and a wrong one holds the next for half a second: at
            # most two wrong guesses a second, however many connections a guesser opens
            async with self._one_guess:
                right = self.access.token_matches(str(form.get("token", "")))
                if not right:
                    self._wrong += 1
                    _log.warning(
                        "dashboard: a wrong access token from %s (%d wrong since the dashboard started)",
                        client or "an unknown address",
                        self._wrong,
                    )
                    await asyncio.sleep(0.5)
        finally:
            self._guessing[client] -= 1
            if not self._guessing[client]:
                del self._guessing[client]
        if not right:
            return self._render(request, "login.html", status=403, error="that is not the access token")
        answer = RedirectResponse("/", status_code=303)
        answer.set_cookie(
            SESSION_COOKIE,
            self.access.new_session(),
            max_age=SESSION_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https" or (self.public_origin or "").startswith("https://"),
        )
        return answer

    async def logout(self, request: Request) -> Response:
        from starlette.responses import RedirectResponse

        form = await request.form()
        why = self._write_check(request, form)
        if why is not None:
            return self._refused(request, why)
        sid = self.access.session(request)
        if sid is not None:
            self.access.end(sid)
        answer = RedirectResponse("/login", status_code=303)
        answer.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
        return answer

    # -- health ---------------------------------------------------------------------------------

    def healthz(self, request: Request) -> Response:
        return health_response(self.store)


def _provider_report(path: str) -> dict[str, Any]:
    from jobtrail.providers.contract import guarantees
    from jobtrail.providers.http import load_provider

    try:
        return {"path": path, "report": guarantees(load_provider(path)), "error": None}
    except JobtrailError as exc:
        return {"path": path, "report": None, "error": str(exc)}
