"""Stage 1 of the pipeline: parse and validate what the user asked for.

`KernelSpec` is a validated request: a Hub repo id with at most one of a revision or a version,
or a local path, plus an optional layer name. Everything downstream can trust its fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidSpec
from .remote_file import is_commit_id

# The Hub's rules for a namespace and a repo name: letters, digits, '-', '_', '.', no leading or
# trailing '-'/'.', no '--' or '..', at most 96 characters each.
_NAME = re.compile(r"^(?![-.])(?!.*(--|\.\.))[A-Za-z0-9_.\-]{1,96}(?<![-.])\Z")
# Patterns kept as strings are compiled on first use (re caches them): a warm get_kernel names
# no layer and pastes no URL, so it does not pay for them.
_LAYER = r"^[A-Za-z_][A-Za-z0-9_]*\Z"
_VERSION_BRANCH = re.compile(r"^v(0|[1-9][0-9]{0,8})\Z")
# Branch and tag names the Hub accepts; git revision expressions (~ ^ : .. @{ and spaces) are not.
_REVISION = re.compile(r"^(?!.*(\.\.|@\{|//))(?![/.-])[A-Za-z0-9._/\-]{1,255}(?<![/.])\Z")
# A pasted Hub (or mirror) page address: https://huggingface.co/org/repo[/tree/<rev>[/...]]
_HUB_URL = (
    r"^(?:[a-z][a-z0-9+.-]*://)?[^/\s]+/"
    r"(?P<repo>[^/\s]+/[^/\s?#]+)(?:/tree/(?P<rev>[^/\s?#]+))?"
)


def _url_error(text: str) -> InvalidSpec | None:
    """An InvalidSpec naming the spec to write instead of a pasted URL, or None."""
    if "://" not in text and not text.startswith(("huggingface.co/", "hf.co/")):
        return None
    match = re.match(_HUB_URL, text)
    if match is None:
        return InvalidSpec(f"{text!r} is a URL, not a kernel spec", hint="use org/repo[@revision]")
    spec = match["repo"] + (f"@{match['rev']}" if match["rev"] else "")
    return InvalidSpec(f"{text!r} is a URL, not a kernel spec", hint=f"use {spec}")


def validate_repo_id(repo_id: object) -> str:
    """Return `repo_id` if it is a well-formed "org/name" Hub id, else raise InvalidSpec."""
    if not isinstance(repo_id, str):
        raise InvalidSpec(f"repo id must be a string like 'org/name', got {type(repo_id).__name__}")
    url_error = _url_error(repo_id)
    if url_error is not None:
        raise url_error
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
        raise InvalidSpec(f"{repo_id!r} is not a valid repo id; expected 'org/name'")
    return repo_id


def validate_revision(revision: object) -> str:
    """Return `revision` if it is a branch, tag or 40-hex commit name the Hub can resolve."""
    if not isinstance(revision, str) or not _REVISION.match(revision):
        raise InvalidSpec(
            f"{revision!r} is not a valid revision; use a branch, a tag or a 40-hex commit"
        )
    return revision


def validate_version(version: object) -> int:
    """Return `version` if it is a non-negative int (bools are refused)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidSpec(f"version must be a non-negative integer, got {version!r}")
    return version


def is_commit(revision: str | None) -> bool:
    """True for a full 40-hex commit id (a pinned revision that never moves)."""
    return is_commit_id(revision)


def version_branch(version: int) -> str:
    """The branch that carries major version `version`: 'v<N>'."""
    return f"v{validate_version(version)}"


def parse_version_branch(name: str) -> int | None:
    """'v3' -> 3; anything else -> None."""
    m = _VERSION_BRANCH.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class KernelSpec:
    """A validated kernel request.

    Exactly one of `repo_id` and `path` is set. For a Hub repo, `revision` and `version` are not
    both set; `ref` is what to resolve ('v<N>' for a version).
    """

    repo_id: str | None = None
    path: Path | None = None
    revision: str | None = None
    version: int | None = None
    layer: str | None = None

    @property
    def ref(self) -> str | None:
        if self.version is not None:
            return version_branch(self.version)
        return self.revision

    @property
    def pinned(self) -> bool:
        return is_commit(self.revision)

    def __str__(self) -> str:
        base = str(self.path) if self.path is not None else str(self.repo_id)
        if self.version is not None:
            base += f"@v{self.version}"
        elif self.revision is not None:
            base += f"@{self.revision}"
        return f"{base}:{self.layer}" if self.layer else base


def make_spec(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    layer: str | None = None,
    require_ref: bool = True,
) -> KernelSpec:
    """Build a Hub `KernelSpec` from keyword arguments (the reference API's calling style)."""
    validate_repo_id(repo_id)
    if revision is not None and version is not None:
        raise InvalidSpec(
            f"{repo_id}: Only one of `revision` or `version` must be specified.",
            hint="version=N means the branch 'v<N>'; pass only one of them",
        )
    if revision is None and version is None and require_ref:
        raise InvalidSpec(
            f"{repo_id}: A kernel version or revision must be specified.",
            hint="pass version=1 (the branch 'v1') or revision='<branch|tag|commit>'",
        )
    if revision is not None:
        validate_revision(revision)
    if version is not None:
        validate_version(version)
    if layer is not None and not re.match(_LAYER, layer):
        raise InvalidSpec(f"{layer!r} is not a valid layer name")
    return KernelSpec(repo_id=repo_id, revision=revision, version=version, layer=layer)


def parse_spec(
    text: str, *, default_version: int | None = None, require_ref: bool = True
) -> KernelSpec:
    """Parse 'org/repo[@rev][:Layer]' or '/abs/path[:Layer]'.

    '@v2' means version 2 (the branch 'v2'); '@<anything else>' is a revision. With no '@',
    `default_version` applies (a missing ref is an error when it is None).
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidSpec(f"empty kernel spec {text!r}")
    text = text.strip()
    url_error = _url_error(text)
    if url_error is not None:
        raise url_error
    if text.startswith(("/", "~")) or (len(text) > 2 and text[1] == ":" and text[2] in "\\/"):
        path_text, layer = _split_layer(text, windows_drive=text[1:2] == ":")
        try:
            path = Path(path_text).expanduser()
        except (RuntimeError, ValueError):  # no such user, no home folder, a NUL byte
            raise InvalidSpec(f"{text!r}: cannot expand '~' in this path") from None
        if not path.is_absolute():
            raise InvalidSpec(f"{text!r}: a local kernel path must be absolute")
        return KernelSpec(path=path, layer=layer)
    if "/" not in text:
        raise InvalidSpec(f"{text!r} is not a kernel spec")
    head, layer = _split_layer(text)
    repo_id, at, ref = head.partition("@")
    if at and not ref:
        raise InvalidSpec(f"{text!r}: nothing after '@'")
    revision = version = None
    if at:
        number = parse_version_branch(ref)
        if number is not None:
            version = number
        else:
            revision = ref
    elif default_version is not None:
        version = default_version
    return make_spec(
        repo_id, revision=revision, version=version, layer=layer, require_ref=require_ref
    )


def _split_layer(text: str, *, windows_drive: bool = False) -> tuple[str, str | None]:
    start = 2 if windows_drive else 0
    head, sep, layer = text[start:].rpartition(":")
    if not sep:
        return text, None
    head = text[:start] + head
    if not layer or not re.match(_LAYER, layer):
        raise InvalidSpec(f"{text!r}: {layer!r} is not a valid layer name")
    if not head:
        raise InvalidSpec(f"{text!r}: missing repo before ':'")
    return head, layer
