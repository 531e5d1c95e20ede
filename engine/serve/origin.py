"""Whether a request comes from a web page of another site (for the API's cross-site refusal).

Browsers send `Origin` with every cross-origin POST, including the "simple" ones that need no CORS
preflight (a form post, a `text/plain` or multipart fetch): the request reaches the server and does its
work even though the page can never read the answer. So the API refuses a POST whose Origin is not the
server itself. Clients that are not browsers (the openai SDK, curl, gateways) send no Origin and are not
affected.
"""
from __future__ import annotations

from typing import Mapping
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    parts = urlsplit(f"//{netloc}")
    try:
        port = parts.port
    except ValueError:          # a malformed port: compares unequal to anything
        return netloc.lower(), -1
    return (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def foreign_origin(headers: Mapping[str, str]) -> str | None:
    """The request's Origin when it names another site than the one it was sent to (the Host, or the
    X-Forwarded-Host a reverse proxy sets), else None. `Origin: null` (sandboxed frames, files) is
    foreign."""
    origin = headers.get("origin")
    if origin is None:
        return None
    o = urlsplit(origin.strip())
    if o.scheme not in ("http", "https") or not o.netloc:
        return origin[:100]
    mine = _host_port(o.netloc, o.scheme)
    for host in (headers.get("x-forwarded-host"), headers.get("host")):
        for h in (host or "").split(","):
            if h.strip() and _host_port(h.strip(), o.scheme) == mine:
                return None
    return origin[:100]
