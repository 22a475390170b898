"""Errors that are both this package's typed errors and huggingface_hub's HTTP errors.

The reference `kernels` lets huggingface_hub's `RepositoryNotFoundError` and
`RevisionNotFoundError` (both `HfHubHTTPError`) reach its callers, and code written against it
catches those. This package raises `KernelNotFound` / `RevisionNotFound` with a hint; where the
Hub answered, the raised object is also the huggingface_hub error, carrying the Hub's response,
so either `except` clause catches it. This module imports huggingface_hub, so only the modules
that talk to a Hub import it (hub.py); `kernels.errors` stays import-light.
"""

from __future__ import annotations

from huggingface_hub import errors as hf

from .errors import KernelNotFound, KernelsError, RevisionNotFound


def _adopt_response(err: hf.HfHubHTTPError, cause: BaseException) -> None:
    # HfHubHTTPError.__init__ cannot run here (the MRO reaches OSError's before it), so copy
    # the attributes it would set from the error the client raised.
    err.response = getattr(cause, "response", None)
    try:
        request = cause.request  # httpx's property raises when no request was recorded
    except (AttributeError, RuntimeError):
        request = None
    if request is not None:
        err.request = request
    err.request_id = getattr(cause, "request_id", None)
    err.server_message = getattr(cause, "server_message", None)


class HubRepositoryNotFound(KernelNotFound, hf.RepositoryNotFoundError):
    """KernelNotFound that is also huggingface_hub's RepositoryNotFoundError."""

    def __init__(self, message: str, *, cause: BaseException, hint: str | None = None):
        KernelsError.__init__(self, message, hint=hint)
        _adopt_response(self, cause)

    __str__ = KernelsError.__str__


class HubRevisionNotFound(RevisionNotFound, hf.RevisionNotFoundError):
    """RevisionNotFound that is also huggingface_hub's RevisionNotFoundError."""

    def __init__(self, message: str, *, cause: BaseException, hint: str | None = None):
        KernelsError.__init__(self, message, hint=hint)
        _adopt_response(self, cause)

    __str__ = KernelsError.__str__


def repository_not_found(message: str, cause: BaseException) -> KernelNotFound:
    """The error for a repo the Hub says does not exist (or is not accessible)."""
    if isinstance(cause, hf.HfHubHTTPError):
        return HubRepositoryNotFound(message, cause=cause)
    return KernelNotFound(message)


def revision_not_found(
    message: str, cause: BaseException, hint: str | None = None
) -> RevisionNotFound:
    """The error for a branch, tag or commit the repo does not have."""
    while cause is not None and not isinstance(cause, hf.HfHubHTTPError):
        cause = cause.__cause__  # our RevisionNotFound raised `from` the client's error
    if cause is not None:
        return HubRevisionNotFound(message, cause=cause, hint=hint)
    return RevisionNotFound(message, hint=hint)
