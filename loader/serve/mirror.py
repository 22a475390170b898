"""The folder a mirror serves: `ROOT/<org>/<name>` git repos (or `kernels export` snapshots) and
the optional `kernels-mirror.toml`."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from ..errors import InvalidSpec
from .git import GitRepo
from .snapshot import SnapshotRepo, is_snapshot

CONFIG_NAME = "kernels-mirror.toml"
# Org and repo names the mirror looks up. The first character rules out ".", ".." and ".git".
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def valid_name(name: str) -> bool:
    """True when `name` can be an org or repo name (and so is safe to join under the root)."""
    return bool(_NAME.fullmatch(name))


def find_gitdir(path: Path) -> Path | None:
    """The git dir of the repo at `path` (bare, or a work tree with .git), or None."""
    dot_git = path / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():  # a linked work tree: "gitdir: <path>"
        try:
            text = dot_git.read_text("utf-8").strip()
        except OSError:
            return None
        if text.startswith("gitdir: "):
            target = Path(text[8:])
            return target if target.is_absolute() else (path / target).resolve()
        return None
    if (path / "HEAD").is_file() and (path / "objects").is_dir():
        return path
    return None


class Mirror:
    """Repos and settings under one root; repo readers (and their caches) live as long as this."""

    def __init__(self, root: Path | str):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotADirectoryError(f"mirror root {self.root} is not a directory")
        self._repos: dict[tuple[str, str], GitRepo] = {}
        self._lock = threading.Lock()
        self._config: tuple[tuple, frozenset[str]] | None = None

    def repo(self, org: str, name: str) -> GitRepo | None:
        """The repo `org/name`, or None when the mirror does not have it."""
        known = self._repos.get((org, name))
        if known is not None and os.path.isfile(known.head_file):
            return known  # still there: skip the lookup
        if not (valid_name(org) and valid_name(name)):
            return None
        candidate = self.root / org / name
        if is_snapshot(candidate):  # a `kernels export` folder keeps the Hub's commit ids
            with self._lock:
                repo = self._repos.get((org, name))
                if repo is None or not isinstance(repo, SnapshotRepo):
                    repo = self._repos[(org, name)] = SnapshotRepo(candidate)
            return repo
        for candidate in (self.root / org / name, self.root / org / f"{name}.git"):
            gitdir = find_gitdir(candidate)
            if gitdir is not None:
                with self._lock:
                    repo = self._repos.get((org, name))
                    if repo is None or repo.gitdir != gitdir:
                        repo = self._repos[(org, name)] = GitRepo(gitdir)
                return repo
        return None

    def has_org(self, org: str) -> bool:
        """An org exists when its folder does."""
        return valid_name(org) and (self.root / org).is_dir()

    def trusted_publishers(self) -> frozenset[str]:
        """`trusted_publishers` from ROOT/kernels-mirror.toml (re-read when the file changes)."""
        path = self.root / CONFIG_NAME
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return frozenset()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._config
        if cached is not None and cached[0] == stamp:
            return cached[1]
        names = read_trusted_publishers(path)
        self._config = (stamp, names)
        return names


def read_trusted_publishers(path: Path) -> frozenset[str]:
    """Parse a kernels-mirror.toml; InvalidSpec when it is not TOML or the key has a wrong type."""
    from ..toml_text import TomlError, loads

    hint = f'fix {path}: it should read like trusted_publishers = ["org", ...]'
    try:
        data = loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, TomlError) as exc:
        raise InvalidSpec(f"cannot read mirror config {path}: {exc}", hint=hint) from None
    names = data.get("trusted_publishers", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidSpec(f"{path}: trusted_publishers must be a list of org names", hint=hint)
    return frozenset(names)


def list_repos(root: Path | str) -> list[str]:
    """The `org/name` ids under `root` that the mirror would serve (git repos and exports)."""
    mirror = Mirror(root)
    found = []
    for org in sorted(p for p in mirror.root.iterdir() if p.is_dir() and valid_name(p.name)):
        for repo in sorted(p for p in org.iterdir() if p.is_dir()):
            name = repo.name.removesuffix(".git")
            if valid_name(name) and mirror.repo(org.name, name) is not None:
                found.append(f"{org.name}/{name}")
    return found


def looks_like_hub_layout(root: Path | str) -> bool:
    """True when `root` holds kernel folders (`<org>/<name>/build/`) that are not git repos yet."""
    root = Path(root)
    return any(
        (repo / "build").is_dir() and find_gitdir(repo) is None and not is_snapshot(repo)
        for org in root.iterdir()
        if org.is_dir()
        for repo in org.iterdir()
        if repo.is_dir()
    )
