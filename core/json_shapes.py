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
    ``[DONE]`` (a cut-off answer) is a :class:`BackendUnavailableError`; an event with
    empty or blank data carries nothing and is skipped."""
    count = 0
    for data in _event_data(lines, where, server):
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


def _event_data(lines: Iterable[str], where: str, server: str) -> Iterator[str]:
    """The data of each server-sent event in ``lines``, stripped, when it is not blank.

    As the SSE spec reads a stream: an event's ``data`` lines are joined with newlines and
    the event is dispatched at the blank line that ends it; an event the stream ends
    before its blank line is dropped (it may be cut off).  Other fields and comments
    (a leading colon) are skipped."""
    data: list[str] = []
    for line in lines:
        if not line:
            text = "\n".join(data).strip()
            data.clear()
            if text:
                yield text
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value)
        elif field and field not in SSE_FIELDS:
            raise BackendUnavailableError(
                f"{server} answered {where} with something other than server-sent "
                f"events: {line[:200]!r}"
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
