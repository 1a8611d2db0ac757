"""``/healthz`` for the dashboard and the webhook receiver: can this process do its work now?"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobtrail.ledger.migrate import schema_health

if TYPE_CHECKING:
    from starlette.responses import Response

    from jobtrail.ledger.store import Store


def health_response(store: Store) -> Response:
    """200 with JSON when the database answers and its schema is current; else 503 naming the cause."""
    from starlette.responses import JSONResponse

    fine, what = schema_health(store)
    if fine:
        return JSONResponse({"status": "ok", "database": store.dialect, "detail": what})
    return JSONResponse({"status": "unavailable", "database": store.dialect, "cause": what}, status_code=503)
