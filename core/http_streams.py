"""Streamed HTTP answers that any thread can stop at once: :class:`HttpStream`.

A thread reading a streamed answer (server-sent events) blocks on the socket until the
server's next event, which before the first token is the server's whole queue wait and
prefill.  Closing the answer from another thread, or cancelling the asyncio task that
reads it through :func:`~chunkcache.core.prompting.arun_stream`, must not wait for that
event: the server keeps generating until it sees the client go.  So each request travels
on a connection of its own (:func:`own_connection_client`) whose socket
:class:`StreamConnection` learns from httpx's ``trace`` extension, and :meth:`HttpStream.cancel`
shuts that socket down under the reading thread.  The ``http`` and ``vllm`` backends stream
this way.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import httpx

from chunkcache.core.errors import BackendUnavailableError
from chunkcache.core.generation import GenerationChunk

__all__ = ["HttpStream", "StreamConnection", "own_connection_client"]

# The events after which httpcore's network stream (TLS over TCP once started) is there.
_CONNECTED = ("connection.connect_tcp.complete", "connection.start_tls.complete")


def own_connection_client(**options: Any) -> httpx.Client:
    """An ``httpx.Client`` (``options`` as it takes them) that opens a new connection for every
    request: httpx names a pooled connection only once the answer's headers are in, too late
    for a :class:`StreamConnection` to cut a request the server has not answered yet."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), **options)


class StreamConnection:
    """The socket one streamed request travels on, which another thread may cut.

    Pass :attr:`extensions` with the request: httpx reports the socket through its trace
    extension as the connection opens.  A read blocked on it elsewhere only wakes on a
    shutdown (closing the socket leaves it waiting, and the server would not see the client
    go).
    """

    def __init__(self) -> None:
        self.cut = False
        self._stream: Any = None  # httpcore's network stream, once connected
        self._lock = threading.Lock()

    @property
    def extensions(self) -> dict[str, Any]:
        """The httpx request extensions that let this object follow the request."""
        return {"trace": self.trace}

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        """httpx's trace hook: keeps the connection's stream, cut at once if cut already."""
        if event in _CONNECTED:
            with self._lock:
                self._stream = info.get("return_value")
                if self.cut:
                    self._shutdown()

    def cut_now(self) -> None:
        """Shut the connection down now (or as soon as it opens); safe from any thread."""
        with self._lock:
            self.cut = True
            self._shutdown()

    def _shutdown(self) -> None:
        sock = None if self._stream is None else self._stream.get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError):  # closed already
            # socket.socket's own: an SSLSocket's drops its TLS state under the reading thread
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class HttpStream(Iterator[GenerationChunk]):
    """One request's pieces as the server streams them (the last carries the stats).

    ``pieces`` reads the answer on ``connection`` and raises :class:`BackendUnavailableError`
    when it breaks; once the stream is cancelled, that break just ends it.
    """

    def __init__(self, pieces: Generator[GenerationChunk], connection: StreamConnection) -> None:
        self._pieces = pieces
        self._connection = connection
        self._stepping = threading.Lock()  # held while a piece is read

    def __next__(self) -> GenerationChunk:
        with self._stepping:
            if self._connection.cut:
                self._pieces.close()
                raise StopIteration
            try:
                return next(self._pieces)
            except BackendUnavailableError:
                if self._connection.cut:  # what cutting it does to a read in flight
                    raise StopIteration from None
                raise

    def cancel(self) -> None:
        """Close the request now, from any thread: the server stops generating for it and
        the stream just ends, also while another thread waits for its next piece."""
        self._connection.cut_now()

    def close(self) -> None:
        """Cancel, and close the stream at once when no piece is being read (else the
        reading thread closes it); safe from any thread."""
        self.cancel()
        if self._stepping.acquire(blocking=False):
            try:
                self._pieces.close()
            finally:
                self._stepping.release()
