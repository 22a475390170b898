"""Stage 2: a requested revision or version -> a 40-hex commit.

Zero requests when the commit is pinned or the cache's resolution record is younger than the TTL
(KERNELS_RESOLVE_TTL) or we are offline; one request to re-check otherwise. When the Hub cannot
be reached, an existing record is used, with one notice.

Two refusals guard what a revision may name. `refs/pr/<N>` is a pull request: code the
publisher has not merged, which their trust does not cover; it resolves only with
KERNELS_ALLOW_PR_REVISIONS=1. And a commit must be 40 lowercase hex digits, whether the server
answered it or a record holds it: anything else would be used as a path and a cache key.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from kernels.cache import Cache, ResolutionRecord

from . import settings
from .errors import (
    HubUnavailable,
    IntegrityError,
    InvalidSpec,
    RevisionNotFound,
    VersionNotFound,
)
from .notices import notice_once
from .spec import KernelSpec, is_commit, parse_version_branch

PR_PREFIX = "refs/pr/"


def check_revision_allowed(repo_id: str, revision: str | None) -> None:
    """Refuse a pull-request revision unless the user opted in (InvalidSpec)."""
    if (
        revision is not None
        and revision.startswith(PR_PREFIX)
        and not settings.allow_pr_revisions()
    ):
        raise InvalidSpec(
            f"{repo_id}@{revision} is a pull request: code its publisher has not merged, "
            "which trusting the publisher does not cover",
            hint="set KERNELS_ALLOW_PR_REVISIONS=1 to load pull-request revisions on purpose",
        )


@dataclass(frozen=True)
class Resolution:
    repo_id: str
    ref: str
    commit: str
    source: str  # "pinned", "record", "hub", "stale-record"

    @property
    def networked(self) -> bool:
        return self.source == "hub"


def _age_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def resolve(cache: Cache, spec: KernelSpec, *, offline: bool, ttl: float) -> Resolution:
    """Resolve `spec` (a Hub spec with a ref) to a commit, per the rules in the module docstring."""
    repo_id, ref = spec.repo_id, spec.ref
    assert repo_id is not None and ref is not None
    check_revision_allowed(repo_id, ref)
    if spec.pinned:
        return Resolution(repo_id, ref, ref, "pinned")
    record = cache.records.get(repo_id, ref)
    if record is not None and not is_commit(record.commit):
        record = None  # a damaged record is no record
    if record is not None and (offline or record.age() < ttl):
        return Resolution(repo_id, ref, record.commit, "record")
    if offline:
        from .offline import cache_miss  # an error path: kept off the warm load

        raise cache_miss(cache, repo_id, ref, "this revision was never resolved here")
    from . import hub  # the network paths only: a warm load never imports it

    try:
        commit = hub.resolve_revision(repo_id, ref)
    except HubUnavailable as exc:
        if record is None:
            raise
        notice_once(
            f"stale:{repo_id}@{ref}",
            f"kernels: the Hub is unreachable ({exc.message}); using {repo_id}@{ref} = "
            f"{record.commit[:12]} from the cache, checked {_age_text(record.age())} ago",
        )
        return Resolution(repo_id, ref, record.commit, "stale-record")
    except RevisionNotFound as exc:
        raise _explain_missing_revision(cache, repo_id, ref, spec.version, exc) from exc
    if not is_commit(commit):
        raise IntegrityError(
            f"{repo_id}@{ref}: the server at {settings.endpoint()} answered a malformed commit "
            f"id {str(commit)[:80]!r} (not 40 lowercase hex digits)",
            hint="refusing it; check HF_ENDPOINT, and report the server if it is yours",
        )
    try:
        cache.ensure()
        cache.records.put(ResolutionRecord(repo_id, ref, commit, time.time()))
    except OSError:
        pass  # a read-only cache still serves this process; nothing is lost
    return Resolution(repo_id, ref, commit, "hub")


def _explain_missing_revision(
    cache: Cache, repo_id: str, ref: str, version: int | None, cause: RevisionNotFound
) -> RevisionNotFound:
    # The types and the version wording are the reference's, which callers catch and match: a
    # missing revision is also huggingface_hub's RevisionNotFoundError, a missing version also
    # a ValueError ("Version N not found, available versions: 1, 2, 10"). The requests made
    # here (the repo's refs) are on this error path only.
    from .hub_errors import revision_not_found

    if version is None:
        err = revision_not_found(
            f"{repo_id} has no branch, tag or commit {ref!r}",
            cause,
            hint=_missing_revision_hint(cache, repo_id, ref),
        )
    else:
        branches = _refs(repo_id)["branches"]
        versions = sorted(v for v in (parse_version_branch(b) for b in branches) if v is not None)
        listed = ", ".join(str(v) for v in versions) if versions else "none"
        err = VersionNotFound(
            f"{repo_id}: Version {version} not found, available versions: {listed}",
            hint=f"use version={versions[-1]}" if versions else None,
        )
    err.repo_id, err.ref = repo_id, ref  # for hints phrased elsewhere (the CLI's pyproject ones)
    return err


def _refs(repo_id: str) -> dict[str, dict[str, str]]:
    """The repo's branches and tags, or none when they cannot be listed (best effort: the error
    being explained stands on its own)."""
    from . import hub

    try:
        return hub.list_refs(repo_id)
    except Exception:
        return {"branches": {}, "tags": {}}


def _missing_revision_hint(cache: Cache, repo_id: str, ref: str) -> str | None:
    """What `ref` was probably meant to be: `N` for the version branch vN, an abbreviated
    commit for the full one (from the repo's refs and this machine's records). None: the
    error's default hint."""
    if ref.isdigit():
        if f"v{ref}" in _refs(repo_id)["branches"]:
            return f"did you mean version={ref}? '{ref}' is read as a branch or tag name"
        return None
    if not re.fullmatch(r"[0-9a-f]{4,39}", ref):  # compiled here: an error path only
        return None
    refs = _refs(repo_id)
    known = {*refs["branches"].values(), *refs["tags"].values()}
    known.update(record.commit for record in cache.records.revisions(repo_id))
    matches = sorted(c for c in known if c.startswith(ref))
    if len(matches) == 1:
        return f"a commit is given in full (40 hex digits): did you mean {matches[0]}?"
    return f"a commit is given in full (40 hex digits): run `kernels versions {repo_id}`"


def available_versions(repo_id: str) -> dict[int, str]:
    """{N: commit} for every branch 'v<N>' of the repo (one request)."""
    from . import hub

    branches = hub.list_refs(repo_id)["branches"]
    out = {}
    for name, commit in branches.items():
        number = parse_version_branch(name)
        if number is not None:
            out[number] = commit
    return dict(sorted(out.items()))
