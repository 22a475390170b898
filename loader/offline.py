"""What an offline cache miss says: the reference's wording, and where the kernel *is* cached.

Records are per endpoint (docs/security.md), so a kernel pulled from a mirror is "not cached"
for the Hub. The message says so instead of leaving the user to wonder why `kernels ls` lists
it: it names the endpoints that have it. Only error paths import this module.
"""

from __future__ import annotations

from kernels.cache import Cache

from . import settings
from .errors import OfflineCacheMiss


def _reference_wording(repo_id: str, ref: str) -> str:
    # The reference's message; its tests and users match "local snapshot" and "offline mode".
    return (
        f"Cannot find a local snapshot for {repo_id} (revision: {ref}). When Hugging Face Hub "
        "is in offline mode the kernel must already be present in the local cache"
    )


def cached_at(cache: Cache, repo_id: str, ref: str, commit: str | None = None) -> list[str]:
    """The other endpoints that resolved `ref` or installed a variant of `commit` here."""
    found = set(cache.records.endpoints(repo_id, ref))
    if commit is not None:
        found.update(cache.index.variant_endpoints(repo_id, commit))
    found.discard(cache.endpoint or settings.endpoint())
    return sorted(found)


def cache_miss(
    cache: Cache, repo_id: str, ref: str, detail: str, *, commit: str | None = None
) -> OfflineCacheMiss:
    """OfflineCacheMiss for `repo_id@ref`: the reference's sentence, then `detail` (what is
    missing), then the endpoints it was cached from when the current one has nothing."""
    here = cache.endpoint or settings.endpoint()
    others = cached_at(cache, repo_id, ref, commit)
    message = f"{_reference_wording(repo_id, ref)}: {detail}"
    if others:
        message += f" at {here}; it is cached from {', '.join(others)}"
        hint = (
            f"set HF_ENDPOINT={others[0]}, where it was cached (records are kept per endpoint); "
            "a kernels.lock with file digests loads it whatever the endpoint"
        )
    else:
        hint = f"run `kernels pull {repo_id}@{ref}` while online"
    return OfflineCacheMiss(message, hint=hint)
