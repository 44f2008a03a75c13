"""Validation of what anyone with write access to the connections table controls: ids and upstream URLs.

Both the control plane (``fleetd ctl``) and the shards use it: a shard must refuse a URL
written by another client just as ``ctl start`` refuses it at the prompt.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from urllib.parse import SplitResult, urlsplit, urlunsplit

from fleetd.config import UpstreamConfig

MAX_ID_BYTES = 1024
MAX_URL_CHARS = 8192  # far below DynamoDB's item limit; anything longer is garbage, not a stream

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


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
        raise ValueError(f"URL {_short(text)} contains whitespace or control characters")
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


def _split(text: str) -> tuple[SplitResult, int | None]:
    try:
        parts = urlsplit(text)
        port = parts.port  # parsed lazily: a bad port only raises here
    except ValueError as e:
        raise ValueError(f"malformed URL {_short(text)}: {e}") from None
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
