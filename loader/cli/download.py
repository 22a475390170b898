"""`kernels download PROJECT_DIR [--all-variants]`: the reference's command for installing what a
project's kernels.lock pins.

As the reference does, it reads PROJECT_DIR/kernels.lock only (no pyproject.toml check: that is
`kernels sync`), goes on past a kernel that cannot be found and exits 1 at the end if any failed
(1 too when there is no lock). Each file is verified as `kernels sync` verifies it: against the
lock's digests where the lock has them (this package's format), else the commit alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..safe_text import safe_text
from .common import add_backend_arguments, plural, progress_bar


def add_download_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("project_dir", help="the project folder that holds kernels.lock")
    parser.add_argument(
        "--all-variants", action="store_true", help="download every build variant of each kernel"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"lockfile", "kernels": [{"repo_id", "commit", "variants", '
        '"verified"}], "failed": [{"repo_id", "commit", "error"}]}',
    )
    add_backend_arguments(parser)


def run_download(args: argparse.Namespace) -> int:
    from ..errors import KernelsError, LockfileError
    from ..locked import install_locked
    from ..lockfile import LOCK_NAME, read_lock
    from .main import EXIT_FAIL, report_error

    project = Path(args.project_dir)
    lock_path = project / LOCK_NAME
    if not lock_path.exists():
        raise LockfileError(
            f"No kernels.lock file found in: {project}",
            hint=f"run `kernels lock {project}` to write one from pyproject.toml",
        )
    lock = read_lock(lock_path)
    trust = getattr(args, "trust_remote_code", False) or None
    rows, failed = [], []
    with progress_bar(enabled=sys.stdout.isatty() and not args.json) as progress:
        for entry in lock.entries:
            try:
                found = install_locked(
                    entry,
                    backend=getattr(args, "backend", None),
                    trust_remote_code=trust,
                    all_variants=args.all_variants,
                    progress=progress,
                )
            except KernelsError as exc:
                if not isinstance(exc, FileNotFoundError):
                    raise  # as the reference: only a kernel that cannot be found is passed over
                report_error(exc)
                failed.append(
                    {"repo_id": entry.repo_id, "commit": entry.commit, "error": exc.message}
                )
                continue
            names = [f.variant for f in found]
            rows.append(
                {
                    "repo_id": entry.repo_id,
                    "commit": entry.commit,
                    "variants": names,
                    "verified": bool(entry.variants),
                }
            )
            if not args.json:
                verdict = (
                    "verified against the lock"
                    if entry.variants
                    else f"commit pinned only (a {lock.source_format} lock has no file digests)"
                )
                got = f"downloaded {entry.repo_id}@{entry.commit[:12]} ({', '.join(names)})"
                print(f"{safe_text(got)}: {verdict}")
    if args.json:
        out = {"lockfile": str(lock_path), "kernels": rows, "failed": failed}
        print(json.dumps(out, sort_keys=True))
    elif failed:
        print(
            f"{len(rows)} of {plural(len(lock.entries), 'kernel')} in {safe_text(lock_path)} "
            "downloaded",
        )
    else:
        print(f"{plural(len(rows), 'kernel')} from {safe_text(lock_path)}")
    return EXIT_FAIL if failed else 0


def download_kernels(args: object) -> None:
    """The reference's `kernels.cli.download_kernels(args)` (`args.project_dir`,
    `args.all_variants`), as its tests and scripts call it: `kernels download`, with
    SystemExit(1) where the command would exit 1."""
    from ..errors import KernelsError
    from .main import report_error

    namespace = argparse.Namespace(
        project_dir=args.project_dir,
        all_variants=bool(getattr(args, "all_variants", False)),
        json=False,
        backend=None,
        trust_remote_code=False,
    )
    try:
        code = run_download(namespace)
    except KernelsError as exc:
        code = report_error(exc)
    if code:
        sys.exit(code)
