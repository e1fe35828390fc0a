"""Who may talk to ``ggpipe serve``: Host and Origin checks (pure logic).

A server on 127.0.0.1 is reachable by every web page the user's browser
opens. Two attacks follow, and two checks stop them:

* **DNS rebinding**: a page at ``http://evil.example`` re-resolves its own
  name to 127.0.0.1 and reads the answers, same-origin. The request then
  carries ``Host: evil.example``: only names the server knows are accepted
  (:func:`host_allowed`: ``localhost``, any IP literal, and ``--allowed-hosts``).
* **Cross-site requests**: a page POSTs to ``http://127.0.0.1:8080`` (no
  preflight for ``text/plain``). POST bodies must be ``application/json``
  (which needs a CORS preflight, refused unless the origin is allowed), and a
  request whose ``Origin`` is not in ``--allowed-origins`` is refused
  (:func:`origin_allowed`). Ollama's ``OLLAMA_ORIGINS`` is the model.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class Access:
    """Who may use the server besides the API key (the checks below).

    Attributes:
        allowed_hosts: Host names accepted besides IP literals and localhost.
        allowed_origins: browser origins allowed (CORS); none by default.
        max_body_bytes: largest request body, bytes (larger: HTTP 413).
    """

    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20


def split_host(header: str) -> str:
    """The host name of a ``Host`` header, lower case, without the port
    (``"[::1]:8080"`` -> ``"::1"``, ``"Example.org:80"`` -> ``"example.org"``)."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h[1:]
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_allowed(header: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """Is a request with this ``Host`` header (None: absent) to be served?

    Accepted: no header (not a browser), an IP literal (a rebinding page
    cannot make its own origin an IP), ``localhost`` and ``*.localhost``, and
    each entry of ``allowed``: an exact name, ``.example.org`` for it and its
    subdomains, or ``*`` for every host.
    """
    if header is None or not header.strip():
        return True
    name = split_host(header)
    if _is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    for a in allowed:
        a = a.strip().lower()
        if a == "*" or a == name or (a.startswith(".") and (name.endswith(a) or name == a[1:])):
            return True
    return False


def origin_allowed(origin: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """Is a request with this ``Origin`` header (None: absent, i.e. not a
    cross-site browser request) to be served? Only origins listed in
    ``allowed`` (exactly, e.g. ``http://localhost:3000``, or ``*``)."""
    if origin is None:
        return True
    o = origin.strip().rstrip("/").lower()
    return any(a == "*" or a.strip().rstrip("/").lower() == o for a in allowed)


def is_json_content_type(header: str | None) -> bool:
    """``application/json`` (any parameters, e.g. ``; charset=utf-8``)."""
    return header is not None and header.split(";", 1)[0].strip().lower() == "application/json"
