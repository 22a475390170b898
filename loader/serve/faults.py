"""Fault injection for `kernels serve`: misbehave on purpose, per request, reproducibly.

A plan is a comma-separated list of rules `KIND:WHEN[:OPTION...]`, plus an optional `seed=N`:

    500:0.3                       answer 30% of requests with HTTP 500 (any status 400-599)
    429:0.1:retry-after=1         ... with a Retry-After header (its text is sent verbatim)
    reset:0.1                     drop the connection with a TCP reset, no response at all
    truncate:0.1                  send the headers and half the body, then close the connection
    slow:0.1:2s                   trickle the body out over 2 seconds
    delay:0.1:500ms               wait before answering (exercises client read timeouts)
    corrupt:0.05                  flip one byte of a file body (same length, same headers)
    500:first=2                   only the first 2 requests the rule applies to (deterministic)
    500:first=2:each              ... counted per request path: every file fails twice
    reset:first=1:match=/resolve/ only requests whose path contains "/resolve/"
    seed=7                        seed of the random draws (default 0)

Rules are tried in order and the first that fires decides the request. Body faults (truncate,
slow, corrupt) apply only to GET responses that have a body; `corrupt` only to file bodies (the
resolve and /_lfs/ routes), so it exercises digest checks rather than JSON parsing. Probabilities
draw from one seeded RNG, so a single client sees the same faults on every run.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from .protocol import Response, json_response

BODY_KINDS = frozenset({"truncate", "slow", "corrupt"})
KINDS = frozenset({"status", "reset", "delay"}) | BODY_KINDS
_FILE_ROUTES = ("/resolve/", "/_lfs/")
_MAX_EVENTS = 100_000


class FaultSpecError(ValueError):
    """A --faults spec that cannot be parsed."""


@dataclass(frozen=True)
class Rule:
    """One fault rule: what to do (`kind`, `status`, `seconds`) and when (`probability` / `first`)."""

    kind: str
    status: int | None = None
    probability: float | None = None
    first: int | None = None
    each: bool = False
    match: str | None = None
    seconds: float = 0.0
    retry_after: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FaultSpecError(f"unknown fault kind {self.kind!r}")
        if self.kind == "status" and (self.status is None or not 400 <= self.status <= 599):
            raise FaultSpecError(f"fault status must be 400-599, got {self.status!r}")
        if (self.probability is None) == (self.first is None):
            raise FaultSpecError(f"{self.name}: give either a probability or first=N")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise FaultSpecError(f"{self.name}: probability {self.probability} is not in [0, 1]")
        if self.first is not None and self.first < 0:
            raise FaultSpecError(f"{self.name}: first={self.first} is negative")
        if self.kind in ("slow", "delay") and self.seconds <= 0:
            raise FaultSpecError(f"{self.name} needs a duration, e.g. {self.kind}:0.1:2s")

    @property
    def name(self) -> str:
        return str(self.status) if self.kind == "status" else self.kind

    def applies_to(self, method: str, path: str, response: Response) -> bool:
        if self.match is not None and self.match not in path:
            return False
        if self.kind in BODY_KINDS:
            has_body = bool(response.body) or bool(response.stream and response.length)
            if method != "GET" or not has_body or response.status not in (200, 206):
                return False
            if self.kind == "corrupt" and not any(r in path for r in _FILE_ROUTES):
                return False
        return True


@dataclass(frozen=True)
class Event:
    """One request the plan saw: when (time.monotonic()), what, and the fault injected (or None)."""

    at: float
    method: str
    path: str
    fault: str | None


@dataclass(frozen=True)
class Fault:
    """A fault chosen for one request; `draw` (in [0, 1)) picks the byte a corrupt fault flips."""

    rule: Rule
    draw: float

    @property
    def kind(self) -> str:
        return self.rule.kind

    def apply(self, response: Response) -> Response:
        """The response to send instead (sleeping first for `delay`). Not for `reset`."""
        rule = self.rule
        if rule.kind == "status":
            headers = {"Retry-After": rule.retry_after} if rule.retry_after is not None else {}
            return json_response(
                {"error": f"injected fault: HTTP {rule.status}"}, rule.status, headers
            )
        if rule.kind == "delay":
            time.sleep(rule.seconds)
            return response
        body = _body_of(response)
        if rule.kind == "corrupt":
            flipped = bytearray(body)
            flipped[int(self.draw * len(body))] ^= 0xFF
            return Response(response.status, dict(response.headers), bytes(flipped))
        if rule.kind == "truncate":
            return Response(
                response.status,
                dict(response.headers),
                length=len(body),
                stream=_cut_after(body[: len(body) // 2]),
            )
        return Response(
            response.status,
            dict(response.headers),
            length=len(body),
            stream=_trickle(body, rule.seconds),
        )


class FaultPlan:
    """Rules plus a seeded RNG and counters; one per server, safe to share between threads."""

    def __init__(self, rules: list[Rule], seed: int = 0, spec: str | None = None):
        self.rules = list(rules)
        self.seed = seed
        self.spec = spec if spec is not None else ",".join(r.name for r in self.rules)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._seen: Counter[tuple[int, str]] = Counter()  # (rule index, path or "") -> matches
        self.injected: Counter[str] = Counter()  # rule name -> faults injected
        self.events: deque[Event] = deque(maxlen=_MAX_EVENTS)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse a spec (see the module docstring); raises FaultSpecError."""
        rules, seed = [], 0
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            if item.startswith("seed="):
                seed = _int(item[5:], item)
                continue
            rules.append(_parse_rule(item))
        if not rules:
            raise FaultSpecError(f"no fault rules in {spec!r}")
        return cls(rules, seed, spec)

    def decide(self, method: str, path: str, response: Response) -> Fault | None:
        """Pick the fault (if any) for one request, record it, and return it."""
        with self._lock:
            chosen = None
            for index, rule in enumerate(self.rules):
                if not rule.applies_to(method, path, response):
                    continue
                if rule.first is not None:
                    key = (index, path if rule.each else "")
                    self._seen[key] += 1
                    fires = self._seen[key] <= rule.first
                else:
                    fires = self._rng.random() < (rule.probability or 0.0)
                if fires:
                    chosen = Fault(rule, self._rng.random())
                    self.injected[rule.name] += 1
                    break
            self.events.append(Event(time.monotonic(), method, path, chosen and chosen.rule.name))
        return chosen

    def attempts(self, fragment: str) -> list[Event]:
        """Events of requests whose path contains `fragment`, oldest first."""
        with self._lock:
            return [e for e in self.events if fragment in e.path]

    def describe(self) -> str:
        return f"{self.spec} (seed {self.seed})"


