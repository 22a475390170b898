"""The reference's "newer version available" warning for `version=N` loads.

When a load resolves `version=N` with the Hub and the repo has a higher `v<M>` branch, log
"You are using version N of 'org/repo', but version M is available." at WARNING on the logger
`kernels._versions` (the reference's logger, so log filters written for it keep working). It
costs one refs request, made only when this cache resolves `org/repo` version N with the Hub for
the first time: warm loads (zero requests) and TTL re-checks (one) keep their request counts, so
the warning is shown once per cache rather than on every load as the reference does.
"""

from __future__ import annotations

import logging

from . import hub
from .errors import KernelsError
from .spec import parse_version_branch

logger = logging.getLogger("kernels._versions")


def latest_version(repo_id: str) -> int | None:
    """The highest N of the repo's `v<N>` branches (one request), or None when it has none."""
    branches = hub.list_refs(repo_id)["branches"]
    numbers = [n for n in (parse_version_branch(b) for b in branches) if n is not None]
    return max(numbers, default=None)


def warn_if_outdated(repo_id: str, version: int) -> None:
    """Log the warning when a version above `version` exists. Best effort: a Hub error here
    must not fail a load that already succeeded."""
    try:
        latest = latest_version(repo_id)
    except KernelsError:
        return
    if latest is not None and version < latest:
        logger.warning(
            "You are using version %d of '%s', but version %d is available.",
            version,
            repo_id,
            latest,
        )
