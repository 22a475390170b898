"""`kernels export DIR`: write cached kernels as a folder `kernels serve` can serve.

For clusters without internet: pull on a connected machine, export, copy DIR over, run
`kernels serve DIR` there and point HF_ENDPOINT at it. Commit ids are kept, so locks written
against the Hub work unchanged against the mirror. The layout is a snapshot mirror:

    DIR/kernels-mirror.toml                       trusted publishers (from this cache's records)
    DIR/<org>/<name>/kernels-export.json          {"format": 1, "refs": {"branches": {...}, "tags": {}}}
    DIR/<org>/<name>/commits/<commit>/build/<variant>/...   the verified files
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from ..serve.snapshot import EXPORT_MANIFEST


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dest", help="folder to write (created; existing exports are updated)")
    parser.add_argument(
        "--repo", action="append", default=[], help="export only this org/repo (may repeat)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"dest", "variants": [{"repo_id", "commit", "variant"}]}',
    )


def export_cache(dest: Path, repos: list[str] | None = None) -> list[tuple[str, str, str]]:
    """Write every installed variant (of `repos`, or all) under `dest`; returns what was written."""
    from kernels.cache import Cache

    from .. import settings
    from ..fetch import valid_install_key
    from ..spec import is_commit

    cache = Cache(settings.cache_root(), endpoint=settings.endpoint())
    wanted = set(repos or [])
    written = []
    refs: dict[str, dict[str, str]] = {}
    for repo in cache.records.repos():
        for record in cache.records.revisions(repo):
            if not is_commit(record.revision) and is_commit(record.commit):
                refs.setdefault(repo, {})[record.revision] = record.commit
    trusted = set()
    for repo, commit, variant, digest in cache.index.entries():
        if wanted and repo not in wanted:
            continue
        # The names become folders under dest: a malformed one (e.g. a commit "../../x" that a
        # hostile server once got recorded) is skipped, never joined.
        if not valid_install_key(repo, commit, variant):
            print(
                f"warning: skipped a malformed cache entry {repo!r:.80}@{commit!r:.60}; "
                "run `kernels verify --all`",
                file=sys.stderr,
            )
            continue
        manifest = cache.index.get_manifest(digest)
        if manifest is None or not cache.trees.check(manifest).ok:
            from ..errors import IntegrityError

            raise IntegrityError(
                f"{repo}@{commit[:12]}/{variant} is not intact (its cached files changed)",
                hint="run `kernels verify --repair`, then export again",
            )
        repo_dir = dest / repo
        target = repo_dir / "commits" / commit / "build" / variant
        for entry in manifest.files:
            out = target / entry.path
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():
                continue
            src = cache.objects.path(entry.sha256)
            try:
                os.link(src, out)
            except OSError:
                shutil.copyfile(src, out)
        record = cache.records.get_trust(repo.split("/")[0])
        if record is not None and record.trusted:
            trusted.add(repo.split("/")[0])
        written.append((repo, commit, variant))
    for repo in {w[0] for w in written}:
        manifest_path = dest / repo / EXPORT_MANIFEST
        old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        branches = dict(old.get("refs", {}).get("branches", {}))
        branches.update(refs.get(repo, {}))
        commits = sorted(p.name for p in (dest / repo / "commits").iterdir())
        data = {"format": 1, "refs": {"branches": branches, "tags": {}}, "commits": commits}
        manifest_path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if trusted:
        config = dest / "kernels-mirror.toml"
        names = sorted(trusted)
        if config.exists():
            from ..settings import load_toml

            names = sorted(set(names) | set(load_toml(config).get("trusted_publishers", [])))
        config.write_text("trusted_publishers = [" + ", ".join(f'"{n}"' for n in names) + "]\n")
    return written


def run_export(args: argparse.Namespace) -> int:
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = export_cache(dest, args.repo)
    if args.json:
        rows = [{"repo_id": r, "commit": c, "variant": v} for r, c, v in written]
        print(json.dumps({"dest": str(dest), "variants": rows}, sort_keys=True))
        return 0
    for repo, commit, variant in written:
        print(f"exported {repo}@{commit[:12]}/{variant}")
    print(f"{len(written)} variants in {dest}; serve them with `kernels serve {dest}`")
    return 0
