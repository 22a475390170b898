"""kernels.lock: the exact commit and file digests of every kernel a project uses.

Format (schema 1, JSON):

    {"schema": 1,
     "kernels": [{"repo_id": "org/name", "requested": {"version": 1},
                  "commit": "<40 hex>",
                  "variants": {"torch-universal": {"<path>": "<sha256>", ...}, ...}}]}

Every variant is locked, so one lock serves every platform. The reference's 0.17 format
(`[{"dependency": {...}, "lock": {"commit"}}]`) and its <=0.16 format
(`[{"repo_id", "sha", "variants": {...}}]`) are read too; they carry no per-file digests.
Dependencies come from pyproject.toml: `[tool.kernels.dependencies] "org/name" = 1` (a
version) or `= "<revision>"`.

A lock decides which code runs, so it must be the user's: a lock file (or a folder above it)
that other users can write is refused, and discovery stops at the first folder others can write
(a kernels.lock found in it is refused, never used; nothing above it is looked at), so a shared
/tmp-like parent cannot plant one. A schema-1 entry must carry file digests: an entry
or variant with none would verify nothing. `refs/pr/<N>` revisions need
KERNELS_ALLOW_PR_REVISIONS=1 here as everywhere (see resolve.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import settings
from .errors import LockfileError
from .resolve import check_revision_allowed
from .spec import is_commit, make_spec, validate_repo_id

SCHEMA = 1
LOCK_NAME = "kernels.lock"


@dataclass(frozen=True)
class Requested:
    version: int | None = None
    revision: str | None = None

    def to_json(self) -> dict:
        return (
            {"version": self.version} if self.version is not None else {"revision": self.revision}
        )

    def __str__(self) -> str:
        return f"v{self.version}" if self.version is not None else str(self.revision)


@dataclass(frozen=True)
class LockEntry:
    repo_id: str
    requested: Requested
    commit: str
    variants: dict[str, dict[str, str]] | None = None  # variant -> {path: sha256}; None: no digests

    def to_json(self) -> dict:
        data = {
            "repo_id": self.repo_id,
            "requested": self.requested.to_json(),
            "commit": self.commit,
        }
        data["variants"] = {
            v: dict(sorted(f.items())) for v, f in sorted((self.variants or {}).items())
        }
        return data


@dataclass
class Lockfile:
    entries: list[LockEntry] = field(default_factory=list)
    path: Path | None = None
    source_format: str = "kernels-1"

    def find(self, repo_id: str) -> LockEntry:
        for entry in self.entries:
            if entry.repo_id == repo_id:
                return entry
        where = f" in {self.path}" if self.path else ""
        raise LockfileError(
            f"{repo_id} is not locked{where}",
            hint="add it to [tool.kernels.dependencies] in pyproject.toml and run `kernels lock`",
        )

    def dumps(self) -> str:
        entries = [e.to_json() for e in sorted(self.entries, key=lambda e: e.repo_id)]
        return json.dumps({"schema": SCHEMA, "kernels": entries}, indent=2) + "\n"


def _bad(path: Path | None, why: str) -> LockfileError:
    return LockfileError(f"{path or 'lockfile'}: {why}")


def _requested(repo_id: str, raw: object, path: Path | None) -> Requested:
    if isinstance(raw, dict):
        version, revision = raw.get("version"), raw.get("revision")
    elif isinstance(raw, bool):
        raise _bad(path, f"{repo_id}: a dependency must be a version number or a revision string")
    elif isinstance(raw, int):
        version, revision = raw, None
    elif isinstance(raw, str):
        version, revision = None, raw
    else:
        raise _bad(path, f"{repo_id}: a dependency must be a version number or a revision string")
    try:
        spec = make_spec(repo_id, version=version, revision=revision)
        check_revision_allowed(repo_id, spec.revision)
    except Exception as exc:
        raise _bad(path, f"{repo_id}: {getattr(exc, 'message', exc)}") from None
    return Requested(spec.version, spec.revision)


def parse_lock(text: str, path: Path | None = None) -> Lockfile:
    """Parse a lock in this package's format or the reference's 0.16 / 0.17 formats."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _bad(path, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise _bad(path, "not valid JSON (nested too deeply)") from None
    entries: list[LockEntry] = []
    try:
        if isinstance(data, dict):
            if data.get("schema") != SCHEMA:
                raise _bad(
                    path,
                    f"unknown lock schema {data.get('schema')!r} (this kernels reads {SCHEMA})",
                )
            for item in data["kernels"]:
                repo_id = validate_repo_id(item["repo_id"])
                variants = {
                    str(v): {str(p): str(s) for p, s in files.items()}
                    for v, files in item.get("variants", {}).items()
                }
                empty = [v for v, files in variants.items() if not files]
                if not variants or empty:
                    what = f"variant {empty[0]}" if empty else "entry"
                    raise LockfileError(
                        f"{path or 'lockfile'}: {repo_id}: the {what} has no file digests, so "
                        "there is nothing to verify the download against",
                        hint="run `kernels lock` to write a lock with the digests of every file",
                    )
                entries.append(
                    LockEntry(
                        repo_id,
                        _requested(repo_id, item["requested"], path),
                        item["commit"],
                        variants,
                    )
                )
            fmt = "kernels-1"
        elif isinstance(data, list) and all(
            isinstance(i, dict) and "dependency" in i for i in data
        ):
            for item in data:  # reference 0.17
                dep = item["dependency"]
                repo_id = validate_repo_id(dep["repo-id"])
                entries.append(
                    LockEntry(
                        repo_id,
                        _requested(repo_id, {"version": dep["version"]}, path),
                        item["lock"]["commit"],
                    )
                )
            fmt = "reference-0.17"
        elif isinstance(data, list):
            for item in data:  # reference <= 0.16: no requested version was recorded
                repo_id = validate_repo_id(item["repo_id"])
                entries.append(LockEntry(repo_id, Requested(revision=item["sha"]), item["sha"]))
            fmt = "reference-0.16"
        else:
            raise _bad(path, "expected a JSON object or list")
    except LockfileError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise _bad(path, f"malformed entry ({type(exc).__name__}: {exc})") from None
    for entry in entries:
        if not is_commit(entry.commit):
            raise _bad(path, f"{entry.repo_id}: commit {entry.commit!r} is not a 40-hex commit id")
        for variant, files in (entry.variants or {}).items():
            for rel, sha in files.items():
                if len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
                    raise _bad(path, f"{entry.repo_id}/{variant}/{rel}: bad sha256 {sha!r}")
    return Lockfile(entries, path, fmt)


