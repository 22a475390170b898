"""Read one git repository through the `git` binary, caching what a commit sha pins down.

Everything reachable from a commit sha (its tree, blob contents, LFS pointers, its log) is immutable,
so it is cached without expiry (bounded LRUs). Refs can move while the server runs; they are
re-read only when the stat stamp of HEAD, packed-refs or anything under refs/ changes (git
rewrites refs by rename, so the inode changes even within one mtime tick).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from .lfs import MAX_POINTER_SIZE, LfsPointer, parse_pointer

HEX40 = re.compile(r"[0-9a-fA-F]{40}")
# Blobs up to this size are kept in memory after the first read; larger ones are streamed.
SMALL_BLOB = 256 * 1024
_RS, _US = "\x1e", "\x1f"  # record / unit separators in `git log` formats


class GitError(RuntimeError):
    """`git` failed on a repository the server believed valid."""


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every git call runs with: no user or system config, no prompts, C locale.

    Ignoring the user's config keeps output parseable (no colour, no signatures) and commits
    written by the builder identical on every machine.
    """
    env = dict(os.environ)
    for key in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY"):
        env.pop(key, None)
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_OPTIONAL_LOCKS="0",
        LC_ALL="C",
    )
    if extra:
        env.update(extra)
    return env


def run_git(
    gitdir: Path, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> bytes:
    """Run `git --git-dir=gitdir args...` and return stdout; GitError (with stderr) on failure."""
    proc = subprocess.run(
        ["git", f"--git-dir={gitdir}", *args],
        input=stdin,
        capture_output=True,
        env=env or git_env(),
        check=False,
    )
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip()
        raise GitError(f"git {' '.join(args[:2])} in {gitdir} failed: {message}")
    return proc.stdout


K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A thread-safe map that forgets its least recently used entries beyond a total weight."""

    def __init__(self, capacity: int, weigh: Callable[[V], int] = lambda _value: 1):
        self._data: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}
        self._total = 0
        self._capacity = capacity
        self._weigh = weigh
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            if key not in self._data:
                return None
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key: K, value: V) -> None:
        weight = self._weigh(value)
        if weight > self._capacity:
            return
        with self._lock:
            if key in self._data:
                self._total -= self._weights[key]
            self._data[key] = value
            self._data.move_to_end(key)
            self._weights[key] = weight
            self._total += weight
            while self._total > self._capacity:
                old, _ = self._data.popitem(last=False)
                self._total -= self._weights.pop(old)


@dataclass(frozen=True)
class Entry:
    """One path of a commit's tree. `size` is the blob size (0 for directories)."""

    path: str
    kind: str  # "file" | "directory"
    oid: str
    size: int
    mode: str


@dataclass(frozen=True)
class Tree:
    """A commit's full tree: entries by path, children by parent path ("" is the root), LFS pointers."""

    entries: dict[str, Entry]
    children: dict[str, list[Entry]]
    pointers: dict[str, LfsPointer]

    def walk(self, parent: str) -> Iterator[Entry]:
        """Every entry below `parent`, depth first, each directory before its contents."""
        for entry in self.children.get(parent, ()):
            yield entry
            if entry.kind == "directory":
                yield from self.walk(entry.path)


@dataclass(frozen=True)
class Refs:
    """The repo's refs: full ref name -> commit sha (annotated tags peeled), and HEAD's target."""

    commits: dict[str, str]
    head: str | None  # e.g. "refs/heads/main"; None when HEAD is detached or unreadable


@dataclass(frozen=True)
class CommitInfo:
    sha: str
    time: int  # committer time, unix seconds
    author: str
    title: str
    message: str


class GitRepo:
    """Read access to the git dir `gitdir` (a bare repo, or the .git of a work tree)."""

    def __init__(self, gitdir: Path):
        self.gitdir = gitdir
        self._gitdir_str = str(gitdir)
        self.head_file = os.path.join(self._gitdir_str, "HEAD")
        self._refs: tuple[tuple, Refs] | None = None
        self._refs_lock = threading.Lock()
        self._known_commits: set[str] = set()
        self._trees: LRU[str, Tree] = LRU(64)
        self._blobs: LRU[str, bytes] = LRU(32 * 1024 * 1024, weigh=len)
        self._logs: LRU[str, list[CommitInfo]] = LRU(64)
        self._last_commits: LRU[tuple[str, str], CommitInfo] = LRU(4096)

    # -- refs -------------------------------------------------------------------------------

    def _refs_stamp(self) -> tuple:
        stamp: list[tuple] = []
        for name in ("HEAD", "packed-refs"):
            try:
                st = os.stat(os.path.join(self._gitdir_str, name))
                stamp.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
            except FileNotFoundError:
                stamp.append((name,))
        pending = [os.path.join(self._gitdir_str, "refs")]
        while pending:
            try:
                entries = list(os.scandir(pending.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                stamp.append((entry.path, st.st_mtime_ns, st.st_size, st.st_ino))
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
        return tuple(stamp)

    def refs(self) -> Refs:
        """The current refs, re-read from git only when something under refs/ changed."""
        stamp = self._refs_stamp()
        cached = self._refs
        if cached is not None and cached[0] == stamp:
            return cached[1]
        with self._refs_lock:
            refs = self._read_refs()
            self._refs = (stamp, refs)
        return refs

    def _read_refs(self) -> Refs:
        fmt = "%(objectname) %(objecttype) %(*objectname) %(*objecttype) %(refname)"
        out = run_git(self.gitdir, "for-each-ref", f"--format={fmt}")
        commits: dict[str, str] = {}
        for line in out.decode("utf-8", "replace").splitlines():
            parts = line.split(" ", 4)
            if len(parts) != 5:
                continue
            oid, kind, peeled, peeled_kind, name = parts
            if kind == "commit":
                commits[name] = oid
            elif kind == "tag" and peeled_kind == "commit":
                commits[name] = peeled
            elif kind == "tag" and peeled_kind == "tag":  # a tag of a tag: peel all the way
                try:
                    sha = run_git(self.gitdir, "rev-parse", "--verify", "-q", f"{oid}^{{commit}}")
                except GitError:
                    continue
                commits[name] = sha.decode().strip()
        head = None
        try:
            text = (self.gitdir / "HEAD").read_text("utf-8").strip()
            if text.startswith("ref: "):
                head = text[5:]
        except OSError:
            pass
        return Refs(commits=commits, head=head)

    def resolve(self, rev: str) -> str | None:
        """The commit sha `rev` names (branch, tag, 40-hex commit, or full ref name), or None.

        Lookups are exact, so git revision expressions (`main~1`, `v1^{commit}`, `a..b`, `@{u}`,
        short shas) never resolve: no ref name can contain them.
        """
        commits = self.refs().commits
        for name in (f"refs/heads/{rev}", f"refs/tags/{rev}"):
            if name in commits:
                return commits[name]
        if HEX40.fullmatch(rev):
            sha = rev.lower()
            return sha if self.is_commit(sha) else None
        if rev.startswith("refs/"):
            return commits.get(rev)
        return None

    def is_commit(self, sha: str) -> bool:
        """True when the 40-hex `sha` is a commit in this repo (positive answers are cached)."""
        if sha in self._known_commits:
            return True
        try:
            kind = run_git(self.gitdir, "cat-file", "-t", sha).strip()
        except GitError:
            return False
        if kind == b"commit":
            self._known_commits.add(sha)
            return True
        return False

    # -- trees and blobs ---------------------------------------------------------------------

    def tree(self, commit: str) -> Tree:
        """The full tree of `commit` (a sha this repo has), with LFS pointers detected."""
        cached = self._trees.get(commit)
        if cached is not None:
            return cached
        out = run_git(self.gitdir, "ls-tree", "-r", "-t", "-l", "-z", "--full-tree", commit)
        entries: dict[str, Entry] = {}
        children: dict[str, list[Entry]] = {}
        for record in out.split(b"\0"):
            if not record:
                continue
            meta, _, raw_path = record.partition(b"\t")
            mode, kind, oid, size = meta.decode("ascii").split()
            if kind not in ("blob", "tree"):
                continue  # submodules: the Hub has none
            path = raw_path.decode("utf-8", "surrogateescape")
            entry = Entry(
                path=path,
                kind="file" if kind == "blob" else "directory",
                oid=oid,
                size=int(size) if kind == "blob" else 0,
                mode=mode,
            )
            entries[path] = entry
            children.setdefault(path.rpartition("/")[0], []).append(entry)
        small = [e for e in entries.values() if e.kind == "file" and e.size < MAX_POINTER_SIZE]
        pointers: dict[str, LfsPointer] = {}
        contents = self._read_blobs(sorted({e.oid for e in small}))
        for entry in small:
            pointer = parse_pointer(contents[entry.oid])
            if pointer is not None:
                pointers[entry.path] = pointer
        tree = Tree(entries=entries, children=children, pointers=pointers)
        self._trees.put(commit, tree)
        return tree

    def _read_blobs(self, oids: list[str]) -> dict[str, bytes]:
        """Contents of many blobs in one `git cat-file --batch` call (and into the blob cache)."""
        found: dict[str, bytes] = {}
        missing = []
        for oid in oids:
            data = self._blobs.get(oid)
            if data is None:
                missing.append(oid)
            else:
                found[oid] = data
        if missing:
            out = run_git(
                self.gitdir, "cat-file", "--batch", stdin="\n".join(missing).encode() + b"\n"
            )
            pos = 0
            for oid in missing:
                end = out.index(b"\n", pos)
                header = out[pos:end].split()
                if len(header) != 3:
                    raise GitError(f"object {oid} is missing from {self.gitdir}")
                size = int(header[2])
                data = out[end + 1 : end + 1 + size]
                pos = end + 1 + size + 1
                found[oid] = data
                self._blobs.put(oid, data)
        return found

    def read_blob(self, oid: str) -> bytes:
        """The whole content of blob `oid`."""
        return self._read_blobs([oid])[oid]

    def stream_blob(
        self, oid: str, start: int, length: int, write: Callable[[bytes], object]
    ) -> None:
        """Write `length` bytes of blob `oid` from offset `start`, without holding it in memory."""
        proc = subprocess.Popen(
            ["git", f"--git-dir={self.gitdir}", "cat-file", "blob", oid],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=git_env(),
        )
        assert proc.stdout is not None
        try:
            skip = start
            while skip > 0:
                chunk = proc.stdout.read(min(skip, 1 << 16))
                if not chunk:
                    raise GitError(f"blob {oid} ended early")
                skip -= len(chunk)
            left = length
            while left > 0:
                chunk = proc.stdout.read(min(left, 1 << 16))
                if not chunk:
                    raise GitError(f"blob {oid} ended early")
                write(chunk)
                left -= len(chunk)
        finally:
            proc.stdout.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    # -- history -----------------------------------------------------------------------------

    def log(self, commit: str) -> list[CommitInfo]:
        """Every commit reachable from `commit`, newest first."""
        cached = self._logs.get(commit)
        if cached is not None:
            return cached
        fmt = f"--format=%H{_US}%ct{_US}%an{_US}%s{_US}%B{_RS}"
        out = run_git(self.gitdir, "log", fmt, commit).decode("utf-8", "replace")
        infos = [_commit_info(record) for record in out.split(_RS) if record.strip()]
        self._logs.put(commit, infos)
        return infos

    def last_commit(self, commit: str, path: str) -> CommitInfo | None:
        """The newest commit reachable from `commit` that touched `path`."""
        key = (commit, path)
        cached = self._last_commits.get(key)
        if cached is not None:
            return cached
        fmt = f"--format=%H{_US}%ct{_US}%an{_US}%s{_US}%B{_RS}"
        out = run_git(self.gitdir, "log", "-1", fmt, commit, "--", path).decode("utf-8", "replace")
        if not out.strip():
            return None
        info = _commit_info(out.split(_RS)[0])
        self._last_commits.put(key, info)
        return info


def _commit_info(record: str) -> CommitInfo:
    sha, time, author, title, message = record.lstrip("\n").split(_US, 4)
    return CommitInfo(sha=sha, time=int(time), author=author, title=title, message=message.strip())
