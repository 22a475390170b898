"""Materialised variant trees: the folders Python imports from.

A tree lives at `trees/<manifest digest>/` and holds exactly the manifest's files, hard-linked
from the object store (copied where links are not possible). It is assembled in a temp folder and
published by one atomic rename, so a tree either exists complete or not at all. Its stat stamps
(size, mtime, inode and ctime per file) are recorded at publish time; a load compares them (cheap)
and falls back to a full re-hash of any file whose stamp moved. No program can set a ctime, so a
same-size edit that restores the mtime still moves the stamp; stamps prove nothing against
someone who can rewrite the stamp file too, which is why the loader only trusts a cache nobody
else can write (see safety.py), and `check` reports any tree file or folder others could write.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .fsutil import atomic_write_json, make_dirs, read_json, sha256_file
from .manifest import Manifest
from .objects import ObjectStore
from .safety import exposure_of
from .staging import Staging


@dataclass(frozen=True)
class TreeCheck:
    """Outcome of verifying a tree: `bad` lists paths whose bytes do not match the manifest."""

    ok: bool
    bad: tuple[str, ...] = ()
    rehashed: int = 0


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


class TreeStore:
    def __init__(self, root: Path, stamps: Path, staging: Staging, objects: ObjectStore):
        self.root = root
        self.stamps = stamps
        self.staging = staging
        self.objects = objects

    def path(self, digest: str) -> Path:
        return self.root / digest

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_dir()

    def publish(self, manifest: Manifest) -> Path:
        """Assemble the tree from objects (all must be present) and publish it atomically."""
        digest = manifest.digest
        final = self.path(digest)
        if final.is_dir():
            return final
        staging = Path(tempfile.mkdtemp(prefix="tree-", dir=self.staging.folder()))
        try:
            # mkdtemp makes the folder private (0700); a published tree is as readable as the
            # objects it links to, so other users of a shared or read-only cache can import it.
            os.chmod(staging, 0o755)
            for entry in manifest.files:
                src = self.objects.path(entry.sha256)
                dst = staging / entry.path
                make_dirs(dst.parent)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copyfile(src, dst)
                    os.chmod(dst, 0o444)
            stamps = {e.path: _stamp((staging / e.path).stat()) for e in manifest.files}
            make_dirs(self.root)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():
                    raise
                shutil.rmtree(staging, ignore_errors=True)  # another process won the race
                return final
            # Inodes survive a rename, so the stamps taken in staging hold for the final tree.
            atomic_write_json(self.stamps / f"{digest}.json", stamps)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def check(self, manifest: Manifest, *, full: bool = False) -> TreeCheck:
        """Verify a tree against its manifest; stamps first, a re-hash where a stamp moved."""
        tree = self.path(manifest.digest)
        stamps = read_json(self.stamps / f"{manifest.digest}.json")
        stamps = stamps if isinstance(stamps, dict) else {}
        bad: list[str] = []
        rehashed = 0
        # The tree's folders, as paths relative to it ("" is the tree itself).
        folders = {""}
        for entry in manifest.files:
            parts = entry.path.split("/")[:-1]
            folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        root = str(tree)
        for folder in folders:
            where = os.path.join(root, folder) if folder else root
            try:
                if exposure_of(where, os.lstat(where)) is not None:
                    bad.append(f"{folder or '.'}/ (writable by others)")
            except OSError:
                pass  # a missing folder shows as missing files below
        for entry in manifest.files:
            path = os.path.join(root, entry.path)
            try:
                st = os.lstat(path)
            except OSError:
                bad.append(entry.path)
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                bad.append(entry.path)
                continue
            if exposure_of(path, st) is not None:
                bad.append(entry.path)  # others could change it between this check and import
                continue
            if full or stamps.get(entry.path) != _stamp(st):
                rehashed += 1
                if sha256_file(path) != entry.sha256:
                    bad.append(entry.path)
        return TreeCheck(ok=not bad, bad=tuple(bad), rehashed=rehashed)

    def refresh_stamps(self, manifest: Manifest) -> None:
        """Record current stamps after a full check passed (no-op on a read-only cache)."""
        tree = self.path(manifest.digest)
        with contextlib.suppress(OSError):
            stamps = {e.path: _stamp((tree / e.path).stat()) for e in manifest.files}
            atomic_write_json(self.stamps / f"{manifest.digest}.json", stamps)

    def remove(self, digest: str) -> None:
        """Drop a tree (e.g. a corrupt one): rename away first so no reader sees half of it."""
        tree = self.path(digest)
        if not tree.exists():
            return
        doomed = Path(tempfile.mkdtemp(prefix="dead-", dir=self.staging.folder()))
        try:
            os.rename(tree, doomed / "tree")
        except OSError:
            doomed = tree
        # Files are read-only but their folders are not, so a plain rmtree removes them.
        shutil.rmtree(doomed, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stamps / f"{digest}.json")

    def iter_digests(self):
        if self.root.is_dir():
            for child in self.root.iterdir():
                if len(child.name) == 64 and child.is_dir():
                    yield child.name
