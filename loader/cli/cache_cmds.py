"""`kernels ls`, `du`, `verify`, `prune`: a cache users can see and trust."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..safe_text import safe_text
from .common import human_size


def _cache():
    """The whole cache, every endpoint's records (maintenance sees all), lock deadlines set."""
    from kernels.cache import Cache

    from .. import settings
    from ..guard import lock_wait_notice

    return Cache(
        settings.cache_root(), lock_timeout=settings.lock_timeout(), on_lock_wait=lock_wait_notice
    )


def add_ls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per installed variant")


def run_ls(args: argparse.Namespace) -> int:
    from ..fetch import valid_install_key

    cache = _cache()
    rows = []
    malformed = 0
    refs: dict[tuple[str, str], list[str]] = {}
    for repo in cache.records.repos():
        for record in cache.records.revisions(repo):
            refs.setdefault((repo, record.commit), []).append(record.revision)
    for repo, commit, variant, digest in cache.index.entries():
        if not valid_install_key(repo, commit, variant):
            malformed += 1  # never echoed: it is a hostile server's text (paths, escapes)
            continue
        manifest = cache.index.get_manifest(digest)
        rows.append(
            {
                "repo_id": repo,
                "commit": commit,
                "refs": sorted(refs.get((repo, commit), [])),
                "variant": variant,
                "tree": digest,
                "files": len(manifest.files) if manifest else 0,
                "bytes": manifest.total_size if manifest else 0,
            }
        )
    if malformed:
        print(
            f"kernels: skipped {malformed} malformed cache entries; run `kernels verify --all`",
            file=sys.stderr,
        )
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0
    if not rows:
        print(f"no kernels cached in {cache.root}")
        return 0
    for row in rows:
        ref = f" ({', '.join(row['refs'])})" if row["refs"] else ""
        print(
            safe_text(f"{row['repo_id']}@{row['commit'][:12]}{ref}  {row['variant']}")
            + f"  {row['files']} files  {human_size(row['bytes'])}"
        )
    return 0


def add_du_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run_du(args: argparse.Namespace) -> int:
    cache = _cache()
    usage = cache.usage()
    if args.json:
        print(json.dumps({"root": str(cache.root), **usage.__dict__}, sort_keys=True))
    else:
        print(f"cache: {cache.root}")
        print(f"  {usage.repos} repos, {usage.variants} installed variants, {usage.trees} trees")
        print(
            f"  {usage.objects} objects, {human_size(usage.object_bytes)} (each file stored once)"
        )
    return 0


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--all",
        action="store_true",
        help="re-hash every file (default: stat stamps, re-hash what moved)",
    )
    parser.add_argument(
        "--repair",
        action="store_true",
        help="re-download the files of corrupt variants (needs the Hub or a mirror)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"mode", "checked", "corrupt": [...], "repaired": [...]}',
    )


