"""Validation of what anyone with write access to the connections table controls: ids and upstream URLs.

Both the control plane (``fleetd ctl``) and the shards use it: a shard must refuse a URL
written by another client just as ``ctl start`` refuses it at the prompt.

:func:`validate_url` checks a URL's form and its host name against the allow-list.  Where
a name leads is only known at connect time: :func:`address_refusal` is the policy the
upstream connector (:mod:`fleetd.upstream`) applies to every resolved address before it
opens a socket to it.  :func:`redact_url` and :func:`redact_urls` keep URL credentials and
query strings (which may carry tokens) out of logs and error messages.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from urllib.parse import SplitResult, urlsplit, urlunsplit

from fleetd.config import UpstreamConfig

MAX_ID_BYTES = 1024
MAX_URL_CHARS = 8192  # far below DynamoDB's item limit; anything longer is garbage, not a stream

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")

# Why an upstream connect was refused (the ``reason`` label of ``upstream_connect_refused_total``).
REFUSAL_REASONS = ("redirect", "loopback", "private", "link_local", "multicast", "unspecified", "non_global")
_PRIVATE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the low 32 bits are the IPv4 address reached
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
REDACTED = "\u2026"  # …


def validate_id(connection_id: str) -> str:
    """Return ``connection_id`` or raise ValueError: non-empty, printable, at most 1024 UTF-8 bytes."""
    if not connection_id:
        raise ValueError("connection id is empty")
    if not connection_id.isprintable():  # also rejects undecodable argv bytes (surrogate escapes)
        raise ValueError(f"connection id {_short(connection_id)} contains control characters")
    if len(connection_id.encode()) > MAX_ID_BYTES:
        raise ValueError(f"connection id is longer than {MAX_ID_BYTES} bytes")
    return connection_id


def validate_url(url: str, cfg: UpstreamConfig) -> str:
    """Return the normalized upstream URL or raise ValueError saying what is wrong.

    Accepted: an absolute ``ws``/``wss`` URL whose scheme is in ``allowed_schemes``,
    with a valid host (DNS name, IDNA or IP literal) that is in ``allowed_hosts`` when
    that list is non-empty, an optional port 1-65535, ASCII path and query, no user
    info and no fragment.  Normalized: surrounding whitespace stripped, scheme and
    host lower-cased (IDNA-encoded), an empty path becomes ``/``.
    """
    text = url.strip()
    if not text:
        raise ValueError("URL is empty")
    if len(text) > MAX_URL_CHARS:
        raise ValueError(f"URL is longer than {MAX_URL_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"URL {_short(redact_url(text))} contains whitespace or control characters")
    parts, port = _split(text)
    scheme = _check_scheme(parts.scheme.lower(), cfg.allowed_schemes)
    if parts.username is not None or parts.password is not None:
        raise ValueError("credentials in the URL (user:password@) are not supported")
    if "#" in text:  # RFC 6455 §3: fragments are meaningless in WebSocket URIs
        raise ValueError("WebSocket URLs cannot have a #fragment")
    if not (parts.path + parts.query).isascii():
        raise ValueError("non-ASCII characters in the path or query must be percent-encoded")
    host = _check_host(parts.hostname or "", cfg.allowed_hosts)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def address_refusal(address: str | IPv4Address | IPv6Address, allowed_networks: Sequence[str] = ()) -> str | None:
    """None if an upstream may be reached at ``address``, else the reason it may not (a label value).

    Refused unless in one of ``allowed_networks``: loopback, private (RFC 1918, fc00::/7), link-local,
    multicast, unspecified and every other non-global address.  An IPv4-mapped (``::ffff:a.b.c.d``) or
    NAT64 (``64:ff9b::a.b.c.d``) IPv6 address is judged as the IPv4 address it reaches.
    """
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = IPv4Address(int(ip) & 0xFFFF_FFFF)
    reason = _address_kind(ip)
    if reason is None or any(ip in net for net in _networks(tuple(allowed_networks))):
        return None
    return reason


def _address_kind(ip: IPv4Address | IPv6Address) -> str | None:
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link_local"
    if ip.is_multicast:
        return "multicast"
    if any(ip in net for net in _PRIVATE):
        return "private"
    if not ip.is_global or ip.is_reserved or (isinstance(ip, IPv6Address) and ip.is_site_local):
        return "non_global"  # shared (100.64/10), documentation, benchmarking, reserved, 0/8, site-local …
    return None


@functools.lru_cache(maxsize=16)
def _networks(texts: tuple[str, ...]) -> tuple[IPv4Network | IPv6Network, ...]:
    return tuple(ipaddress.ip_network(t, strict=False) for t in texts)  # validated by fleetd.config


def host_exempt(host: str, allowed_hosts: Sequence[str]) -> bool:
    """True if ``host`` is listed in ``allowed_hosts``: its operator vouches for where it resolves."""
    try:
        name = _normal_host(host)
    except ValueError:
        return False
    return name in {h.lower().removesuffix(".") for h in allowed_hosts}


def redact_url(url: str) -> str:
    """``url`` fit for a log line or an error: user info, query and fragment replaced by ``…``.

    ``wss://user:pw@feed.example/s?token=abc`` becomes ``wss://…@feed.example/s?…``.  Works on
    malformed input too (no parsing that could fail).
    """
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    else:
        head += sep
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        authority = REDACTED + "@" + authority.rpartition("@")[2]
    tail, hashed, _ = tail.partition("#")
    path, queried, _ = tail.partition("?")
    return head + authority + path + ("?" + REDACTED if queried else "") + ("#" + REDACTED if hashed else "")


def redact_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def _split(text: str) -> tuple[SplitResult, int | None]:
    try:
        parts = urlsplit(text)
        port = parts.port  # parsed lazily: a bad port only raises here
    except ValueError as e:
        raise ValueError(f"malformed URL {_short(redact_url(text))}: {e}") from None
    if port == 0:
        raise ValueError("port must be in 1-65535")
    return parts, port


def _check_scheme(scheme: str, allowed: Sequence[str]) -> str:
    if not scheme:
        raise ValueError("URL has no scheme (expected wss://host/path)")
    if scheme not in allowed:
        kind = "scheme" if scheme in ("ws", "wss") else "non-WebSocket scheme"
        raise ValueError(f"{kind} {scheme!r} is not allowed (allowed: {', '.join(allowed)}; see --allowed-schemes)")
    return scheme


def _check_host(host: str, allowed_hosts: Sequence[str]) -> str:
    if not host:
        raise ValueError("URL has no host (expected wss://host/path)")
    name = _normal_host(host)
    allowed = {h.lower().removesuffix(".") for h in allowed_hosts}
    if allowed and name not in allowed:
        raise ValueError(f"host {name} is not in allowed_hosts ({', '.join(sorted(allowed))})")
    return name


def _normal_host(host: str) -> str:
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        pass
    try:
        name = host.encode("idna").decode("ascii").lower().removesuffix(".")
    except UnicodeError:
        raise ValueError(f"invalid host {_short(host)}") from None
    labels = name.split(".")
    # An all-digit last label is a mistyped IP address, never a real top-level domain.
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"invalid host {_short(host)}")
    return name


def _short(text: str, limit: int = 120) -> str:
    """repr() of user input, cut so that garbage cannot flood the one error line."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
