"""`kernels.verify`: check a variant folder against the digest its metadata.json declares, and
that metadata.json against its Sigstore signature.

A kernel-builder build records, in metadata.json, `digest = {"algorithm": "sha256" | "sha512",
"files": {relpath: base64 digest}}` over every file of the variant except metadata.json itself
and its Sigstore bundle `metadata.json.sigstore`. A signature over metadata.json therefore covers
the whole variant once the digest holds. `verify_digest` checks the digest, with the result types
of the reference's `kernels.verify`; `verify_variant` first checks the bundle (sigstore-python, an
optional dependency imported only here), offline, against a trust root and a signer policy.

What a Success means here (docs/security.md, "Signatures, verification and the terminal"):

- **Each file is read once.** metadata.json's bytes are read once; the signature is checked over
  those bytes and the digest is parsed from the same bytes. Every other file is hashed from the
  one read of it. A file swapped between two reads cannot pass.
- **Everything Python could import is covered.** A file the digest does not name is a violation,
  bytecode included: Python imports an unchecked-hash `.pyc` from `__pycache__` without looking
  at its source, so a `.pyc` or anything under `__pycache__` is an "unverified bytecode"
  violation (the reference skips them). Empty folders are ignored.
- **Nothing is followed.** The folder is entered once (a link naming the folder itself is the
  caller's choice and is followed); below it, a symbolic link (to a file or a folder) and any
  special file (FIFO, socket, device) is a violation and is never opened, so a link to `.` cannot
  make the walk loop and a FIFO cannot make it wait. On POSIX every entry is opened relative to
  its folder's descriptor with O_NOFOLLOW.
- **The walk is bounded**: MAX_ENTRIES entries, MAX_DEPTH nested folders, MAX_BYTES read.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidMetadata
from .metadata import MAX_METADATA_BYTES, Metadata

METADATA = "metadata.json"
BUNDLE = "metadata.json.sigstore"
ALGORITHMS = ("sha256", "sha512")
MAX_ENTRIES = 20_000  # files and folders; a variant from the Hub has at most 10,000 files
MAX_DEPTH = 32  # nested folders, as many as a cached path may have parts
MAX_BYTES = 64 << 30  # read in total
MAX_BUNDLE_BYTES = 1 << 20  # a Sigstore bundle is a few KiB
SIGSTORE_MISSING = "the sigstore package is not installed: pip install 'kernels[sign]'"


@dataclass(frozen=True)
class DigestViolation:
    """One difference between the declared digest and the folder.

    kind: "missing" (declared, not on disk), "unknown" (on disk, not declared), "mismatch",
    "algorithm" (the declared algorithm is not sha256/sha512), "bytecode" (a .pyc or a file under
    __pycache__: importable, never covered by a digest), "link" (a symbolic link: not followed),
    "special" (not a regular file or folder), "unreadable", or "limit" (a bound was reached).
    """

    kind: str
    path: str
    expected: str | None = None
    got: str | None = None

    def __str__(self) -> str:
        if self.kind == "mismatch":
            return f"File hash mismatch for {self.path}: expected: {self.expected}, got: {self.got}"
        if self.kind == "algorithm":
            return f"Unsupported digest algorithm: {self.expected!r}"
        if self.kind == "bytecode":
            return f"Unverified bytecode: {self.path} (not in the digest; Python may import it)"
        if self.kind == "link":
            return f"Symbolic link: {self.path} (not followed)"
        if self.kind == "special":
            return f"Not a regular file: {self.path}"
        if self.kind == "unreadable":
            return f"Cannot read: {self.path} ({self.expected})"
        if self.kind == "limit":
            return f"Not verified past {self.path}: {self.expected}"
        return f"{self.kind.capitalize()} file: {self.path}"


class VerificationResult:
    """The outcomes of a verification, as the reference names them."""

    @dataclass(frozen=True)
    class Success:
        pass

    @dataclass(frozen=True)
    class MetadataMissing:
        pass

    @dataclass(frozen=True)
    class MetadataInvalid:
        reason: str

    @dataclass(frozen=True)
    class DigestMissing:
        pass

    @dataclass(frozen=True)
    class DigestVerificationFailure:
        violations: list[DigestViolation]

    @dataclass(frozen=True)
    class SignatureBundleMissing:
        pass

    @dataclass(frozen=True)
    class SignatureBundleInvalid:
        reason: str

    @dataclass(frozen=True)
    class SignatureVerificationFailure:
        reason: str


Result = (
    VerificationResult.Success
    | VerificationResult.MetadataMissing
    | VerificationResult.MetadataInvalid
    | VerificationResult.DigestMissing
    | VerificationResult.DigestVerificationFailure
    | VerificationResult.SignatureBundleMissing
    | VerificationResult.SignatureBundleInvalid
    | VerificationResult.SignatureVerificationFailure
)


def summary(result: Result) -> str:
    """The outcome in the reference CLI's words (`kernels verify-signature`), one line."""
    R = VerificationResult
    if isinstance(result, R.Success):
        return "kernel metadata is correctly signed"
    if isinstance(result, R.SignatureBundleMissing):
        return "cannot verify kernel integrity, signature not found"
    if isinstance(result, R.SignatureBundleInvalid):
        return "cannot verify kernel integrity, invalid signature bundle"
    if isinstance(result, R.MetadataInvalid):
        return "cannot verify kernel integrity, invalid metadata"
    if isinstance(result, (R.MetadataMissing, R.DigestMissing)):
        return "cannot verify kernel integrity, metadata does not have a digest"
    if isinstance(result, R.DigestVerificationFailure):
        return "kernel integrity check failed"
    return "metadata signature verification failed"


