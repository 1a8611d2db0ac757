"""The dashboard (``jobtrail dashboard``, the ``dashboard`` extra): server-rendered pages over the ledger.

htmx (static/htmx.min.js) is version 2.0.11, under the Zero-Clause BSD licence (static/htmx.LICENSE),
vendored so that no page loads anything from elsewhere.
"""

from jobtrail.interfaces.dashboard.app import dashboard_app

__all__ = ["dashboard_app"]