def read_lock(path: Path) -> Lockfile:
    """Parse the lock at `path`; UnsafePermissions when other users could have written it."""
    from .exposure import refuse_exposed

    refuse_exposed(path, "the lock file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LockfileError(f"{path}: no such lockfile") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LockfileError(f"{path}: cannot read ({exc})") from None
    return parse_lock(text, path)


def write_lock(lock: Lockfile, path: Path) -> None:
    from kernels.cache.fsutil import atomic_write_bytes

    atomic_write_bytes(path, lock.dumps().encode("utf-8"))


def dependency_hint(pyproject: Path | str, repo_id: str) -> str:
    """What a dependency line of pyproject.toml may say: the fix for one that is wrong."""
    return (
        f'in {pyproject}, [tool.kernels.dependencies]: write "{repo_id}" = 1 for version 1 '
        f'(a number), or "{repo_id}" = "<branch|tag|40-hex commit>"'
    )


def read_dependencies(pyproject: Path) -> dict[str, Requested]:
    """[tool.kernels.dependencies] of a pyproject.toml; a LockfileError's hint says what to fix
    in the file."""
    from .toml_text import TomlError, loads

    try:
        data = loads(pyproject.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LockfileError(f"{pyproject}: no such file") from None
    except (OSError, UnicodeDecodeError, TomlError) as exc:
        raise LockfileError(
            f"{pyproject}: cannot parse ({exc})",
            hint=f"fix the TOML syntax of {pyproject} at the line named above",
        ) from None
    deps = data.get("tool", {}).get("kernels", {}).get("dependencies", {})
    if not isinstance(deps, dict):
        raise LockfileError(
            f"{pyproject}: [tool.kernels.dependencies] must be a table",
            hint=f'in {pyproject}, write [tool.kernels.dependencies] with lines "org/repo" = 1',
        )
    out = {}
    for repo_id, raw in deps.items():
        try:
            validate_repo_id(repo_id)
        except Exception as exc:
            raise LockfileError(
                f"{pyproject}: {getattr(exc, 'message', exc)}",
                hint=f'in {pyproject}, [tool.kernels.dependencies]: name each kernel "org/repo"',
            ) from None
        try:
            out[repo_id] = _requested(repo_id, raw, pyproject)
        except LockfileError as exc:
            raise LockfileError(exc.message, hint=dependency_hint(pyproject, repo_id)) from None
    return out


def find_lockfile(explicit: Path | str | None = None, start: Path | None = None) -> Path:
    """The lock to use: explicit path, KERNELS_LOCKFILE, else the nearest kernels.lock (or a
    pyproject.toml's folder holding one) at or above `start` (the working directory)."""
    if explicit is not None:
        return Path(explicit)
    override = settings.lockfile_override()
    if override is not None:
        return override
    from kernels.cache.safety import check_path

    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / LOCK_NAME
        exposure = check_path(folder, parents=False)
        if exposure is not None:
            # Others can write here: a kernels.lock in it may be theirs (say so, use none), and
            # one above it is no longer this project's.
            if candidate.is_file():
                from .exposure import unsafe

                raise unsafe(exposure, f"the lock file {candidate}")
            break
        if candidate.is_file():
            return candidate
        if (folder / "pyproject.toml").is_file():
            break  # a project root without a lock: stop, do not borrow a parent's lock
    raise LockfileError(
        f"no {LOCK_NAME} found at or above {here}",
        hint="run `kernels lock` in the project, or set KERNELS_LOCKFILE",
    )


def stale_entries(deps: dict[str, Requested], lock: Lockfile) -> list[str]:
    """How pyproject.toml's dependencies and the lock disagree (empty when in sync)."""
    problems = []
    locked = {e.repo_id: e for e in lock.entries}
    for repo_id, requested in deps.items():
        entry = locked.get(repo_id)
        if entry is None:
            problems.append(f"{repo_id} is in pyproject.toml but not in the lock")
        elif entry.requested != requested:
            problems.append(
                f"{repo_id}: pyproject.toml asks for {requested}, the lock has {entry.requested}"
            )
        elif lock.source_format == "kernels-1" and not entry.variants:
            problems.append(f"{repo_id}: the lock has no file digests")
    for repo_id in locked:
        if repo_id not in deps:
            problems.append(f"{repo_id} is in the lock but not in pyproject.toml")
    return problems
