"""Publisher trust: loading a kernel runs its code, so somebody must have decided to trust it.

A publisher (the org of `org/name`) is trusted by `trust_remote_code=True` (or a list naming the
repo or org), by the user's allowlist (KERNELS_TRUSTED_PUBLISHERS, `trusted_publishers` in the
config file), or by the Hub's trusted-publisher flag. The Hub's answer is recorded in the cache,
so offline loads keep the same decision instead of skipping the check. That record names the
endpoint that answered (a mirror's answer is not the Hub's) and lives in a cache that only this
user and root can write (guard.open_cache refuses any other), so a cache writer cannot forge it.

`trust_remote_code=True` covers the repo it is passed with, not the kernels that repo declares
as dependencies: each dependency needs its own decision (a list naming it, the allowlist, or
the Hub's flag), so a trusted kernel cannot pull in an untrusted org's code. The same holds for
the destination of a kernel-status.toml redirect: whoever can commit to the named repo chooses it.
"""

from __future__ import annotations

import time

from kernels.cache import Cache, TrustRecord

from . import settings
from .errors import HubUnavailable, UntrustedPublisher

TrustArg = bool | list[str] | tuple[str, ...] | None


def dependency_trust(trust_remote_code: TrustArg) -> TrustArg:
    """What a kernel's `trust_remote_code` says about its dependencies: a list names repos and
    orgs, so it applies to them as well; `True` names only the repo it was passed with."""
    return trust_remote_code if isinstance(trust_remote_code, (list, tuple)) else False


def redirect_trust(trust_remote_code: TrustArg) -> TrustArg:
    """What `trust_remote_code` says about a redirect's destination: what it says about a
    dependency (a list applies to the repos and orgs it names; `True` to the named repo only)."""
    return dependency_trust(trust_remote_code)


def untrusted_redirect(
    exc: UntrustedPublisher, source: str, destination: str
) -> UntrustedPublisher:
    """`exc` (the destination's refusal) with a hint naming the redirect; the innermost redirect
    of a chain names it, an outer one leaves it as it is."""
    if getattr(exc, "redirect", None) is not None:
        return exc
    org = destination.split("/", 1)[0]
    err = UntrustedPublisher(
        f"{exc.message} ('{source}' redirects to it)",
        hint=f"'{source}' redirects to '{destination}', which trust_remote_code=True does not "
        f"cover: name '{destination}' in a trust_remote_code list, or add '{org}' to "
        "KERNELS_TRUSTED_PUBLISHERS",
    )
    err.redirect = (source, destination)
    return err


def explicitly_trusted(repo_id: str, trust_remote_code: TrustArg) -> bool:
    """True when the caller or the user's settings trust this repo without asking the Hub."""
    publisher = repo_id.split("/", 1)[0]
    if trust_remote_code is True:
        return True
    if isinstance(trust_remote_code, (list, tuple)) and (
        repo_id in trust_remote_code or publisher in trust_remote_code
    ):
        return True
    allow = settings.trusted_publishers()
    return publisher in allow or repo_id in allow


def ensure_trusted(
    cache: Cache, repo_id: str, trust_remote_code: TrustArg, *, offline: bool
) -> str:
    """Return how the repo is trusted ("explicit", "recorded", "hub"); raise UntrustedPublisher."""
    if explicitly_trusted(repo_id, trust_remote_code):
        return "explicit"
    publisher = repo_id.split("/", 1)[0]
    record = cache.records.get_trust(publisher)
    if record is not None and record.trusted:
        return "recorded"
    if offline:
        raise UntrustedPublisher(
            f"{_not_trusted(repo_id)}: publisher {publisher!r} is not known to be trusted at "
            f"{settings.endpoint()}, and it cannot be asked (offline)"
            + ("; it said not trusted when last asked" if record else "")
        )
    from . import hub  # asking the Hub: never on a warm load

    try:
        trusted = hub.publisher_trusted(publisher)
    except HubUnavailable:
        raise  # a network failure is reported as one, never as a trust decision
    try:
        cache.ensure()
        cache.records.put_trust(TrustRecord(publisher, trusted, "hub", time.time()))
    except OSError:
        pass
    if not trusted:
        raise UntrustedPublisher(
            f"{_not_trusted(repo_id)}: {publisher!r} is not a trusted kernel publisher at "
            f"{settings.endpoint()}"
        )
    return "hub"


def _not_trusted(repo_id: str) -> str:
    # The reference's words: its tests and users match "not from a trusted publisher".
    return f"Kernel repository '{repo_id}' is not from a trusted publisher"
