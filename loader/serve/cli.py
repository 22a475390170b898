"""`kernels serve DIR`: run a mirror in the foreground until SIGINT or SIGTERM.

Errors use the command line's one style: an `error:` line and a `hint:` line on stderr, exit 2
for bad input and 1 when the server cannot start. The access log (`-v`) and the warnings carry
UTC timestamps, so a long-running mirror's log can be read against a client's.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from .. import settings
from ..errors import KernelsError
from .faults import FaultPlan, FaultSpecError
from .mirror import Mirror, list_repos, looks_like_hub_layout
from .server import MirrorServer

DEFAULT_PORT = 8000
EXIT_FAIL, EXIT_USAGE = 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernels serve",
        description=(
            "Serve DIR/<org>/<name> git repos (built by `kernels mirror build` or written by "
            "`kernels export`) read-only over the Hugging Face Hub's HTTP protocol; point "
            "clients at it with HF_ENDPOINT=<the printed url>."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="folder of repos (DIR/<org>/<name>)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    parser.add_argument(
        "--no-lfs-redirect",
        action="store_true",
        help="send LFS files from the resolve URL itself instead of a 302 to the /_lfs/ route",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every request to stderr")
    # For the reliability tests only (see kernels.serve.faults): hidden from users' --help.
    parser.add_argument("--faults", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class TimestampedLog:
    """A text stream that starts every line it is given with a UTC timestamp."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        lines = text.splitlines(keepends=True)
        with self._lock:
            for line in lines:
                self._stream.write(f"{_stamp()} {line}")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def _fail(message: str, hint: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    print(f"hint: {hint}", file=sys.stderr)
    return status


def _warn(message: str) -> None:
    print(f"{_stamp()} warning: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run `kernels serve`; returns the exit status (0 after SIGINT/SIGTERM, 2 for bad input,
    1 when the server cannot start)."""
    args = _parser().parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
        return _fail(
            f"{args.dir} is not a readable directory",
            "give the folder of repos (DIR/<org>/<name>) that `kernels mirror build` or "
            "`kernels export` wrote",
            EXIT_USAGE,
        )
    if not 0 <= args.port <= 65535:
        return _fail(
            f"port {args.port} is out of range", "use 1-65535, or --port 0 for a free one", 2
        )
    try:
        faults = FaultPlan.parse(args.faults) if args.faults else None
    except FaultSpecError as exc:
        return _fail(f"--faults: {exc}", "see kernels.serve.faults for the grammar", EXIT_USAGE)
    try:
        Mirror(root).trusted_publishers()  # a broken config fails now, not at the first request
        server = MirrorServer(
            root,
            host=args.host,
            port=args.port,
            lfs_redirect=not args.no_lfs_redirect,
            access_log=TimestampedLog(sys.stderr) if args.verbose else None,
            control_token=settings.serve_token(),  # the request log over HTTP
        )
    except KernelsError as exc:
        return _fail(exc.message, exc.hint, EXIT_USAGE)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            hint = "another server holds that port: pass --port 0 to pick a free one"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            hint = "ports below 1024 need privileges: use a higher --port (or --port 0)"
        else:
            hint = "check --host names an address of this machine (127.0.0.1, ::1, 0.0.0.0)"
        return _fail(f"cannot serve on {args.host}:{args.port}: {reason}", hint, EXIT_FAIL)
    _warn_about_contents(root)
    if not server.is_loopback:
        _warn(
            f"listening on {server.host}, not loopback: anyone who can reach it can read every "
            "repo (there is no authentication)"
        )
    if faults is not None:
        server.faults = faults
        _warn(f"injecting faults: {faults.describe()}")
    stopping: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            # The handler only appends, and takes no lock: Python runs it in the main thread
            # between two bytecodes, and one that set a threading.Event while this loop waited
            # on that Event could land while the loop held the Event's lock, and never return
            # (seen once in CI: a SIGTERM the server did not answer in 10 s).
            previous[sig] = signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    server.start()
    print(f"serving {server.root} on {server.url}", flush=True)
    try:
        while not stopping:
            time.sleep(0.2)
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _warn_about_contents(root: Path) -> None:
    """Say so when DIR holds nothing a client could pull (the server still starts: repos added
    while it runs are served)."""
    try:
        if list_repos(root):
            return
        hub_layout = looks_like_hub_layout(root)
    except OSError:
        return
    if hub_layout:
        _warn(
            f"{root} holds kernel folders in Hub layout, not repos: nothing can be pulled from "
            f"it; run `kernels mirror build {root} DEST` and serve DEST"
        )
    else:
        _warn(f"{root} holds no repos (DIR/<org>/<name>): every pull will be 'not found'")
