"""`kernels mirror build SRC DEST`: turn kernel folders in Hub layout into a servable mirror.

`SRC/<org>/<name>/build/<variant>/...` (like this project's hub_kernels/) becomes the git repo
`DEST/<org>/<name>` with branches `main` and `v<N>` (kernels.serve.build has the rules); then
`kernels serve DEST` serves it. Rebuilding an unchanged folder keeps its commit. Whom the mirror
reports as trusted publishers is the builder's choice (`--trust ORG`), never SRC's own file.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..safe_text import safe_text

_SRC_HINT = "give the folder that holds <org>/<name>/build/<variant>/ (e.g. hub_kernels)"


def add_mirror_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build"], help="build: create or update DEST from SRC")
    parser.add_argument("src", metavar="SRC", help="folder of kernels: SRC/<org>/<name>/build/")
    parser.add_argument("dest", metavar="DEST", help="mirror folder to create or update")
    parser.add_argument(
        "--trust",
        metavar="ORG",
        action="append",
        help="report ORG as a trusted publisher (repeat for more); writes DEST/kernels-mirror.toml "
        "with exactly these. Without it, DEST's file is left as it is",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_mirror(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..errors import InvalidSpec
    from ..serve.build import build_mirror
    from ..serve.mirror import CONFIG_NAME

    src, dest = Path(args.src), Path(args.dest)
    if not src.is_dir():
        raise InvalidSpec(f"{src} is not a folder", hint=_SRC_HINT)
    built = build_mirror(src, dest, trusted_publishers=args.trust)
    if not built:
        raise InvalidSpec(f"{src} holds no kernel folders (<org>/<name>/build/)", hint=_SRC_HINT)
    trusted = sorted(set(args.trust)) if args.trust is not None else None
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
        doc = {"mirror": str(dest), "repos": rows, "trusted_publishers": trusted}
        print(json.dumps(doc, sort_keys=True), flush=True)
    else:
        for b in built:
            state = "updated" if b.changed else "unchanged"
            # Folder names come from SRC, which someone else may have written: escaped.
            print(safe_text(f"{b.repo_id}  v{b.version}  {b.commit[:12]}  {state}"))
        if trusted is not None:
            print(
                safe_text(
                    f"trusted publishers: {', '.join(trusted) or '(none)'} ({dest / CONFIG_NAME})"
                )
            )
        print(f"built {len(built)} repos in {dest}; serve them with `kernels serve {dest}`")
        sys.stdout.flush()
    if trusted is None and (src / CONFIG_NAME).is_file():
        # Loud, because the source folder's author may expect their list to travel with it.
        print(
            f"warning: {src / CONFIG_NAME} was not copied: whom the mirror trusts is yours to "
            "decide; pass --trust ORG for each publisher to trust",
            file=sys.stderr,
        )
    return 0
