"""Who may write through the dashboard, and how a form proves it came from the dashboard itself.

Without an access token the dashboard only reads: no form is shown and every POST but the
login's is refused. With one (``--token-env NAME``), a person signs in once with the token and
gets a session cookie (HttpOnly, SameSite=Strict); every page then needs it, and every POST must
carry the session, come from the dashboard's own origin (``Origin``, else ``Referer``) and carry
the session's CSRF token in its form. Sessions and CSRF tokens are HMACs under a key made at
start: a restart signs everyone out. Signing out ends the session here too (its id is kept until
its time would have run out), not only in the browser that asked.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jobtrail.domain.redact import Secret

if TYPE_CHECKING:
    from starlette.requests import Request

SESSION_COOKIE = "jobtrail_session"
#: a session lasts a working day; then sign in again
SESSION_S = 12 * 3600


class Access:
    """The access token (or none: read-only) and the per-process key that signs sessions."""

    def __init__(self, token: Secret | None) -> None:
        self._token = token
        self._key = secrets.token_bytes(32)
        #: sessions signed out before their time ran out (id: when issued), forgotten once it would have
        self._ended: dict[str, int] = {}

    @property
    def writable(self) -> bool:
        return self._token is not None

    def token_matches(self, given: str) -> bool:
        if self._token is None:
            return False
        return hmac.compare_digest(given.encode(), self._token.reveal().encode())

    def _mac(self, purpose: str, value: str) -> str:
        return hmac.new(self._key, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def new_session(self) -> str:
        """A fresh session cookie value: a random id and its signature."""
        sid = f"{secrets.token_hex(16)}-{int(time.time())}"
        return f"{sid}.{self._mac('session', sid)}"

    def session(self, request: Request) -> str | None:
        """The signed-in session id of ``request``, or None."""
        if self._token is None:
            return None
        value = request.cookies.get(SESSION_COOKIE, "")
        sid, _, mac = value.partition(".")
        if not sid or not hmac.compare_digest(mac, self._mac("session", sid)):
            return None
        issued = sid.rpartition("-")[2]
        if not issued.isdigit() or time.time() - int(issued) > SESSION_S or sid in self._ended:
            return None
        return sid

    def end(self, sid: str) -> None:
        """Sign ``sid`` out for good: a copy of its cookie (another browser, a stolen one) opens nothing more."""
        now = time.time()
        self._ended = {s: at for s, at in self._ended.items() if now - at <= SESSION_S}
        self._ended[sid] = int(sid.rpartition("-")[2])

    def csrf_token(self, sid: str) -> str:
        return self._mac("csrf", sid)

    def csrf_matches(self, sid: str, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.csrf_token(sid).encode())


def own_origin(request: Request) -> str:
    """The origin the browser used to reach this dashboard (scheme and the Host it sent)."""
    return f"{request.url.scheme}://{request.headers.get('host', '')}"


def same_origin(request: Request, public_origin: str | None = None) -> bool:
    """Whether a POST comes from a page of this dashboard: its Origin (else its Referer) is ours.

    Ours is the origin the request reached, or ``public_origin`` (``--origin``), the one people use
    when a TLS proxy in front forwards plain HTTP. A request with neither header is refused: every
    browser sends Origin on a POST form, and a client that strips both cannot be told apart from a
    forged one.
    """
    mine = {own_origin(request), *([public_origin.rstrip("/")] if public_origin else [])}
    origin = request.headers.get("origin")
    if origin is not None:
        return origin in mine
    referer = request.headers.get("referer")
    return referer is not None and any(referer == m or referer.startswith(m + "/") for m in mine)


_DEFAULT_PORT = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _name_and_port(authority: str, scheme: str) -> tuple[str, int | None] | None:
    """``host[:port]`` as (lower-case name without brackets, port or None); None when it is not one."""
    try:
        parts = urlsplit(f"//{authority}")
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name or parts.username is not None or parts.path or parts.query or parts.fragment:
        return None
    return name, port


def host_allowed(scope: Mapping[str, Any], public_origin: str | None = None) -> bool:
    """Whether the ``Host`` a request names is one this dashboard is reached by: the address the connection came
    in on (and ``localhost`` when that address is a loopback one), or the host of ``public_origin``.

    A page from another site can rename itself to this address (DNS rebinding): its requests then reach
    127.0.0.1 as same-origin ones, with that site's name in ``Host``. Refusing every other name is what keeps
    "it listens on 127.0.0.1" a protection. A connection over a Unix socket has no address to compare.
    """
    server = scope.get("server")
    if not server or server[1] is None:
        return True
    scheme = str(scope.get("scheme", "http"))
    headers = dict(scope.get("headers") or [])
    named = _name_and_port(headers.get(b"host", b"").decode("latin-1"), scheme)
    if named is None:
        return False
    name, port = named
    port = port if port is not None else _DEFAULT_PORT.get(scheme)
    address, server_port = str(server[0]).strip("[]").lower(), int(server[1])
    names = {address}
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        pass
    else:
        # on a dual-stack socket an IPv4 client arrives at ::ffff:127.0.0.1, and asks for 127.0.0.1
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        if mapped is not None:
            names.add(str(mapped))
        if (mapped or ip).is_loopback:
            names.add("localhost")
    if name in names and port == server_port:
        return True
    if public_origin:
        public = urlsplit(public_origin)
        public_port = public.port if public.port is not None else _DEFAULT_PORT.get(public.scheme)
        # behind a proxy the Host may be the public one, with or without its port
        return name == (public.hostname or "") and named[1] in (None, public_port)
    return False
