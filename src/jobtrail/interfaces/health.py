"""``/healthz`` for the dashboard and the webhook receiver: can this process do its work now?"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jobtrail.ledger.migrate import schema_health

if TYPE_CHECKING:
    from starlette.responses import Response

    from jobtrail.ledger.store import Store

log = logging.getLogger("jobtrail")


def health_response(store: Store) -> Response:
    """200 with JSON when the database answers and its schema is current; else 503 naming the cause (one that
    would show where the database is, and who connects to it, goes to the log: the page is open to anyone)."""
    from starlette.responses import JSONResponse

    fine, what, detail = schema_health(store)
    if detail is not None:
        log.warning("/healthz: %s", detail)
    if fine:
        return JSONResponse({"status": "ok", "database": store.dialect, "detail": what})
    return JSONResponse({"status": "unavailable", "database": store.dialect, "cause": what}, status_code=503)
