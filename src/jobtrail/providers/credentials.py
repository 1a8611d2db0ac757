"""Credentials by reference (``env:NAME``, ``file:PATH``, ``keyring:SERVICE/USER`` or a callable).

A reference is resolved only when a request is sent; the value lives in a
:class:`~jobtrail.domain.redact.Secret`, is registered with the redactor, and
never reaches the record.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobtrail.domain.errors import ConfigError
from jobtrail.domain.redact import Redactor, Secret

CredentialSource = str | Callable[[], str]


@dataclass(frozen=True, slots=True)
class Credential:
    """A credential by reference, and how it is put on a request."""

    ref: CredentialSource
    scheme: str  # "bearer" | "header:<Name>" | "basic:<user>"

    def describe(self) -> str:
        return self.ref if isinstance(self.ref, str) else "callable"

    def resolve(self, redactor: Redactor) -> Secret:
        """Read the value now; ``redactor`` (the provider's) masks it from then on."""
        ref = self.ref
        if callable(ref):
            value = ref()
        elif ref.startswith("env:"):
            value = os.environ.get(ref[4:], "")
            if not value:
                raise ConfigError(f"credential {ref}: the environment variable {ref[4:]} is not set")
        elif ref.startswith("file:"):
            try:
                value = Path(ref[5:]).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"credential {ref}: cannot read the file ({exc.strerror})") from None
        elif ref.startswith("keyring:"):
            service, _, user = ref[8:].partition("/")
            try:
                import keyring  # type: ignore[import-not-found]
            except ImportError:
                raise ConfigError(f"credential {ref}: install the keyring package to use keyring:") from None
            value = keyring.get_password(service, user) or ""
            if not value:
                raise ConfigError(f"credential {ref}: no password stored for {service}/{user}")
        else:
            raise ConfigError(f"credential {ref!r}: use env:NAME, file:PATH or keyring:SERVICE/USER")
        secret = Secret(value, redactor=redactor)
        if self.scheme.startswith("basic:"):
            redactor.register_basic(self.scheme[6:], value)
        return secret

    def headers(self, secret: Secret) -> dict[str, str]:
        if self.scheme == "bearer":
            return {"Authorization": f"Bearer {secret.reveal()}"}
        if self.scheme.startswith("header:"):
            return {self.scheme[7:]: secret.reveal()}
        user = self.scheme[6:]
        encoded = base64.b64encode(f"{user}:{secret.reveal()}".encode()).decode()
        return {"Authorization": f"Basic {encoded}"}
