"""What users need to test their own adapters and flows against real HTTP.

``FakeProvider`` is a real HTTP server on 127.0.0.1 that behaves like an async
job API with IETF ``Idempotency-Key`` semantics, and misbehaves on request
(see :class:`Fault`). It counts every request so a test can assert "exactly
one job was created".
"""

from __future__ import annotations

from jobtrail.testing._fake_provider import (
    FakeJob,
    FakeProvider,
    Fault,
    provider_toml,
    send_webhook,
    signed_headers,
)

__all__ = ["FakeJob", "FakeProvider", "Fault", "provider_toml", "send_webhook", "signed_headers"]
