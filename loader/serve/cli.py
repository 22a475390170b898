"""`kernels serve DIR`: run a mirror in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from .. import settings
from ..errors import KernelsError
from .faults import FaultPlan, FaultSpecError
from .mirror import Mirror
from .server import MirrorServer

DEFAULT_PORT = 8000


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernels serve",
        description=(
            "Serve DIR/<org>/<name> git repos read-only over the Hugging Face Hub's HTTP protocol; "
            "point clients at it with HF_ENDPOINT=<the printed url>."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="folder of git repos (DIR/<org>/<name>)")
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
    parser.add_argument(
        "--faults",
        metavar="SPEC",
        help="misbehave on purpose, for reliability tests: e.g. '500:0.3,429:0.1:retry-after=1,"
        "reset:0.1,truncate:0.1,slow:0.1:2s,corrupt:0.05,seed=7' (see kernels.serve.faults)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `kernels serve`; returns the exit status (0 after SIGINT/SIGTERM, 2 for a bad DIR)."""
    args = _parser().parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
        print(f"kernels serve: error: {args.dir} is not a readable directory", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"kernels serve: error: port {args.port} is out of range", file=sys.stderr)
        return 2
    try:
        faults = FaultPlan.parse(args.faults) if args.faults else None
    except FaultSpecError as exc:
        print(f"kernels serve: error: --faults: {exc}", file=sys.stderr)
        return 2
    try:
        Mirror(root).trusted_publishers()  # a broken config fails now, not at the first request
        server = MirrorServer(
            root,
            host=args.host,
            port=args.port,
            lfs_redirect=not args.no_lfs_redirect,
            access_log=sys.stderr if args.verbose else None,
            control_token=settings.serve_token(),  # the request log over HTTP
        )
    except KernelsError as exc:
        print(f"kernels serve: error: {exc.message} ({exc.hint})", file=sys.stderr)
        return 2
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(
            f"kernels serve: error: cannot serve on {args.host}:{args.port}: {reason}",
            file=sys.stderr,
        )
        return 1
    if not server.is_loopback:
        print(
            f"kernels serve: warning: listening on {server.host}, not loopback: anyone who can reach "
            "it can read every repo (there is no authentication)",
            file=sys.stderr,
        )
    if faults is not None:
        server.faults = faults
        print(f"kernels serve: injecting faults: {faults.describe()}", file=sys.stderr)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"serving {server.root} on {server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