def details(result: Result) -> list[str]:
    """What follows the summary: the reason, or one line per digest violation."""
    if isinstance(result, VerificationResult.DigestVerificationFailure):
        return [str(v) for v in result.violations]
    reason = getattr(result, "reason", None)
    return [line for line in str(reason).splitlines() if line.strip()] if reason else []


# -- reading a folder without following anything ------------------------------------------------

_FD_WALK = os.open in os.supports_dir_fd and os.scandir in os.supports_fd
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_COMMON = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
# O_NONBLOCK: opening a FIFO (swapped in after the listing) returns at once instead of waiting.
_FILE_FLAGS = _COMMON | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = _COMMON | _NOFOLLOW | getattr(os, "O_DIRECTORY", 0)
_LINK_ERRNOS = {errno.ELOOP, getattr(errno, "EMLINK", errno.ELOOP)}  # O_NOFOLLOW on a link


class _Refused(Exception):
    """Not a regular file (kind "link" or "special"): never read."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class _Limit(Exception):
    def __init__(self, path: str, why: str):
        super().__init__(why)
        self.path = path
        self.why = why


def _is_link(st: os.stat_result) -> bool:
    return stat.S_ISLNK(st.st_mode) or bool(getattr(st, "st_reparse_tag", 0))


class _Folder:
    """A folder entered once; its entries are opened relative to it, never through a link.
    POSIX: a descriptor (openat with O_NOFOLLOW); elsewhere a path, each entry lstat'ed first."""

    def __init__(self, handle: int | str):
        self.handle = handle

    @classmethod
    def open_root(cls, path: Path) -> _Folder:
        """The variant folder itself (a link naming it is followed: the caller chose it)."""
        if _FD_WALK:
            return cls(os.open(path, _COMMON | getattr(os, "O_DIRECTORY", 0)))
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
        return cls(str(path))

    def close(self) -> None:
        if isinstance(self.handle, int):
            os.close(self.handle)

    def entries(self) -> list[tuple[str, os.stat_result]]:
        with os.scandir(self.handle) as it:
            found = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        return sorted(found, key=lambda item: item[0])

    def _open(self, name: str, flags: int) -> int:
        if _FD_WALK:
            assert isinstance(self.handle, int)
            return os.open(name, flags, dir_fd=self.handle)
        path = os.path.join(str(self.handle), name)
        if _is_link(os.lstat(path)):  # no O_NOFOLLOW here: look first
            raise _Refused("link")
        return os.open(path, flags)

    def child(self, name: str) -> _Folder:
        """The sub-folder `name`; _Refused when it is (now) a link or not a folder."""
        try:
            if _FD_WALK:
                return _Folder(self._open(name, _DIR_FLAGS))
            path = os.path.join(str(self.handle), name)
            st = os.lstat(path)
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise _Refused("link") from None
            if exc.errno == errno.ENOTDIR:
                raise _Refused("special") from None
            raise
        if _is_link(st) or not stat.S_ISDIR(st.st_mode):
            raise _Refused("link" if _is_link(st) else "special")
        return _Folder(path)

    def open_file(self, name: str) -> int:
        """A descriptor of the regular file `name`; _Refused when it is a link or anything but
        a regular file; FileNotFoundError when it is not there."""
        try:
            fd = self._open(name, _FILE_FLAGS)
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise _Refused("link") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _Refused("special")
        return fd


