"""`kernels mirror build SRC DEST`: turn kernel folders in Hub layout into a servable mirror.

`SRC/<org>/<name>/build/<variant>/...` (like this project's hub_kernels/) becomes the git repo
`DEST/<org>/<name>` with branches `main` and `v<N>` (kernels.serve.build has the rules); then
`kernels serve DEST` serves it. Rebuilding an unchanged folder keeps its commit.
"""

from __future__ import annotations

import argparse
import json

from ..safe_text import safe_text


def add_mirror_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build"], help="build: create or update DEST from SRC")
    parser.add_argument("src", metavar="SRC", help="folder of kernels: SRC/<org>/<name>/build/")
    parser.add_argument("dest", metavar="DEST", help="mirror folder to create or update")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_mirror(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..errors import InvalidSpec
    from ..serve.build import build_mirror

    src, dest = Path(args.src), Path(args.dest)
    if not src.is_dir():
        raise InvalidSpec(
            f"{src} is not a folder",
            hint="give the folder that holds <org>/<name>/build/<variant>/ (e.g. hub_kernels)",
        )
    built = build_mirror(src, dest)
    if not built:
        raise InvalidSpec(
            f"{src} holds no kernel folders (<org>/<name>/build/)",
            hint="give the folder that holds <org>/<name>/build/<variant>/ (e.g. hub_kernels)",
        )
    if args.json:
        rows = [
            {
                "repo_id": b.repo_id,
                "version": b.version,
                "commit": b.commit,
                "changed": b.changed,
                "path": str(b.path),
            }
            for b in built
        ]
        print(json.dumps({"mirror": str(dest), "repos": rows}, sort_keys=True))
        return 0
    for b in built:
        state = "updated" if b.changed else "unchanged"
        # Folder names come from SRC, which someone else may have written: escaped.
        print(safe_text(f"{b.repo_id}  v{b.version}  {b.commit[:12]}  {state}"))
    print(f"built {len(built)} repos in {dest}; serve them with `kernels serve {dest}`")
    return 0
