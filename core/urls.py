"""The ``base_url`` and API key of a remote server, checked once for every HTTP client
(``chunkcache serve``, vLLM): an http(s) URL with a host, given with or without its ``/v1``,
and a key an HTTP header can carry.

>>> server_root("http://127.0.0.1:8000/v1/")
'http://127.0.0.1:8000'
"""

from __future__ import annotations

import unicodedata

from chunkcache.core.errors import UsageError

__all__ = ["check_api_key", "server_root"]


def server_root(base_url: str, name: str = "base_url") -> str:
    """``base_url`` without surrounding whitespace, a trailing ``/`` or ``/v1``.

    A ValueError naming it as ``name`` (the setting or option that gave it) unless it is an
    http(s) URL with a host (``http:///v1``, ``ftp://host``, ``localhost:8000`` and ``""`` are
    refused) and nothing the client would send wrongly: whitespace inside, a port outside
    1-65535, a query or fragment (the API paths would land inside them), or
    ``user:password@`` (it would replace the ``api_key`` and show in error messages); a
    TypeError when it is not a string."""
    import httpx  # here, not at the top: chunkcache.core imports this module without it

    if not isinstance(base_url, str):
        raise TypeError(f"{name} must be a str, got {type(base_url).__name__}")
    root = base_url.strip().rstrip("/").removesuffix("/v1")
    try:
        url = httpx.URL(root)
    except httpx.InvalidURL as e:
        raise ValueError(f"{name} {base_url!r} is not a valid URL: {e}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(
            f"{name} must be an http(s) URL with a host, like 'http://127.0.0.1:8000', "
            f"got {base_url!r}"
        )
    if any(c.isspace() for c in root):
        raise ValueError(f"{name} {base_url!r} has whitespace inside it")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"{name} {base_url!r} has a port outside 1-65535")
    if "?" in root or "#" in root:
        raise ValueError(f"{name} {base_url!r} must not have a query or a fragment")
    if url.userinfo:
        raise ValueError(
            f"{name} must not carry credentials (user:password@); pass the API key on its "
            f"own, got a {name} for host {url.host!r}"
        )
    return root


def check_api_key(key: str, name: str) -> None:
    """:class:`UsageError` unless ``key`` (the setting ``name``) can be a bearer token:
    visible ASCII characters (RFC 6750), which an HTTP header carries as they are.  The
    message names the first character that cannot be by its position, never the key."""
    for position, char in enumerate(key, 1):
        if not "!" <= char <= "~":
            raise UsageError(
                f"{name} must be visible ASCII characters (it travels in an HTTP header): "
                f"its character {position} is {_describe(char)}"
            )


def _describe(char: str) -> str:
    """``char`` for an error message about a secret: named only if it is a space or a
    control or format character, which no one means to have in a key."""
    if char.isspace() or unicodedata.category(char)[0] in "CZ":
        return f"U+{ord(char):04X} ({unicodedata.name(char, 'a control character')})"
    return "not ASCII"