class _TooLarge(Exception):
    pass


def _read_small(folder: _Folder, name: str, limit: int) -> bytes | None:
    """The bytes of the regular file `name` (None when absent), read once, at most `limit`."""
    try:
        fd = folder.open_file(name)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _TooLarge
    return data


@dataclass
class _Scan:
    files: dict[str, str] = field(default_factory=dict)  # relpath -> base64 digest
    problems: list[DigestViolation] = field(default_factory=list)
    entries: int = 0
    read: int = 0


def _is_bytecode(rel: str) -> bool:
    return rel.endswith(".pyc") or "__pycache__" in rel.split("/")[:-1]


def _hash_file(folder: _Folder, name: str, rel: str, algorithm: str, scan: _Scan) -> None:
    try:
        fd = folder.open_file(name)
    except _Refused as refused:
        scan.problems.append(DigestViolation(refused.kind, rel))
        return
    except FileNotFoundError:
        return  # gone since the listing: reported as missing if the digest names it
    h = hashlib.new(algorithm)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            scan.read += len(chunk)
            if scan.read > MAX_BYTES:
                raise _Limit(rel, f"more than {MAX_BYTES >> 30} GiB to read")
            h.update(chunk)
    scan.files[rel] = base64.b64encode(h.digest()).decode("ascii")


def _walk(folder: _Folder, prefix: str, algorithm: str, scan: _Scan) -> None:
    for name, st in folder.entries():
        rel = prefix + name
        if not prefix and name in (METADATA, BUNDLE):
            continue  # read on their own: the signed file and its signature
        scan.entries += 1
        if scan.entries > MAX_ENTRIES:
            raise _Limit(rel, f"more than {MAX_ENTRIES} files and folders")
        try:
            if _is_link(st):
                scan.problems.append(DigestViolation("link", rel))
            elif stat.S_ISDIR(st.st_mode):
                if rel.count("/") + 1 >= MAX_DEPTH:
                    raise _Limit(rel, f"folders nested more than {MAX_DEPTH} deep")
                child = folder.child(name)
                try:
                    _walk(child, rel + "/", algorithm, scan)
                finally:
                    child.close()
            elif not stat.S_ISREG(st.st_mode):
                scan.problems.append(DigestViolation("special", rel))
            elif _is_bytecode(rel):
                scan.problems.append(DigestViolation("bytecode", rel))
            else:
                _hash_file(folder, name, rel, algorithm, scan)
        except _Refused as refused:
            scan.problems.append(DigestViolation(refused.kind, rel))
        except OSError as exc:  # e.g. a file or folder this user may not read
            scan.problems.append(DigestViolation("unreadable", rel, expected=exc.strerror))


def _scan(root: _Folder, algorithm: str) -> _Scan:
    scan = _Scan()
    try:
        _walk(root, "", algorithm, scan)
    except _Limit as exc:
        scan.problems.append(DigestViolation("limit", exc.path, expected=exc.why))
    except OSError as exc:  # the folder itself cannot be listed
        scan.problems.append(DigestViolation("unreadable", ".", expected=exc.strerror))
    return scan