def reset_connection(sock: socket.socket) -> None:
    """Drop a connection with a TCP RST: the client sees 'connection reset', not a clean close."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    # Closing the descriptor now (not when the handler's file objects let go of it) is what
    # sends the RST; the socket object is left without a descriptor, so later calls fail safely.
    os.close(sock.detach())


def _parse_rule(item: str) -> Rule:
    head, *rest = item.split(":")
    if not rest:
        raise FaultSpecError(f"{item!r}: expected KIND:PROBABILITY or KIND:first=N")
    if head.isdigit():
        kind, status = "status", int(head)
    else:
        kind, status = head, None
    when, options = rest[0], rest[1:]
    fields: dict[str, Any] = {"kind": kind, "status": status}
    if when.startswith("first="):
        fields["first"] = _int(when[6:], item)
    else:
        try:
            fields["probability"] = float(when)
        except ValueError:
            raise FaultSpecError(f"{item!r}: {when!r} is not a probability") from None
    for option in options:
        key, sep, value = option.partition("=")
        if option == "each":
            fields["each"] = True
        elif sep and key == "retry-after":
            fields["retry_after"] = value
        elif sep and key == "match":
            fields["match"] = value
        elif not sep:
            fields["seconds"] = _seconds(option, item)
        else:
            raise FaultSpecError(f"{item!r}: unknown option {key!r}")
    return Rule(**fields)


def _int(text: str, item: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise FaultSpecError(f"{item!r}: {text!r} is not an integer") from None


def _seconds(text: str, item: str) -> float:
    """'2s', '500ms' or a bare number of seconds."""
    scale = 1.0
    if text.endswith("ms"):
        text, scale = text[:-2], 0.001
    elif text.endswith("s"):
        text = text[:-1]
    try:
        value = float(text) * scale
    except ValueError:
        raise FaultSpecError(f"{item!r}: {text!r} is not a duration like 2s or 500ms") from None
    if not value > 0 or value == float("inf"):
        raise FaultSpecError(f"{item!r}: duration must be positive and finite")
    return value


class _Capture:
    """Stands in for the socket a streamed response writes to, to get its bytes in memory."""

    def __init__(self) -> None:
        self.data = bytearray()

    def sendfile(self, file: Any, offset: int = 0, count: int | None = None) -> None:
        file.seek(offset)
        self.data += file.read(count) if count is not None else file.read()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


def _body_of(response: Response) -> bytes:
    """The whole body, in memory (faulted responses only, so the cost is the test's)."""
    if response.stream is None:
        return response.body
    capture = _Capture()
    response.stream(capture, capture.write)  # type: ignore[arg-type]
    return bytes(capture.data)


def _cut_after(part: bytes):
    def send(_sock: socket.socket, write) -> None:
        write(part)
        # The handler treats a reset peer as "close quietly": the client gets a short body.
        raise ConnectionResetError("injected fault: body truncated")

    return send


def _trickle(body: bytes, seconds: float, pieces: int = 20):
    step = max(1, -(-len(body) // pieces))
    starts = range(0, len(body), step)

    def send(_sock: socket.socket, write) -> None:
        for start in starts:
            time.sleep(seconds / len(starts))
            write(body[start : start + step])

    return send
