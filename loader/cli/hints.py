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
    from ..errors import LockfileError, UntrustedPublisher

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
    return hint
