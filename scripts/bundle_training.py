"""Write loader/bundled_training.json: the digests of the training kernels the wheel carries.

    python scripts/bundle_training.py           # rewrite it from hub_kernels/
    python scripts/bundle_training.py --check   # exit 1 when it no longer matches hub_kernels/

The wheel carries hub_kernels/kernels-lab/training/build/torch-universal/ as package data
(pyproject.toml maps it to kernels._bundled_training), and the loader installs it into the
cache only when every file matches the sha256 and size recorded here (loader/bundled.py). The
commit recorded is the one `kernels mirror build hub_kernels` gives the repo, so the bundled copy
and the project's own mirror name the same content with the same commit. Run this after any
change to the training kernels; tests/test_bundled.py fails until it is run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "kernels-lab/training"
VARIANT = "torch-universal"
OUTPUT = ROOT / "loader" / "bundled_training.json"


def describe(hub_kernels: Path = ROOT / "hub_kernels") -> dict:
    """The bundle record of `hub_kernels`' training repo: repo, version, variant, the mirror
    commit, and the variant's manifest (files with sha256 and size, and its digest)."""
    from kernels.cache import FileEntry, Manifest
    from kernels.cache.fsutil import sha256_file
    from kernels.serve import build_mirror

    repo_dir = hub_kernels / REPO_ID
    variant_dir = repo_dir / "build" / VARIANT
    entries = []
    for path in sorted(variant_dir.rglob("*")):
        rel = path.relative_to(variant_dir).as_posix()
        if "__pycache__" in rel.split("/") or rel.endswith(".pyc") or not path.is_file():
            continue
        entries.append(FileEntry(rel, sha256_file(path), path.stat().st_size))
    manifest = Manifest(tuple(entries))
    version = json.loads((variant_dir / "metadata.json").read_text("utf-8"))["version"]
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "src" / REPO_ID
        shutil.copytree(repo_dir, src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (built,) = build_mirror(Path(scratch) / "src", Path(scratch) / "mirror")
    return {
        "repo_id": REPO_ID,
        "version": version,
        "variant": VARIANT,
        "commit": built.commit,
        **manifest.to_json(),
    }


def render(record: dict) -> str:
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = render(describe())
    if args.check:
        current = OUTPUT.read_text("utf-8") if OUTPUT.is_file() else ""
        if current != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is out of date: run python scripts/bundle_training.py"
            )
            return 1
        print(f"{OUTPUT.relative_to(ROOT)} matches hub_kernels/")
        return 0
    OUTPUT.write_text(text, "utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
