"""Where jobtrail may send a request, and with what.

Every URL is compared by origin (scheme, normalised host, port with defaults made
explicit), never as a string: ``http://127.0.0.1:18001`` is not under
``http://127.0.0.1:1800`` and ``https://api.example.com.evil.net`` is not
``https://api.example.com``. Userinfo is refused in every URL, so a reference such
as ``@127.0.0.2:9911/steal`` can never move a request to another host.

Three kinds of destination exist:

* the *home* origin, exactly the origin of ``base_url``: the only one that receives
  the credential and the provider file's headers;
* *declared download hosts* (``[result] download_hosts``): a result link a provider
  hands out (pre-signed storage URLs) is fetched there without credential or
  provider headers; a host name must resolve to public addresses only, checked on
  every address after resolution and connected to exactly as checked, so DNS
  rebinding cannot switch it; an IP address the operator wrote down is allowed as is;
* everything else: refused before any connection, with the reason and the key that
  would allow it.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import urllib.parse
from dataclasses import dataclass

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from jobtrail.providers.contract import NoAnswer

DOWNLOAD_HOSTS_KEY = "result.download_hosts"

_DEFAULT_PORTS = {"http": 80, "https": 443}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_BAD_URL_CHAR = re.compile(r"[\x00-\x20\x7f\\]")
# legacy IPv4 spellings (2130706433, 0x7f.1, 127.1) that resolvers map onto addresses
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*$")
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?$")


class UrlRefused(Exception):
    """A URL jobtrail will not send a request to; ``reason`` says why, ``host`` names where."""

    def __init__(self, reason: str, host: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.host = host


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    #: lower-case ASCII (IDNA), no trailing dot; an IP address in its canonical form (IPv6 unbracketed)
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if _DEFAULT_PORTS.get(self.scheme) == self.port:
            return f"{self.scheme}://{host}"
        return f"{self.scheme}://{host}:{self.port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@functools.lru_cache(maxsize=1024)  # every request judges its host: the same few, thousands of times
def normalise_host(host: str) -> str:
    """Lower-case, IDNA-encoded, without a trailing dot; IP addresses canonical. Raises UrlRefused."""
    raw = host.strip("[]") if host.startswith("[") else host
    if not raw:
        raise UrlRefused("the URL has no host")
    if "%" in raw:
        raise UrlRefused("a scoped IPv6 address (with %zone) is not accepted", raw)
    address = _ip(raw)
    if address is not None:
        return address.compressed
    name = raw.rstrip(".").lower() if raw != "." else ""
    if not name:
        raise UrlRefused("the URL has no host", raw)
    try:
        name = name.encode("idna").decode("ascii")
    except UnicodeError:
        raise UrlRefused("the host name is not a valid internationalised name", raw) from None
    if _NUMERIC_HOST.match(name):
        raise UrlRefused("a legacy numeric IPv4 form (use the dotted address)", raw)
    if not all(_LABEL.match(label) for label in name.split(".")):
        raise UrlRefused("the host name has characters a host name cannot have", raw)
    return name


def parse(url: str) -> tuple[Origin, yarl.URL]:
    """The origin of an absolute http(s) URL and the parsed URL to request (the same parse).

    Refused: other schemes, userinfo, control characters, whitespace or backslashes, a bad
    port, and any URL the standard library and the HTTP client would read differently.
    """
    if _BAD_URL_CHAR.search(url):
        raise UrlRefused("the URL contains whitespace, control characters or a backslash")
    try:
        split = urllib.parse.urlsplit(url)
        split_port = split.port
        parsed = yarl.URL(url)
    except ValueError as exc:
        raise UrlRefused(f"not a valid URL ({exc})") from None
    scheme = (parsed.scheme or "").lower()
    if scheme not in _DEFAULT_PORTS:
        raise UrlRefused(f"only http and https URLs are followed, not {scheme or 'a relative reference'}")
    if "@" in split.netloc or parsed.user is not None or parsed.password is not None:
        raise UrlRefused("the URL carries userinfo (user@host), which is never accepted", parsed.host or "")
    if parsed.raw_host is None or split.hostname is None:
        raise UrlRefused("the URL has no host")
    host = normalise_host(parsed.raw_host)
    if normalise_host(split.hostname) != host:
        raise UrlRefused("the URL's host is ambiguous (parsers disagree)", parsed.raw_host)
    port = parsed.port if parsed.port is not None else _DEFAULT_PORTS[scheme]
    if (split_port or _DEFAULT_PORTS[scheme]) != port or not 0 < port < 65536:
        raise UrlRefused("the URL's port is invalid or ambiguous", host)
    return Origin(scheme, host, port), parsed


def origin_of(url: str) -> Origin:
    return parse(url)[0]


#: NAT64's well-known prefix (RFC 6052): a translator on the path carries such an address to the IPv4 one in
#: its last 32 bits, an internal one included
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
#: NAT64 prefixes for local use (RFC 8215): the embedded address's place depends on the network, and
#: nothing global lives there
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


def is_special(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Loopback, private, link-local, multicast, unspecified, reserved or otherwise not global: also an
    IPv6 address that carries such an IPv4 one to a translator (IPv4-mapped, 6to4, NAT64)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address in _NAT64_LOCAL:
            return True
        if address in _NAT64:
            address = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        elif address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif address.sixtofour is not None and is_special(address.sixtofour):
            # a 6to4 relay delivers to the IPv4 address in bits 16-48 (the address itself counts as global)
            return True
    return (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
        or not address.is_global
    )


@dataclass(frozen=True, slots=True)
class HostRule:
    """One entry of ``download_hosts``: an exact host or ``*.domain``, one scheme, one port."""

    scheme: str
    host: str
    port: int
    wildcard: bool = False

    def matches(self, origin: Origin) -> bool:
        if origin.scheme != self.scheme or origin.port != self.port:
            return False
        if self.wildcard:
            return origin.host.endswith("." + self.host) and _ip(origin.host) is None
        return origin.host == self.host

    def __str__(self) -> str:
        return str(Origin(self.scheme, ("*." if self.wildcard else "") + self.host, self.port))

    @property
    def is_address(self) -> bool:
        return not self.wildcard and _ip(self.host) is not None


def parse_host_rule(entry: str) -> HostRule:
    """``storage.example.com``, ``*.s3.amazonaws.com``, ``host:port`` (https) or ``http://host:port``.

    Raises ValueError with what is wrong.
    """
    text = entry.strip()
    if "://" not in text:
        text = "https://" + text
    wildcard = False
    if text.split("://", 1)[1].startswith("*."):
        wildcard = True
        text = text.replace("*.", "", 1)
    try:
        origin, parsed = parse(text)
    except UrlRefused as exc:
        raise ValueError(exc.reason) from None
    if parsed.raw_path not in ("", "/") or parsed.raw_query_string or parsed.raw_fragment:
        raise ValueError("a host, not a URL with a path, query or fragment")
    if wildcard and (_ip(origin.host) is not None or origin.host.count(".") < 1):
        raise ValueError("a wildcard needs a domain of at least two labels, e.g. *.s3.amazonaws.com")
    return HostRule(origin.scheme, origin.host, origin.port, wildcard)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request goes: the parsed URL and whether it is the home origin (credential attached)."""

    url: yarl.URL
    origin: Origin
    home: bool


