"""Hints in command-line terms.

The loader's errors carry hints for Python callers ("pass trust_remote_code=True", "use
version=2"). The command line shows the same advice in its own words (`--trust-remote-code`,
`@v2`), so a user is never told to pass a keyword argument to a shell command. Messages are
never rewritten, only hints.
"""

from __future__ import annotations

import re

# (pattern, replacement) applied in order to a Python-flavoured hint.
_REWRITES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"pass trust_remote_code=True"), "pass --trust-remote-code"),
    (re.compile(r"trust_remote_code=True"), "--trust-remote-code"),
    (
        re.compile(r"pass backend=None to use the detected backend"),
        "drop --backend to use the detected backend",
    ),
    (
        re.compile(r"pass version=(\d+) \(the branch 'v\d+'\) or revision='<branch\|tag\|commit>'"),
        r"add @v\1 (the branch 'v\1') or @<branch|tag|commit> to the repo",
    ),
    (re.compile(r"\buse version=(\d+)\b"), r"use @v\1"),
    (re.compile(r"\bdid you mean version=(\d+)\?"), r"did you mean @v\1?"),
    # `kernels pull` alone does not replace an installed variant; --repair does.
    (
        re.compile(r"run `kernels verify --all`, then `kernels pull` to fetch clean copies"),
        "run `kernels verify --repair` to fetch clean copies",
    ),
]

SPEC_HINT_NO_LAYER = "use org/repo or org/repo@<v<N>|branch|tag|40-hex commit>, e.g. org/repo@v1"


def cli_hint(exc) -> str:
    """The hint of the KernelsError `exc`, phrased for the command line."""
    from .. import settings
    from ..errors import KernelNotFound, LockfileError, RevisionNotFound, UntrustedPublisher

    hint = exc.hint or ""
    if isinstance(exc, LockfileError) and "unknown lock schema" in exc.message:
        # A newer kernels wrote it: re-locking would silently downgrade the lock.
        return (
            "a newer kernels wrote this lock: upgrade kernels from where you installed it "
            "(re-locking with this one would rewrite it)"
        )
    for pattern, replacement in _REWRITES:
        hint = pattern.sub(replacement, hint)
    if isinstance(exc, UntrustedPublisher):
        hint = hint.replace("the kernels config file", f"{settings.config_path()}")
    repo_id = getattr(exc, "repo_id", None)
    if repo_id and isinstance(exc, RevisionNotFound):  # name the whole spec to type instead
        hint = re.sub(
            r"did you mean @?(v\d+|[0-9a-f]{40})\?", rf"did you mean `{repo_id}@\1`?", hint
        )
    if isinstance(exc, KernelNotFound):
        close = _known_repo_like(exc.message)
        if close:
            hint = f"did you mean `{close}`? (a repo this machine has loaded); or {hint}"
    return hint


_REPO_AT_START = re.compile(r"([A-Za-z0-9][\w.-]*/[\w.-]+?)(?=[@:\s]|$)")


def _known_repo_like(message: str) -> str | None:
    """The repo this machine's cache knows (any endpoint) closest to the one `message` starts
    with: read on this error path only, so the happy path makes no extra request or read."""
    import difflib

    from kernels.cache import Cache

    from .. import settings
    from ..errors import InvalidSpec
    from ..spec import validate_repo_id

    match = _REPO_AT_START.match(message)
    if not match:
        return None
    wanted = match.group(1)
    try:
        cache = Cache(settings.cache_root())
        known = set(cache.records.repos()) | {repo for repo, *_ in cache.all_index.entries()}
    except OSError:
        return None
    names = []
    for name in sorted(known - {wanted}):
        try:
            names.append(validate_repo_id(name))  # a record's name is printed: a valid id only
        except InvalidSpec:
            continue
    close = difflib.get_close_matches(wanted, names, n=1, cutoff=0.8)
    return close[0] if close else None


def usage_hint(parser, message: str) -> str:
    """The hint for an argparse usage error: the closest real flag for a mistyped one, else the
    command's --help."""
    import difflib

    help_hint = f"run `{parser.prog} --help` to see its options"
    match = re.match(r"unrecognized arguments: (.*)", message)
    if not match:
        return help_hint
    flags = [o for o in parser._option_string_actions if o.startswith("--")]
    for word in match.group(1).split():
        name = word.split("=", 1)[0]
        if name.startswith("--"):
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            if close:
                return f"did you mean `{close[0]}`?"
    return help_hint


def pyproject_hint(exc, pyproject) -> str:
    """The hint for a RevisionNotFound that a [tool.kernels.dependencies] line of `pyproject`
    caused (`kernels lock`): what to write on that line instead."""
    from ..errors import VersionNotFound
    from ..lockfile import dependency_hint

    repo_id = getattr(exc, "repo_id", None) or exc.message.split(":", 1)[0].split(" ", 1)[0]
    ref = getattr(exc, "ref", None)
    if isinstance(exc, VersionNotFound):
        listed = re.search(r"available versions: ([\d, ]+)$", exc.message)
        versions = [v for v in (listed.group(1).split(", ") if listed else []) if v]
        if versions:
            return (
                f'in {pyproject}, [tool.kernels.dependencies]: set "{repo_id}" = {versions[-1]} '
                f"(its versions: {', '.join(versions)})"
            )
        return dependency_hint(pyproject, repo_id) + " (it has no v<N> branches)"
    if ref is not None and ref.isdigit():
        return (
            f'in {pyproject}, [tool.kernels.dependencies]: write "{repo_id}" = {ref} (a number) '
            f'for version {ref}; "{ref}" names a branch or tag'
        )
    return dependency_hint(pyproject, repo_id) + f"; `kernels versions {repo_id}` lists them"
