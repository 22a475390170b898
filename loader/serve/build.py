"""Build a mirror from folders in Hub layout: one git repo per kernel, with `main` and `v<N>`.

`SRC/<org>/<name>/` (with a `build/` folder) becomes the bare repo `DEST/<org>/<name>` whose
`main` and `v<N>` branches point at one commit holding the folder's files (no bytecode), where N
is the `version` every `build/<variant>/metadata.json` states. The commit has no parent and a
fixed identity and date, so its sha depends only on the files: the same folder gives the same
sha on every machine, and an unchanged folder gives no new commit. Branches of earlier versions
stay, so rebuilding after a version bump keeps the old `v<N>` around.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidMetadata
from .mirror import CONFIG_NAME, read_trusted_publishers, valid_name
from .writer import GitRepoWriter, commit_tree, rev, set_ref, tree_of, write_tree

_SKIP_DIRS = {".git", "__pycache__"}
_VERSION_HINT = 'give every build/<variant>/metadata.json of the repo the same integer "version"'


@dataclass(frozen=True)
class BuiltRepo:
    """One repo of the mirror after a build."""

    repo_id: str  # "org/name"
    path: Path  # the bare git repo under DEST
    commit: str  # what `main` and `v<version>` point at
    version: int
    changed: bool  # False when `main` already held exactly these files


def build_mirror(src: Path | str, dest: Path | str) -> list[BuiltRepo]:
    """Create or update `dest/<org>/<name>` for every `src/<org>/<name>/build/`; copy the config.

    Every repo's metadata is checked before anything is written (InvalidMetadata otherwise).
    """
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise NotADirectoryError(f"mirror source {src} is not a directory")
    plans = []
    for org_dir in _subdirs(src):
        for repo_dir in _subdirs(org_dir):
            if (repo_dir / "build").is_dir():
                repo_id = f"{org_dir.name}/{repo_dir.name}"
                plans.append((repo_id, repo_dir, _version(repo_dir, repo_id)))
    config = src / CONFIG_NAME
    if config.is_file():
        read_trusted_publishers(config)  # refuse to copy a config the server would reject
    dest.mkdir(parents=True, exist_ok=True)
    built = [_build_repo(repo_id, repo_dir, version, dest) for repo_id, repo_dir, version in plans]
    if config.is_file():
        shutil.copyfile(config, dest / CONFIG_NAME)
    return built


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and valid_name(p.name))


def _version(repo_dir: Path, repo_id: str) -> int:
    """The one version all variants' metadata.json agree on."""
    versions: dict[str, int] = {}
    for variant in sorted((repo_dir / "build").iterdir()):
        if not variant.is_dir() or variant.name in _SKIP_DIRS:
            continue
        where = f"{repo_id}: build/{variant.name}/metadata.json"
        try:
            data = json.loads((variant / "metadata.json").read_text("utf-8"))
        except FileNotFoundError:
            raise InvalidMetadata(f"{where} is missing", hint=_VERSION_HINT) from None
        except (OSError, ValueError) as exc:
            raise InvalidMetadata(
                f"{where} is not readable JSON: {exc}", hint=_VERSION_HINT
            ) from None
        version = data.get("version") if isinstance(data, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidMetadata(f'{where} has no integer "version"', hint=_VERSION_HINT)
        versions[variant.name] = version
    if not versions:
        raise InvalidMetadata(f"{repo_id}: build/ has no variant folders", hint=_VERSION_HINT)
    if len(set(versions.values())) > 1:
        found = ", ".join(f"{name}={v}" for name, v in versions.items())
        raise InvalidMetadata(
            f"{repo_id}: variants disagree on version ({found})", hint=_VERSION_HINT
        )
    return next(iter(versions.values()))


def _files(repo_dir: Path) -> list[tuple[str, str, Path]]:
    """(repo path, git mode, file) for every file to commit, sorted; symlinks are followed."""
    files = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(repo_dir, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop
            dirnames.clear()
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if name == ".git" or name.endswith(".pyc") or not full.is_file():
                continue
            mode = "100755" if full.stat().st_mode & 0o111 else "100644"
            files.append((full.relative_to(repo_dir).as_posix(), mode, full))
    return sorted(files)


def _build_repo(repo_id: str, repo_dir: Path, version: int, dest: Path) -> BuiltRepo:
    writer = GitRepoWriter(dest / repo_id)
    gitdir = writer.gitdir
    tree = write_tree(gitdir, _files(repo_dir))
    current = rev(gitdir, "refs/heads/main")
    changed = current is None or tree_of(gitdir, current) != tree
    if changed:
        commit = commit_tree(gitdir, tree, [], f"{repo_id} v{version}\n")
        set_ref(gitdir, "refs/heads/main", commit)
    else:
        commit = current
    set_ref(gitdir, f"refs/heads/v{version}", commit)
    return BuiltRepo(repo_id=repo_id, path=gitdir, commit=commit, version=version, changed=changed)