# -- the checks ---------------------------------------------------------------------------------


def _read_metadata(root: _Folder) -> bytes | Result:
    """metadata.json's bytes, read once; or MetadataMissing / MetadataInvalid."""
    try:
        data = _read_small(root, METADATA, MAX_METADATA_BYTES)
    except _Refused as refused:
        what = "a symbolic link" if refused.kind == "link" else "not a regular file"
        return VerificationResult.MetadataInvalid(f"Cannot parse metadata: {METADATA} is {what}")
    except _TooLarge:
        return VerificationResult.MetadataInvalid(
            f"Cannot parse metadata: larger than {MAX_METADATA_BYTES} bytes"
        )
    except OSError as exc:
        return VerificationResult.MetadataInvalid(f"Cannot parse metadata: {exc.strerror}")
    return VerificationResult.MetadataMissing() if data is None else data


def _check_digest(root: _Folder, data: bytes) -> Result:
    """The folder against the digest in `data` (metadata.json's bytes: never read again)."""
    try:
        metadata = Metadata.from_bytes(data, where=METADATA)
    except InvalidMetadata as exc:
        return VerificationResult.MetadataInvalid(f"Cannot parse metadata: {exc.message}")
    declared = metadata.raw.get("digest")
    if declared is None:
        return VerificationResult.DigestMissing()
    files = declared.get("files") if isinstance(declared, dict) else None
    algorithm = declared.get("algorithm") if isinstance(declared, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        return VerificationResult.MetadataInvalid(
            "Cannot parse metadata: digest.files must map paths to strings"
        )
    if algorithm not in ALGORITHMS:
        violation = DigestViolation("algorithm", "", expected=str(algorithm))
        return VerificationResult.DigestVerificationFailure([violation])
    scan = _scan(root, algorithm)
    # A link or a FIFO where a file was signed is reported as what it is; past a bound, files
    # not reached are unknown, not missing.
    elsewhere = {v.path for v in scan.problems}
    stopped = any(v.kind == "limit" for v in scan.problems)
    violations = [
        DigestViolation("mismatch", p, expected=want, got=scan.files[p])
        if p in scan.files
        else DigestViolation("missing", p)
        for p, want in sorted(files.items())
        if scan.files.get(p) != want and p not in elsewhere and (p in scan.files or not stopped)
    ]
    violations += [DigestViolation("unknown", p) for p in sorted(set(scan.files) - set(files))]
    violations += sorted(scan.problems, key=lambda v: (v.kind, v.path))
    if violations:
        return VerificationResult.DigestVerificationFailure(violations)
    return VerificationResult.Success()


def verify_digest(variant_path: Path | str) -> Result:
    """Check the variant folder against its metadata.json digest (no signature involved)."""
    try:
        root = _Folder.open_root(Path(variant_path))
    except OSError:
        return VerificationResult.MetadataMissing()
    try:
        data = _read_metadata(root)
        return data if not isinstance(data, bytes) else _check_digest(root, data)
    finally:
        root.close()


@dataclass(frozen=True)
class GitHubWorkflowPolicy:
    """Accept a signing certificate that Sigstore issued to a GitHub Actions workflow of `repo`
    ("org/name" on GitHub) running one of `signer_uris`
    (`https://github.com/<org>/<name>/.github/workflows/<file>@<ref>`)."""

    repo: str
    signer_uris: tuple[str, ...]

    def verify(self, cert: object) -> None:
        """Raise sigstore's VerificationError unless the certificate's claims match."""
        from sigstore.verify import policy

        policy.AllOf(
            [
                policy.OIDCIssuer(GITHUB_ACTIONS_ISSUER),
                policy.OIDCIssuerV2(GITHUB_ACTIONS_ISSUER),
                policy.OIDCSourceRepositoryURI(f"https://github.com/{self.repo}"),
                policy.AnyOf([policy.OIDCBuildSignerURI(uri) for uri in self.signer_uris]),
            ]
        ).verify(cert)


GITHUB_ACTIONS_ISSUER = "https://token.actions.githubusercontent.com"
_COMMUNITY = "https://github.com/huggingface/kernels-community/.github/workflows"
# The reference's default: builds signed by kernels-community's CI workflows.
DEFAULT_POLICIES: tuple[GitHubWorkflowPolicy, ...] = (
    GitHubWorkflowPolicy(
        "huggingface/kernels-community",
        tuple(
            f"{_COMMUNITY}/{name}.yaml@refs/heads/main"
            for name in ("build", "build-mac", "build-windows", "sign-old-builds")
        ),
    ),
)


def verify_variant(
    variant_path: Path | str,
    policies: Sequence[object] | None = None,
    *,
    trusted_root: Path | str | None = None,
) -> Result:
    """The reference's `verify_variant`: the Sigstore bundle `metadata.json.sigstore` over
    metadata.json's bytes, checked against the trust root and `policies` (any one must accept
    the signing certificate; default DEFAULT_POLICIES), then the variant against the digest
    parsed from those same bytes. Needs the optional `sigstore` package
    (`pip install 'kernels[sign]'`).

    The trust root is `trusted_root`, else the file named by KERNELS_SIGSTORE_TRUSTED_ROOT,
    else the public-good root that sigstore has on disk; it is never refreshed over the network
    here, so the check runs offline. Fails closed: any problem is a non-Success result, except
    a trust root file that another user could write (it, or a folder above it), which raises
    UnsafePermissions as the config file does.
    """
    try:
        root = _Folder.open_root(Path(variant_path))
    except OSError:
        return VerificationResult.SignatureBundleMissing()
    try:
        return _verify_open(root, policies, trusted_root)
    finally:
        root.close()


def _verify_open(root: _Folder, policies, trusted_root) -> Result:
    try:
        bundle_bytes = _read_small(root, BUNDLE, MAX_BUNDLE_BYTES)
    except _Refused:
        return VerificationResult.SignatureBundleInvalid(f"{BUNDLE} is not a regular file")
    except _TooLarge:
        return VerificationResult.SignatureBundleInvalid(f"larger than {MAX_BUNDLE_BYTES} bytes")
    except OSError as exc:
        return VerificationResult.SignatureBundleInvalid(f"cannot read it ({exc.strerror})")
    if bundle_bytes is None:
        return VerificationResult.SignatureBundleMissing()
    try:
        from sigstore.errors import VerificationError
        from sigstore.models import Bundle, InvalidBundle, TrustedRoot
        from sigstore.verify import Verifier, policy
    except ImportError:
        return VerificationResult.SignatureVerificationFailure(SIGSTORE_MISSING)
    try:
        bundle = Bundle.from_json(bundle_bytes)
    except (InvalidBundle, ValueError) as exc:
        return VerificationResult.SignatureBundleInvalid(str(exc))
    data = _read_metadata(root)
    if not isinstance(data, bytes):
        return data
    from . import settings

    where = trusted_root or settings.sigstore_trusted_root()
    if where:
        # The root decides whose signatures count: one that another user can rewrite lets
        # their own Sigstore sign "for" anyone, so it is held to the config file's rule.
        from .exposure import refuse_exposed

        refuse_exposed(Path(where), "the Sigstore trust root (it decides whose signatures count)")
    try:
        if where:
            verifier = Verifier(trusted_root=TrustedRoot.from_file(str(where)))
        else:
            verifier = Verifier.production(offline=True)
    except Exception as exc:  # noqa: BLE001 - any unusable root is a failure to verify
        return VerificationResult.SignatureVerificationFailure(f"trust root: {exc}")
    # Verify the bytes before parsing them: a forged metadata.json never reaches the parser.
    # The digest is then read from these very bytes, never from a second read of the file.
    try:
        verifier.verify_artifact(data, bundle, policy.AnyOf(list(policies or DEFAULT_POLICIES)))
    except VerificationError as exc:
        return VerificationResult.SignatureVerificationFailure(str(exc))
    return _check_digest(root, data)
