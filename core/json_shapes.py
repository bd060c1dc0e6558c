"""Checks on the JSON a remote server answers, for the HTTP clients (``chunkcache serve``, vLLM).

A reply that is not JSON, or not an object with the keys and types the endpoint promises,
is a :class:`BackendUnavailableError` naming the server and the endpoint, never a bare
``KeyError``/``TypeError`` that callers would read as their own bad input.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from types import UnionType
from typing import Any

from chunkcache.core.errors import BackendUnavailableError

__all__ = ["clip", "completion_events", "error_message", "json_object", "shaped"]

SSE_FIELDS = frozenset({"data", "event", "id", "retry"})


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


def completion_events(lines: Iterable[str], where: str, server: str) -> Iterator[dict[str, Any]]:
    """The events of an OpenAI completion stream (server-sent events), up to
    ``data: [DONE]``: each a JSON object whose ``choices``, ``usage`` and ``error`` have
    their types.  A line that is not SSE, an ``error`` event, or a stream that ends before
    ``[DONE]`` (a cut-off answer) is a :class:`BackendUnavailableError`."""
    count = 0
    for line in lines:
        field, _, value = line.partition(":")
        if not field:  # a blank line ends an event; a leading colon is a comment
            continue
        if field not in SSE_FIELDS:
            raise BackendUnavailableError(
                f"{server} answered {where} with something other than server-sent "
                f"events: {line[:200]!r}"
            )
        if field != "data":
            continue
        data = value.strip()
        if data == "[DONE]":
            return
        event = json_object(
            data, where, server, choices=list | None, usage=dict | None, error=dict | None
        )
        if (error := event.get("error")) is not None:
            raise BackendUnavailableError(
                f"{server} failed mid-stream: {error.get('message') or clip(error)}"
            )
        count += 1
        yield event
    raise BackendUnavailableError(
        f"{server} ended the {where} stream without data: [DONE], after {count} "
        "event(s): the answer is cut off"
    )


def clip(value: Any) -> str:
    """``value`` as JSON, cut short for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def error_message(text: str) -> tuple[str, Any]:
    """The message and code of an OpenAI-style error body (``{"error": {"message": ...,
    "code": ...}}``); for any other body, its first 200 characters and None."""
    try:
        error = json.loads(text)["error"]
        return str(error["message"]), error.get("code")
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return text[:200], None
