"""`kernels pull org/repo[@rev]`: resolve, fetch, verify, and say what was installed."""

from __future__ import annotations

import argparse
import json
import sys

from ..safe_text import safe_text
from .common import add_backend_arguments, human_size, progress_bar, spec_with_default_ref


def add_pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "repo",
        nargs="?",
        help="org/repo[@version|@revision], e.g. kernels-lab/training@v1; without '@' the "
        "newest v<N> branch (else main)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--variant", help="install this build variant instead of choosing one")
    which.add_argument("--all-variants", action="store_true", help="install every build variant")
    parser.add_argument(
        "--locked",
        action="store_true",
        help="install what kernels.lock pins (all locked kernels when REPO is omitted)",
    )
    parser.add_argument(
        "--lockfile", help="the lock to use with --locked (default: nearest kernels.lock)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object per kernel: {"repo_id", "requested", "commit", "variant", "path", '
        '"tree", "files", "bytes", "skipped": [{"variant", "reason"}]}',
    )
    add_backend_arguments(parser)


def _report(rows: list[dict], as_json: bool) -> None:
    for row in rows:
        if as_json:
            print(json.dumps(row, sort_keys=True))
            continue
        # A skipped variant was already reported on stderr by the loader's notice.
        repo, commit, requested = (safe_text(row[k]) for k in ("repo_id", "commit", "requested"))
        print(
            f"{repo}@{commit[:12]} ({requested}) -> {safe_text(row['variant'])}\n"
            f"  {row['files']} files, {human_size(row['bytes'])}, verified\n"
            f"  {safe_text(row['path'])}"
        )


def _skipped(found, backend: str | None) -> list[dict]:
    """Variants that fit by name but failed a check on their files (metadata, the ELF probe of
    native libraries: a newer GLIBC, another CPU arch), so a lesser one was installed."""
    from ..api import _system
    from ..variants import VariantRejected, select_variants

    rejected = [e for e in found.trace if isinstance(e, VariantRejected)]
    by_name = select_variants({e.variant: None for e in found.trace}, _system(backend))
    named = {e.variant for e in by_name if isinstance(e, VariantRejected)}
    return [{"variant": e.variant, "reason": e.reason} for e in rejected if e.variant not in named]


def _explain(found) -> None:
    """-v: how the variant was chosen, every variant with its verdict, to stderr."""
    r = found.resolution
    where = f"{r.repo_id}@{r.ref} -> {r.commit} (from {r.source})"
    print(f"{safe_text(where)}; variants:", file=sys.stderr)
    for entry in found.trace:  # reasons quote the server's metadata
        print(f"  {safe_text(entry)}", file=sys.stderr)


def _row(repo_id: str, requested: str, found, backend: str | None = None) -> dict:
    return {
        "skipped": _skipped(found, backend) if found.trace else [],
        "repo_id": repo_id,
        "requested": requested,
        "commit": found.resolution.commit,
        "variant": found.variant,
        "path": str(found.tree),
        "tree": found.manifest.digest,
        "files": len(found.manifest.files),
        "bytes": found.manifest.total_size,
    }


def run_pull(args: argparse.Namespace) -> int:
    from ..errors import InvalidSpec

    trust = args.trust_remote_code or None
    with progress_bar(enabled=sys.stdout.isatty() and not args.json) as progress:
        if args.locked:
            from ..locked import install_locked
            from ..lockfile import find_lockfile, read_lock

            lock = read_lock(find_lockfile(args.lockfile))
            entries = [lock.find(args.repo)] if args.repo else lock.entries
            rows = []
            for entry in entries:
                for found in install_locked(
                    entry,
                    backend=args.backend,
                    trust_remote_code=trust,
                    all_variants=args.all_variants,
                    progress=progress,
                ):
                    rows.append(_row(entry.repo_id, str(entry.requested), found))
            _report(rows, args.json)
            return 0
        if not args.repo:
            raise InvalidSpec("kernels pull needs a repo (or --locked)")
        spec = spec_with_default_ref(args.repo)
        if args.variant or args.all_variants:
            rows = [
                _row(spec.repo_id, spec.ref, f)
                for f in _install_variants(spec, args, trust, progress)
            ]
        else:
            from ..api import install_with_details

            found = install_with_details(
                spec, backend=args.backend, trust_remote_code=trust, progress=progress
            )
            rows = [_row(spec.repo_id, spec.ref, found, args.backend)]
            if args.verbose:
                _explain(found)
    _report(rows, args.json)
    return 0


def _install_variants(spec, args, trust, progress) -> list:
    from .. import settings
    from ..api import Installed, _cache
    from ..errors import NoCompatibleVariant
    from ..fetch import get_listing, install_variant
    from ..metadata import Metadata
    from ..resolve import resolve
    from ..trust import ensure_trusted

    cache = _cache()
    offline = settings.offline()
    resolution = resolve(cache, spec, offline=offline, ttl=settings.resolve_ttl())
    ensure_trusted(cache, spec.repo_id, trust, offline=offline)
    listing = get_listing(cache, spec.repo_id, resolution.commit, offline=offline)
    names = sorted(listing.variants) if args.all_variants else [args.variant]
    out = []
    for name in names:
        if name not in listing.variants:
            raise NoCompatibleVariant(
                f"{spec.repo_id}@{resolution.commit[:12]} has no variant {name!r}; it has: "
                + ", ".join(sorted(listing.variants))
            )
        manifest, tree = install_variant(
            cache, spec.repo_id, resolution.commit, name, listing.variants[name], progress=progress
        )
        out.append(
            Installed(resolution, name, manifest, tree, Metadata.read(tree / "metadata.json"), [])
        )
    return out
