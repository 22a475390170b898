"""`kernels lock` and `kernels sync [--frozen]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import add_backend_arguments, progress_bar


def add_lock_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "project", nargs="?", default=".", help="project folder holding pyproject.toml (default: .)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="lock kernels of publishers the Hub does not flag as trusted",
    )


def run_lock(args: argparse.Namespace) -> int:
    from ..locked import lock_project

    project = Path(args.project)
    with progress_bar(enabled=sys.stdout.isatty()) as progress:
        lock, path = lock_project(
            project, trust_remote_code=args.trust_remote_code or None, progress=progress
        )
    for entry in lock.entries:
        files = sum(len(v) for v in (entry.variants or {}).values())
        print(
            f"locked {entry.repo_id} {entry.requested} -> {entry.commit[:12]} ({len(entry.variants or {})} variants, {files} files)"
        )
    print(f"wrote {path}")
    return 0


def add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("project", nargs="?", default=".", help="project folder (default: .)")
    parser.add_argument("--lockfile", help="lock to install (default: PROJECT/kernels.lock)")
    parser.add_argument(
        "--frozen",
        action="store_true",
        help="fail (exit 1) when pyproject.toml and the lock disagree; never re-lock",
    )
    parser.add_argument("--all-variants", action="store_true", help="install every locked variant")
    add_backend_arguments(parser)


def run_sync(args: argparse.Namespace) -> int:
    from ..errors import LockfileError
    from ..locked import install_locked
    from ..lockfile import LOCK_NAME, read_dependencies, read_lock, stale_entries

    project = Path(args.project)
    lock_path = Path(args.lockfile) if args.lockfile else project / LOCK_NAME
    lock = read_lock(lock_path)
    pyproject = project / "pyproject.toml"
    if args.frozen and pyproject.is_file():
        problems = stale_entries(read_dependencies(pyproject), lock)
        if problems:
            raise LockfileError(
                f"{lock_path} is out of date with {pyproject}: " + "; ".join(problems),
                hint="run `kernels lock` and commit kernels.lock",
            )
    trust = args.trust_remote_code or None
    with progress_bar(enabled=sys.stdout.isatty()) as progress:
        for entry in lock.entries:
            found = install_locked(
                entry,
                backend=args.backend,
                trust_remote_code=trust,
                all_variants=args.all_variants,
                progress=progress,
            )
            names = ", ".join(f.variant for f in found)
            # Only file digests verify anything; a reference-format lock pins the commit alone.
            verdict = (
                "verified against the lock"
                if entry.variants
                else f"commit pinned only (a {lock.source_format} lock has no file digests)"
            )
            print(f"synced {entry.repo_id}@{entry.commit[:12]} ({names}): {verdict}")
    print(f"{len(lock.entries)} kernels match {lock_path}")
    return 0
