"""Build a mirror from folders in Hub layout: one git repo per kernel, with `main` and `v<N>`.

`SRC/<org>/<name>/` (with a `build/` folder) becomes the bare repo `DEST/<org>/<name>` whose
`main` and `v<N>` branches point at one commit holding the folder's files (no bytecode), where N
is the `version` every `build/<variant>/metadata.json` states. The commit has no parent and a
fixed identity and date, so its sha depends only on the files: the same folder gives the same
sha on every machine, and an unchanged folder gives no new commit. Branches of earlier versions
stay, so rebuilding after a version bump keeps the old `v<N>` around.

SRC is read as another user's folder (kernels.serve.source: no links, no special files, no
private files where others can write), all of it before DEST is touched. Whom the mirror reports
as trusted publishers is the builder's decision (`trusted_publishers=`), never SRC's.

Space: each file is checked against the staging disk before it is copied there, and the blobs
DEST lacks against DEST's disk before DEST is touched (InsufficientSpace). A disk that fills up
anyway is InsufficientSpace too: every repo's objects are written before any branch moves, and
the folders the build created are removed. Branches then move one at a time (`git update-ref`),
so a disk that fills during those moves can leave the repos moved so far at their new commits.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kernels.cache.fsutil import atomic_write_bytes

from ..diskspace import is_disk_full, require_free_space
from ..errors import InsufficientSpace, InvalidMetadata, InvalidSpec, KernelsError
from ..metadata import MAX_METADATA_BYTES
from .git import GitError, run_git
from .mirror import CONFIG_NAME, find_gitdir, valid_name
from .source import SourceRepo, read_source
from .writer import GitRepoWriter, commit_tree, rev, set_ref, tree_of, write_tree

_VERSION_HINT = 'give every build/<variant>/metadata.json of the repo the same integer "version"'
DEST_HINT = "free space on that disk, or build into a DEST on a larger one"


@dataclass(frozen=True)
class BuiltRepo:
    """One repo of the mirror after a build."""

    repo_id: str  # "org/name"
    path: Path  # the bare git repo under DEST
    commit: str  # what `main` and `v<version>` point at
    version: int
    changed: bool  # False when `main` already held exactly these files


def build_mirror(
    src: Path | str, dest: Path | str, *, trusted_publishers: Iterable[str] | None = None
) -> list[BuiltRepo]:
    """Create or update `dest/<org>/<name>` for every `src/<org>/<name>/build/`.

    SRC is read whole first: MirrorSourceError (an entry the build will not copy),
    InvalidMetadata (versions) and InsufficientSpace (files the staging disk or DEST's cannot
    hold) leave DEST untouched. `trusted_publishers` (org names) replaces
    DEST/kernels-mirror.toml; None leaves it as it is. SRC's own kernels-mirror.toml is never read.
    """
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise NotADirectoryError(f"mirror source {src} is not a directory")
    orgs = None if trusted_publishers is None else _org_names(trusted_publishers)
    with tempfile.TemporaryDirectory(prefix="kernels-mirror-build-") as staging:
        repos = read_source(src, Path(staging))
        plans = [(repo, _version(repo)) for repo in repos]
        needed = sum(_missing_bytes(dest, repo) for repo in repos)
        require_free_space(dest, needed, f"the mirror build into {dest}", hint=DEST_HINT)
        return _write_mirror(plans, dest, orgs)


def _missing_bytes(dest: Path, repo: SourceRepo) -> int:
    """The size of `repo`'s blobs that its git repo in DEST lacks (all, for a new repo): what
    the build writes there, before compression."""
    gitdir = find_gitdir(dest / repo.repo_id)
    if gitdir is None or not repo.blobs:
        return sum(repo.blobs.values())
    names = "".join(f"{sha}\n" for sha in repo.blobs).encode()
    try:
        out = run_git(gitdir, "cat-file", "--batch-check", stdin=names).decode()
    except GitError:
        return sum(repo.blobs.values())
    return sum(
        repo.blobs[line.split()[0]] for line in out.splitlines() if line.endswith(" missing")
    )


def _write_mirror(
    plans: list[tuple[SourceRepo, int]], dest: Path, orgs: list[str] | None
) -> list[BuiltRepo]:
    """Write every repo's objects, then move the branches, then the trusted publishers. On any
    failure the folders this build created are removed (so a new DEST is not left half made),
    and a full disk is InsufficientSpace."""
    created = _new_folders(dest, [repo.repo_id for repo, _ in plans])
    try:
        dest.mkdir(parents=True, exist_ok=True)
        pending = [_write_commit(repo, version, dest) for repo, version in plans]
        built = [_publish(repo) for repo in pending]
        if orgs is not None:
            write_trusted_publishers(dest / CONFIG_NAME, orgs)
        return built
    except BaseException as exc:
        for folder in created:
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, KernelsError) or not is_disk_full(exc):
            raise
        raise InsufficientSpace(
            f"the mirror build into {dest}: a disk filled up while it was being written",
            hint=DEST_HINT,
        ) from exc


def _new_folders(dest: Path, repo_ids: list[str]) -> list[Path]:
    """The topmost folders that building `repo_ids` into `dest` creates."""
    top = None
    folder = Path(os.path.abspath(dest))
    while not folder.exists() and folder.parent != folder:
        top, folder = folder, folder.parent
    if top is not None:
        return [top]
    found: list[Path] = []
    for repo_id in repo_ids:
        org = dest / repo_id.split("/")[0]
        folder = dest / repo_id if org.exists() else org
        if not folder.exists() and folder not in found:
            found.append(folder)
    return found


def _org_names(names: Iterable[str]) -> list[str]:
    orgs = sorted(set(names))
    for org in orgs:
        if not isinstance(org, str) or not valid_name(org):
            raise InvalidSpec(
                f"{org!r} is not an org name", hint="name trusted publishers like kernels-community"
            )
    return orgs


def write_trusted_publishers(path: Path, orgs: list[str]) -> None:
    """Write a kernels-mirror.toml that trusts exactly `orgs` (mode 0644, atomically)."""
    names = ", ".join(json.dumps(org) for org in orgs)
    text = (
        "# Written by `kernels mirror build --trust`: the publishers this mirror reports as\n"
        "# trusted (GET /api/organizations/<org>/overview).\n"
        f"trusted_publishers = [{names}]\n"
    )
    atomic_write_bytes(path, text.encode())


def _version(repo: SourceRepo) -> int:
    """The one version all variants' metadata.json agree on."""
    # A variant is a folder of build/ that holds files (git keeps no empty folders).
    variants = sorted(
        {p.split("/")[1] for p, _, _ in repo.files if p.startswith("build/") and p.count("/") >= 2}
    )
    versions: dict[str, int] = {}
    for variant in variants:
        where = f"{repo.repo_id}: build/{variant}/metadata.json"
        staged = repo.staged(f"build/{variant}/metadata.json")
        if staged is None:
            raise InvalidMetadata(f"{where} is missing", hint=_VERSION_HINT)
        if staged.stat().st_size > MAX_METADATA_BYTES:  # clients refuse it; never parsed
            raise InvalidMetadata(
                f"{where} is larger than {MAX_METADATA_BYTES} bytes, which clients refuse",
                hint=_VERSION_HINT,
            )
        try:
            data = json.loads(staged.read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidMetadata(
                f"{where} is not readable JSON: {exc}", hint=_VERSION_HINT
            ) from None
        version = data.get("version") if isinstance(data, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidMetadata(f'{where} has no integer "version"', hint=_VERSION_HINT)
        versions[variant] = version
    if not versions:
        raise InvalidMetadata(f"{repo.repo_id}: build/ has no variant folders", hint=_VERSION_HINT)
    if len(set(versions.values())) > 1:
        found = ", ".join(f"{name}={v}" for name, v in versions.items())
        raise InvalidMetadata(
            f"{repo.repo_id}: variants disagree on version ({found})", hint=_VERSION_HINT
        )
    return next(iter(versions.values()))


def _write_commit(repo: SourceRepo, version: int, dest: Path) -> BuiltRepo:
    """Store `repo`'s files and their commit in DEST's repo; no branch moves yet."""
    gitdir = GitRepoWriter(dest / repo.repo_id).gitdir
    tree = write_tree(gitdir, repo.files)
    current = rev(gitdir, "refs/heads/main")
    changed = current is None or tree_of(gitdir, current) != tree
    if changed:
        commit = commit_tree(gitdir, tree, [], f"{repo.repo_id} v{version}\n")
    else:
        commit = current
    return BuiltRepo(
        repo_id=repo.repo_id, path=gitdir, commit=commit, version=version, changed=changed
    )


def _publish(built: BuiltRepo) -> BuiltRepo:
    """Point `main` (when changed) and `v<version>` at the written commit."""
    if built.changed:
        set_ref(built.path, "refs/heads/main", built.commit)
    set_ref(built.path, f"refs/heads/v{built.version}", built.commit)
    return built