class EgressPolicy:
    """The home origin and the declared download hosts of one provider."""

    def __init__(self, base_url: str, download_hosts: tuple[HostRule, ...] = ()) -> None:
        self.base_url = base_url.rstrip("/")
        self.home = origin_of(self.base_url)
        self.download_hosts = download_hosts
        # base_url passed parse(), so its authority ends before this "/" (or at a "/" of its own path):
        # any URL that starts with these exact characters has base_url's authority, whatever follows
        self._home_prefix = self.base_url + "/"

    def resolve_reference(self, ref: str) -> str:
        """An absolute URL for a provider-supplied reference (absolute, or relative to ``base_url``).

        A relative reference is resolved as a path below ``base_url`` (RFC 3986 joining), so
        ``@host:port/x`` becomes a path segment and cannot change the host. A network-path
        reference (``//host/x``) names another host and is judged like an absolute URL.
        """
        if _BAD_URL_CHAR.search(ref):
            raise UrlRefused("the reference contains whitespace, control characters or a backslash")
        if _SCHEME.match(ref):
            return ref
        if ref.startswith("//"):
            return f"{self.home.scheme}:{ref}"
        return urllib.parse.urljoin(self.base_url + "/", ref)

    def under_base(self, url: str) -> bool:
        """Whether ``url`` starts with ``base_url`` itself (and has no character a URL may not have): then
        it goes to the home origin, decided without a parse. False says nothing: judge such a URL."""
        return url.startswith(self._home_prefix) and not _BAD_URL_CHAR.search(url)

    def is_home(self, url: str) -> bool:
        """Whether ``url`` goes to the home origin (the credential may go with it); never raises.

        The URLs of the provider file's own paths are :meth:`under_base`; anything else is judged
        by origin (:meth:`judge`).
        """
        if self.under_base(url):
            return True
        try:
            return self.judge(url).home
        except UrlRefused:
            return False

    def judge(self, url: str) -> Target:
        """The target for ``url``, or UrlRefused naming the host and what would allow it."""
        origin, parsed = parse(url)
        if origin == self.home:
            return Target(parsed, origin, home=True)
        rule = next((r for r in self.download_hosts if r.matches(origin)), None)
        if rule is None:
            # an entry for this host on another scheme or port (a bare host is https on 443) is the common
            # slip: say which, and how to write the one this URL needs
            near = next((r for r in self.download_hosts if r.matches(Origin(r.scheme, origin.host, r.port))), None)
            how = (
                f"{DOWNLOAD_HOSTS_KEY} has {near}, another scheme or port: add {str(origin)!r} to allow this one"
                if near is not None
                else f"add it to {DOWNLOAD_HOSTS_KEY} in the provider file to allow it"
            )
            raise UrlRefused(
                f"{origin} is neither the provider's origin ({self.home}) nor a declared download host ({how})",
                origin.host,
            )
        address = _ip(origin.host)
        if address is not None and is_special(address) and not rule.is_address:
            raise UrlRefused(
                f"{origin.host} is a loopback, private, link-local or reserved address "
                f"(only an address written in {DOWNLOAD_HOSTS_KEY} itself is allowed)",
                origin.host,
            )
        return Target(parsed, origin, home=False)


class AddressRefused(OSError):
    """A declared download host resolved to an address that is not public."""


class PublicOnlyResolver(AbstractResolver):
    """Resolves a name and refuses it unless EVERY address is public.

    aiohttp connects to exactly the addresses this returns, so the address checked is the
    address connected to: a second, different DNS answer (rebinding) is never used.
    """

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        for info in found:
            address = _ip(str(info["host"]).split("%", 1)[0])
            if address is None or is_special(address):
                raise AddressRefused(
                    f"{host} resolves to {info['host']}, a loopback, private, link-local or reserved address "
                    f"(a host in {DOWNLOAD_HOSTS_KEY} must resolve to public addresses only)"
                )
        return found

    async def close(self) -> None:
        await self._inner.close()


def refusal(exc: UrlRefused, *, url_key: str) -> NoAnswer:
    """A request not made because its URL was refused: what the observation records."""
    return NoAnswer(
        "refused",
        f"no request made to {exc.host or 'that URL'} (from {url_key}): {exc.reason}",
        {"host": exc.host or "", "source": url_key},
    )
