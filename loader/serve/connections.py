"""The server's open connections: a bound on their number, and deadlines while they wait.

Each connection holds a thread and a file descriptor. Clients that open connections and never
finish a request (slowloris) used to hold them until the process ran out of descriptors, and then
nobody was answered. So each connection is in one of three states: IDLE (waiting for the first
byte of a request), READING (a request has started: its line, headers and body must all arrive
within REQUEST_DEADLINE seconds, however slowly the bytes trickle) and BUSY (being answered). At
the bound, a new connection closes the one that has waited longest for a request (idle or
reading), never one being answered; the reaper closes any that pass their deadline.
"""

from __future__ import annotations

import socket
import threading
import time

IDLE, READING, BUSY = "idle", "reading", "busy"
IDLE_TIMEOUT = 120.0  # seconds a keep-alive connection may wait for its next request
REQUEST_DEADLINE = 30.0  # seconds from a request's first byte to the end of its headers
MAX_CONNECTIONS = 1024
REAP_EVERY = 0.25


def default_limit() -> int:
    """Half the process's descriptor limit (the rest: files, git pipes, logs), at most
    MAX_CONNECTIONS: 512 under the usual `ulimit -n` of 1024."""
    try:
        import resource
    except ImportError:  # Windows: no descriptor limit to read
        return MAX_CONNECTIONS
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft // 2))


class Connections:
    """Open connections by state, oldest change first; thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._states: dict[socket.socket, tuple[str, float]] = {}  # insertion order = age
        self._last_reap = 0.0

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    def add(self, sock: socket.socket) -> bool:
        """Track a new connection, closing the longest-waiting one when at the bound; False
        (the caller closes `sock`) when every open connection is being answered."""
        with self._lock:
            if len(self._states) >= self.limit and not self._evict_locked():
                return False
            self._states[sock] = (IDLE, time.monotonic())
            return True

    def set(self, sock: socket.socket, state: str) -> None:
        """Record that `sock` is now `state` (ignored once it was closed to make room)."""
        with self._lock:
            if self._states.pop(sock, None) is not None:
                self._states[sock] = (state, time.monotonic())

    def remove(self, sock: socket.socket) -> None:
        with self._lock:
            self._states.pop(sock, None)

    def evict_one(self) -> bool:
        """Close the longest-waiting connection (the process is out of descriptors)."""
        with self._lock:
            return self._evict_locked()

    def reap(self) -> None:
        """Close connections past their deadline (at most every REAP_EVERY seconds)."""
        now = time.monotonic()
        if now - self._last_reap < REAP_EVERY:
            return
        self._last_reap = now
        limits = {IDLE: IDLE_TIMEOUT, READING: REQUEST_DEADLINE}
        with self._lock:
            late = [
                sock
                for sock, (state, since) in self._states.items()
                if state in limits and now - since > limits[state]
            ]
            for sock in late:
                del self._states[sock]
        for sock in late:
            _cut(sock)

    def all(self) -> list[socket.socket]:
        with self._lock:
            return list(self._states)

    def _evict_locked(self) -> bool:
        for sock, (state, _since) in self._states.items():
            if state != BUSY:
                del self._states[sock]
                _cut(sock)
                return True
        return False


def _cut(sock: socket.socket) -> None:
    """End a connection another thread is reading: its read returns at once and it closes."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
