"""`kernels lock` and `kernels sync [--frozen]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..safe_text import safe_text
from .common import add_backend_arguments, plural, progress_bar

_DEPS_EXAMPLE = (
    'add a [tool.kernels.dependencies] table with lines like "org/repo" = 1 (version 1) '
    'or "org/repo" = "<branch|tag|commit>"'
)


def add_lock_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "project", nargs="?", default=".", help="project folder holding pyproject.toml (default: .)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="lock kernels of publishers the Hub does not flag as trusted",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"lockfile", "kernels": [{"repo_id", "requested", "commit", '
        '"variants": {name: files}}]}',
    )


def _check_project(project: Path) -> None:
    """The project must have a pyproject.toml with a [tool.kernels.dependencies] table."""
    from ..errors import LockfileError
    from ..settings import load_toml

    pyproject = project / "pyproject.toml"
    if not pyproject.is_file():
        raise LockfileError(
            f"no pyproject.toml in {project}", hint=f"create it and {_DEPS_EXAMPLE}"
        )
    table = load_toml(
        pyproject,
        what="project file",
        hint=f"fix the TOML syntax of {pyproject} at the line and column named above",
    )
    table = table.get("tool", {}).get("kernels", {})
    if not isinstance(table, dict) or "dependencies" not in table:
        raise LockfileError(
            f"{pyproject} has no [tool.kernels.dependencies] table", hint=_DEPS_EXAMPLE
        )


def run_lock(args: argparse.Namespace) -> int:
    from ..errors import RevisionNotFound
    from ..locked import lock_project

    project = Path(args.project)
    _check_project(project)
    with progress_bar(enabled=sys.stdout.isatty() and not args.json) as progress:
        try:
            lock, path = lock_project(
                project, trust_remote_code=args.trust_remote_code or None, progress=progress
            )
        except RevisionNotFound as exc:  # a dependency line names a version or ref it lacks
            from .hints import pyproject_hint

            exc.hint = pyproject_hint(exc, project / "pyproject.toml")
            raise
    if args.json:
        rows = [
            {
                "repo_id": e.repo_id,
                "requested": str(e.requested),
                "commit": e.commit,
                "variants": {name: len(files) for name, files in (e.variants or {}).items()},
            }
            for e in lock.entries
        ]
        print(json.dumps({"lockfile": str(path), "kernels": rows}, sort_keys=True))
        return 0
    for entry in lock.entries:
        variants = entry.variants or {}
        files = sum(len(v) for v in variants.values())
        print(
            safe_text(f"locked {entry.repo_id} {entry.requested} -> {entry.commit[:12]}")
            + f" ({plural(len(variants), 'variant')}, {plural(files, 'file')})"
        )
    if not lock.entries:
        print(
            "warning: [tool.kernels.dependencies] is empty; the lock pins nothing", file=sys.stderr
        )
    print(f"wrote {path}")
    return 0


def add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("project", nargs="?", default=".", help="project folder (default: .)")
    parser.add_argument("--lockfile", help="lock to install (default: PROJECT/kernels.lock)")
    parser.add_argument(
        "--frozen",
        action="store_true",
        help="fail (exit 1) when pyproject.toml and the lock disagree; without it, warn",
    )
    parser.add_argument("--all-variants", action="store_true", help="install every locked variant")
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"lockfile", "stale": [...], "kernels": [{"repo_id", "commit", '
        '"variants"}]}',
    )
    add_backend_arguments(parser)


def run_sync(args: argparse.Namespace) -> int:
    from ..errors import LockfileError
    from ..locked import install_locked
    from ..lockfile import LOCK_NAME, read_dependencies, read_lock, stale_entries

    project = Path(args.project)
    lock_path = Path(args.lockfile) if args.lockfile else project / LOCK_NAME
    lock = read_lock(lock_path)
    pyproject = project / "pyproject.toml"
    problems = []
    if pyproject.is_file():
        problems = stale_entries(read_dependencies(pyproject), lock)
    if problems:
        message = f"{lock_path} is out of date with {pyproject}: " + "; ".join(problems)
        if args.frozen:
            raise LockfileError(message, hint="run `kernels lock` and commit kernels.lock")
        # Unlike uv, sync never re-locks behind the user's back: it installs the lock as written
        # and says loudly that it no longer matches what the project asks for.
        print(f"warning: {safe_text(message)}", file=sys.stderr)
        print(
            "hint: run `kernels lock` to update it (`kernels sync --frozen` makes this an error)",
            file=sys.stderr,
        )
    trust = args.trust_remote_code or None
    rows = []
    with progress_bar(enabled=sys.stdout.isatty() and not args.json) as progress:
        for entry in lock.entries:
            found = install_locked(
                entry,
                backend=args.backend,
                trust_remote_code=trust,
                all_variants=args.all_variants,
                progress=progress,
            )
            names = [f.variant for f in found]
            # Only file digests verify anything; a reference-format lock pins the commit alone.
            verdict = (
                "verified against the lock"
                if entry.variants
                else f"commit pinned only (a {lock.source_format} lock has no file digests)"
            )
            rows.append(
                {
                    "repo_id": entry.repo_id,
                    "commit": entry.commit,
                    "variants": names,
                    "verified": bool(entry.variants),
                }
            )
            if not args.json:
                synced = f"synced {entry.repo_id}@{entry.commit[:12]} ({', '.join(names)})"
                print(f"{safe_text(synced)}: {verdict}")
    if args.json:
        out = {"lockfile": str(lock_path), "stale": problems, "kernels": rows}
        print(json.dumps(out, sort_keys=True))
        return 0
    verb = "matches" if len(lock.entries) == 1 else "match"
    print(f"{plural(len(lock.entries), 'kernel')} {verb} {lock_path}")
    return 0
