"""Checks on the JSON a remote server answers, for the HTTP clients (``chunkcache serve``, vLLM).

A reply that is not JSON, or not an object with the keys and types the endpoint promises,
is a :class:`BackendUnavailableError` naming the server and the endpoint, never a bare
``KeyError``/``TypeError`` that callers would read as their own bad input.
"""

from __future__ import annotations

import json
from types import UnionType
from typing import Any

from chunkcache.core.errors import BackendUnavailableError

__all__ = ["clip", "json_object", "shaped"]


def json_object(
    text: str, where: str, server: str = "the server", /, **shape: type | UnionType
) -> dict[str, Any]:
    """``text`` parsed as a JSON object of ``shape`` (see :func:`shaped`); anything else is a
    :class:`BackendUnavailableError` saying ``server`` answered ``where`` (the endpoint) with it."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise BackendUnavailableError(
            f"{server} answered {where} with non-JSON: {text[:200]!r}"
        ) from None
    return shaped(value, where, server, **shape)


def shaped(
    value: Any, where: str, server: str = "the server", /, **shape: type | UnionType
) -> dict[str, Any]:
    """``value`` if it is a JSON object whose ``shape`` keys hold values of those types (a key
    may be missing if its type allows None), else :class:`BackendUnavailableError`."""
    if not isinstance(value, dict):
        raise BackendUnavailableError(
            f"{server} answered {where} with {clip(value)}, not a JSON object"
        )
    for key, kind in shape.items():
        if not isinstance(value.get(key), kind):
            raise BackendUnavailableError(
                f"{server} answered {where} with a missing or malformed {key!r}: {clip(value)}"
            )
    return value


def clip(value: Any) -> str:
    """``value`` as JSON, cut short for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."