def run_verify(args: argparse.Namespace) -> int:
    cache = _cache()
    checked = 0
    exposure = cache.exposure()
    if exposure is not None:
        # Stamps prove nothing when others can rewrite them: re-hash, and say why loads refuse.
        print(
            safe_text(
                f"UNSAFE {exposure.path} is {exposure.why}: loads refuse this cache; "
                f"run `{exposure.fix()}`"
            ),
            file=sys.stderr if args.json else sys.stdout,
        )
        args.all = True
    corrupt = []
    for repo, commit, variant, check in cache.verify_all(full=args.all):
        checked += 1
        if not check.ok:
            corrupt.append(
                {"repo_id": repo, "commit": commit, "variant": variant, "files": list(check.bad)}
            )
    mode = "full re-hash" if args.all else "stamps"
    repaired = [_repair(cache, row) for row in corrupt] if args.repair else []
    if args.json:
        out = {
            "mode": mode,
            "checked": checked,
            "corrupt": corrupt,
            "repaired": repaired,
            "unsafe": None if exposure is None else str(exposure.path),
        }
        print(json.dumps(out, sort_keys=True))
    else:
        # File names are the server's: escaped, so a name cannot rewrite the line.
        for row in corrupt:
            where = f"{row['repo_id']}@{row['commit'][:12]}/{row['variant']}"
            print(f"CORRUPT {safe_text(where)}: {', '.join(map(safe_text, row['files']))}")
        for row in repaired:
            print(safe_text(f"repaired {row['repo_id']}@{row['commit'][:12]}/{row['variant']}"))
    if exposure is not None:
        if not args.json:
            print(
                f"{checked - len(corrupt)} of {checked} variants match their manifests ({mode}), "
                "but the cache is writable by others, so that proves nothing about who wrote them"
            )
        return 1
    if corrupt and not args.repair:
        from ..errors import IntegrityError

        raise IntegrityError(
            f"{len(corrupt)} of {checked} variants are corrupt ({mode})",
            hint="run `kernels verify --repair` to re-download them",
        )
    if not args.json:
        print(f"{checked} variants verified ({mode})")
    return 0


def _repair(cache, row: dict) -> dict:
    """Evict a corrupt variant and fetch it again, verified against the commit's listing."""
    from .. import settings
    from ..fetch import get_listing, install_variant

    repo, commit, variant = row["repo_id"], row["commit"], row["variant"]
    manifest = cache.index.get_variant(repo, commit, variant)
    if manifest is not None:
        cache.evict(manifest, tuple(e.path for e in manifest.files))
    listing = get_listing(cache, repo, commit, offline=settings.offline())
    if variant not in listing.variants:
        from ..errors import IntegrityError

        raise IntegrityError(
            f"{repo}@{commit[:12]} does not list {variant} any more; it cannot be repaired",
            hint="run `kernels prune` to drop it, then `kernels pull` what you need",
        )
    manifest, _tree = install_variant(cache, repo, commit, variant, listing.variants[variant])
    return {"repo_id": repo, "commit": commit, "variant": variant, "tree": manifest.digest}


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="show what would be removed")
    parser.add_argument(
        "--lockfile",
        action="append",
        default=[],
        help="also keep what this lock pins (may repeat); the nearest kernels.lock is kept too",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"dry_run", "trees", "objects", "bytes"}',
    )


def _locked_trees(cache, lockfiles: list[str]) -> set[str]:
    """Trees whose files are exactly what a lock pins: never pruned."""
    from ..errors import LockfileError
    from ..lockfile import find_lockfile, read_lock

    paths = [Path(p) for p in lockfiles]
    try:
        paths.append(find_lockfile())
    except LockfileError:
        pass
    keep = set()
    for path in paths:
        lock = read_lock(path)
        for entry in lock.entries:
            for variant in cache.index.installed_variants(entry.repo_id, entry.commit):
                manifest = cache.index.get_variant(entry.repo_id, entry.commit, variant)
                if manifest is not None:
                    keep.add(manifest.digest)
    return keep


def run_prune(args: argparse.Namespace) -> int:
    cache = _cache()
    # Installed variants stay indexed, so a tree that a lock pins or a process imported is never
    # an orphan; the lock's trees are passed explicitly as a second guard.
    from kernels.cache import LockTimeout

    keep = _locked_trees(cache, args.lockfile)
    try:
        report = cache.prune(keep_trees=keep, dry_run=args.dry_run)
    except LockTimeout as exc:
        from ..errors import LockWaitTimeout

        raise LockWaitTimeout(f"prune waited for loads in progress: {exc}") from None
    if args.json:
        out = {
            "dry_run": args.dry_run,
            "trees": sorted(report.trees),
            "objects": sorted(report.objects),
            "bytes": report.bytes,
        }
        print(json.dumps(out, sort_keys=True))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(report.trees)} trees and {len(report.objects)} objects ({human_size(report.bytes)})"
    )
    return 0
