"""Every error this package raises on purpose, in one place.

Each class carries a one-line `hint` that says what to do. Classes also derive from the builtin
exception that callers of the reference `kernels` API already catch (transformers, for example,
falls back to the original layer on `FileNotFoundError`), so this package is a drop-in.
"""

from __future__ import annotations


class KernelsError(Exception):
    """Base class. `str(err)` is the message followed by a line `hint: ...` when a hint is set."""

    hint: str = ""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\nhint: {self.hint}" if self.hint else self.message


class InvalidSpec(KernelsError, ValueError):
    """A kernel request string, repo id, revision or version is malformed."""

    hint = 'use "org/repo", "org/repo@<branch|tag|v<N>|40-hex commit>:Layer" or "/abs/path:Layer"'


class InvalidMetadata(KernelsError, ValueError):
    """A variant's metadata.json is missing, unreadable, or breaks the schema."""

    hint = (
        "the kernel repo is broken at this revision; pin an earlier revision or tell its publisher"
    )


class KernelNotFound(KernelsError, FileNotFoundError):
    """The repository does not exist on the Hub (or the mirror)."""

    hint = "check the repo id; for a private repo set HF_TOKEN; for a mirror check HF_ENDPOINT"


class RevisionNotFound(KernelsError, FileNotFoundError):
    """The repository exists but has no such branch, tag, commit or version."""

    hint = "run `kernels versions org/repo` to see the versions and branches it has"


class NoCompatibleVariant(KernelsError, FileNotFoundError):
    """No build variant of the kernel fits this machine; `trace` says why each was rejected."""

    hint = "run `kernels env` to see this machine; pick another version or backend"

    def __init__(self, message: str, *, trace: list | None = None, hint: str | None = None):
        self.trace = list(trace or [])
        lines = [message] + [f"  {entry}" for entry in self.trace]
        super().__init__("\n".join(lines), hint=hint)


class IntegrityError(KernelsError, RuntimeError):
    """Bytes do not match their recorded digest (a download, a cached file, or a lock)."""

    hint = "run `kernels verify --all`, then `kernels pull` to fetch clean copies"


class OfflineCacheMiss(KernelsError, FileNotFoundError):
    """Offline (or the Hub is unreachable) and the cache cannot answer the request."""

    hint = "run `kernels pull org/repo` on a connected machine (or unset HF_HUB_OFFLINE)"


class HubUnavailable(KernelsError, ConnectionError):
    """The Hub could not be reached and nothing cached can stand in."""

    hint = "check the network and HF_ENDPOINT, or work offline from the cache with HF_HUB_OFFLINE=1"


class UntrustedPublisher(KernelsError, ValueError):
    """Loading the kernel would run code from a publisher nobody decided to trust."""

    hint = (
        "pass trust_remote_code=True, or add the org to KERNELS_TRUSTED_PUBLISHERS "
        "or to trusted_publishers in the kernels config file"
    )


class LockfileError(KernelsError, ValueError):
    """A kernels.lock (or pyproject dependency table) is missing, malformed or out of date."""

    hint = "run `kernels lock` to write a fresh kernels.lock"


class CacheError(KernelsError, OSError):
    """The cache cannot be written or read (read-only, full disk, bad permissions)."""

    hint = "set KERNELS_CACHE to a writable folder, or free disk space"


class LayerError(KernelsError, ValueError):
    """A layer class breaks the layer contract or does not exist in the kernel."""

    hint = "layers must subclass nn.Module, define no __init__, and match the forward they replace"


class MissingDependency(KernelsError, ImportError):
    """The kernel needs a Python package that is not installed."""

    hint = "pip install the package named above, then load the kernel again"


class UnsafePermissions(KernelsError, PermissionError):
    """A cache, config or lock file that users other than you and root can write: what it says
    could be theirs, so it is not used (the rule ssh applies to keys; see docs/security.md)."""

    hint = "run `chmod -R go-w` on the path named above, or use a folder of your own"


class LockWaitTimeout(KernelsError, TimeoutError):
    """Another process held a cache lock past the deadline (KERNELS_LOCK_TIMEOUT)."""

    hint = "end the process named above if it is stuck, or raise KERNELS_LOCK_TIMEOUT (seconds)"


class UnsafeResponse(IntegrityError):
    """A server's answer breaks a safety bound (malformed commit id, paging loop or off-origin
    page, oversized or over-compressed body): the client stopped reading and used none of it."""

    hint = "check HF_ENDPOINT points at a Hub you trust; report the answer to its operator"


class SignatureError(IntegrityError):
    """The signature policy (KERNELS_SIGNATURE_POLICY, `[signatures]` in the config file)
    requires a valid Sigstore signature, and the kernel is unsigned, its signature does not
    verify, or its files do not match the signed digest. Nothing was imported."""

    hint = (
        "run `kernels verify-signature org/repo <version>` for details; set the policy of this "
        "publisher to warn or off only if you accept unsigned code from it"
    )


class DownloadTimeout(HubUnavailable):
    """A download ran past its overall deadline (the server sent too slowly, or stalled)."""

    hint = "retry on a better link, or raise the deadline with KERNELS_DOWNLOAD_TIMEOUT=<seconds>"


class InsufficientSpace(CacheError):
    """The files to download (or, for `kernels mirror build`, to copy) are larger than the free
    space of the disk they go to, or that disk filled up while they were being written. The
    message names the disk; the hint of a mirror build says which folder to move."""

    hint = "free disk space, or set KERNELS_CACHE to a folder on a larger disk"


class MirrorSourceError(KernelsError, ValueError):
    """`kernels mirror build` found an entry in SRC it will not copy: a symbolic link, something
    that is not a regular file or folder, a name with control characters, or a file only your
    rights can read in a place another user controls (docs/security.md)."""

    hint = "remove or replace the entry named above, or build from a folder only you can write"


# -- drop-in subclasses: the exception types the reference `kernels` API raises ----------------


class VersionNotFound(RevisionNotFound, ValueError):
    """`version=N` names a major version (branch v<N>) the repo does not have.

    A `RevisionNotFound` for this package's callers and a `ValueError` for code written against
    the reference, which raises `ValueError("Version N not found, available versions: ...")`.
    """

    hint = "pass one of the versions listed above, or run `kernels versions org/repo`"


class UnsupportedDependency(KernelsError, ValueError):
    """A kernel declares a Python dependency outside the supported-dependency allow-list."""

    hint = "the kernel's publisher must drop the dependency; only allow-listed packages may be used"


class LocalKernelsError(KernelsError, ValueError):
    """The LOCAL_KERNELS environment variable is malformed."""

    hint = "set LOCAL_KERNELS to org/repo=/path/to/kernel entries separated by ':'"


class KernelStatusError(KernelsError, ValueError):
    """A repo's kernel-status.toml cannot be parsed or names an unknown status kind."""

    hint = (
        "the kernel repo is broken at this revision; pin an earlier revision or tell its publisher"
    )
