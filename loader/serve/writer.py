"""Write git repos without a work tree: file snapshots as commits, branches, tags, LFS objects.

Author, committer and dates are fixed, so the same files on the same parent give the same commit
sha on every machine. Used by `build_mirror` and by tests to make fixture repos.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .git import GitError, git_env, run_git
from .lfs import format_pointer, object_path
from .mirror import find_gitdir

_DATE = "1704067200 +0000"  # 2024-01-01T00:00:00Z
IDENTITY = {
    "GIT_AUTHOR_NAME": "kernels mirror",
    "GIT_AUTHOR_EMAIL": "mirror@kernels.invalid",
    "GIT_AUTHOR_DATE": _DATE,
    "GIT_COMMITTER_NAME": "kernels mirror",
    "GIT_COMMITTER_EMAIL": "mirror@kernels.invalid",
    "GIT_COMMITTER_DATE": _DATE,
}


def write_tree(gitdir: Path, files: Sequence[tuple[str, str, Path]]) -> str:
    """Store `files` ((repo path, git mode, file on disk), ...) as blobs; return the root tree sha."""
    if not files:
        return run_git(gitdir, "mktree", stdin=b"").decode().strip()
    sources = [str(src) for _, _, src in files]
    if any("\n" in src for src in sources):
        raise ValueError("file names with a newline cannot be stored")
    shas = run_git(
        gitdir,
        "hash-object",
        "-w",
        "--no-filters",
        "--stdin-paths",
        stdin="\n".join(sources).encode(),
    ).split()
    listing = b"".join(
        f"{mode} {sha.decode()}\t{path}".encode() + b"\0"
        for (path, mode, _), sha in zip(files, shas, strict=True)
    )
    with tempfile.TemporaryDirectory(prefix="kernels-index-") as tmp:
        env = git_env({"GIT_INDEX_FILE": os.path.join(tmp, "index")})
        run_git(gitdir, "update-index", "-z", "--index-info", stdin=listing, env=env)
        return run_git(gitdir, "write-tree", env=env).decode().strip()


def commit_tree(gitdir: Path, tree: str, parents: Sequence[str], message: str) -> str:
    """Create a commit of `tree` with the fixed identity and date; return its sha."""
    args = ["commit-tree", tree]
    for parent in parents:
        args += ["-p", parent]
    out = run_git(gitdir, *args, "-F", "-", stdin=message.encode(), env=git_env(IDENTITY))
    return out.decode().strip()


def rev(gitdir: Path, ref: str) -> str | None:
    """The commit `ref` points at, or None when it does not exist."""
    try:
        out = run_git(gitdir, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}")
    except GitError:
        return None
    return out.decode().strip() or None


def tree_of(gitdir: Path, commit: str) -> str:
    """The root tree sha of `commit`."""
    return run_git(gitdir, "rev-parse", "--verify", f"{commit}^{{tree}}").decode().strip()


def set_ref(gitdir: Path, ref: str, sha: str) -> None:
    run_git(gitdir, "update-ref", ref, sha)


class GitRepoWriter:
    """Make and update the git repo at `path` (created bare by default) for fixtures and mirrors.

    >>> w = GitRepoWriter(root / "org" / "relu")
    >>> v1 = w.commit({"build/torch-universal/relu/__init__.py": "X = 1\\n"}, branch="v1")
    >>> w.tag("v1.0.0", v1, message="release")          # annotated; omit message for lightweight
    >>> w.commit({"weights.bin": w.lfs(b"\\0" * 4096)})  # an LFS pointer + its object
    """

    def __init__(self, path: Path | str, *, bare: bool = True):
        self.path = Path(path)
        existing = find_gitdir(self.path)
        self.gitdir = existing or (self.path if bare else self.path / ".git")
        if existing is None:
            self.path.mkdir(parents=True, exist_ok=True)
            flags = ["--bare"] if bare else []
            cmd = ["git", "init", "-q", *flags, "-b", "main", str(self.path)]
            proc = subprocess.run(cmd, capture_output=True, env=git_env(), check=False)
            if proc.returncode != 0:
                raise GitError(f"git init {self.path} failed: {proc.stderr.decode().strip()}")

    def commit(
        self, files: Mapping[str, bytes | str], *, branch: str = "main", message: str = "update"
    ) -> str:
        """Commit exactly `files` ({repo path: content}; str is UTF-8) on top of `branch`.

        The branch is created when missing (its first commit has no parent). Returns the commit sha.
        """
        ref = f"refs/heads/{branch}"
        with tempfile.TemporaryDirectory(prefix="kernels-files-") as tmp:
            entries = []
            for i, (path, content) in enumerate(sorted(files.items())):
                source = Path(tmp) / str(i)
                source.write_bytes(content.encode() if isinstance(content, str) else content)
                entries.append((path, "100644", source))
            tree = write_tree(self.gitdir, entries)
        parent = rev(self.gitdir, ref)
        sha = commit_tree(self.gitdir, tree, [parent] if parent else [], message)
        set_ref(self.gitdir, ref, sha)
        return sha

    def branch(self, name: str, target: str) -> None:
        """Create or move branch `name` to commit `target` (a sha or any ref name)."""
        self.set_ref(f"refs/heads/{name}", target)

    def tag(self, name: str, target: str, *, message: str | None = None) -> None:
        """Tag `target`: lightweight without `message`, annotated (a tag object) with one."""
        sha = rev(self.gitdir, target)
        if sha is None:
            raise ValueError(f"{target!r} is not a commit in {self.gitdir}")
        if message is None:
            set_ref(self.gitdir, f"refs/tags/{name}", sha)
        else:
            env = git_env(IDENTITY)
            run_git(self.gitdir, "tag", "-f", "-a", "-m", message, name, sha, env=env)

    def set_ref(self, ref: str, target: str) -> None:
        """Point the full ref name `ref` (`refs/pr/1`, `refs/convert/x`, ...) at commit `target`."""
        sha = rev(self.gitdir, target)
        if sha is None:
            raise ValueError(f"{target!r} is not a commit in {self.gitdir}")
        set_ref(self.gitdir, ref, sha)

    def delete_ref(self, ref: str) -> None:
        """Delete a ref by full name (`refs/heads/v1`, `refs/tags/v1.0.0`)."""
        run_git(self.gitdir, "update-ref", "-d", ref)

    def head(self, ref: str = "main") -> str | None:
        """The commit `ref` (a branch, tag or full ref name) points at, or None."""
        return rev(self.gitdir, ref)

    def lfs(self, data: bytes) -> bytes:
        """Store `data` as a git-lfs object of this repo; return the pointer to commit in its place."""
        oid = hashlib.sha256(data).hexdigest()
        target = object_path(self.gitdir, oid)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            partial.write_bytes(data)
            os.replace(partial, target)
        return format_pointer(oid, len(data))
