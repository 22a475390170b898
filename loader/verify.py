"""`kernels.verify`: check a variant folder against the digest its metadata.json declares.

A kernel-builder build records, in metadata.json, `digest = {"algorithm": "sha256" | "sha512",
"files": {relpath: base64 digest}}` over every file of the variant except metadata.json itself,
its Sigstore bundle `metadata.json.sigstore`, `__pycache__` folders and `.pyc` files. A signature
over metadata.json therefore covers the whole variant once the digest holds.

`verify_digest` recomputes the digest and reports missing, unknown and changed files, with the
result types of the reference's `kernels.verify`. `verify_variant` first checks the Sigstore
bundle over metadata.json (sigstore-python, an optional dependency imported only here), offline,
against a trust root and a signer policy. Neither runs on the load path (docs/compatibility.md).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidMetadata
from .metadata import Metadata

BUNDLE = "metadata.json.sigstore"
ALGORITHMS = ("sha256", "sha512")


@dataclass(frozen=True)
class DigestViolation:
    """One difference between the declared digest and the folder.

    kind: "missing" (declared, not on disk), "unknown" (on disk, not declared), "mismatch",
    or "algorithm" (the declared algorithm is not sha256/sha512).
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


def _excluded(rel: str) -> bool:
    parts = rel.split("/")
    return rel in ("metadata.json", BUNDLE) or "__pycache__" in parts or rel.endswith(".pyc")


def hash_variant(variant_path: Path, algorithm: str) -> dict[str, str]:
    """{relpath: base64 digest} of every file the digest covers (symlinks followed, as the
    builder's walk does)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(variant_path, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(variant_path).as_posix()
            if _excluded(rel) or not full.is_file():
                continue
            h = hashlib.new(algorithm)
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[rel] = base64.b64encode(h.digest()).decode("ascii")
    return out


def verify_digest(variant_path: Path | str) -> Result:
    """Check the variant folder against its metadata.json digest (no signature involved)."""
    variant_path = Path(variant_path)
    try:
        metadata = Metadata.read(variant_path / "metadata.json")
    except InvalidMetadata as exc:
        if not (variant_path / "metadata.json").is_file():
            return VerificationResult.MetadataMissing()
        return VerificationResult.MetadataInvalid(exc.message)
    declared = metadata.raw.get("digest")
    if declared is None:
        return VerificationResult.DigestMissing()
    files = declared.get("files") if isinstance(declared, dict) else None
    algorithm = declared.get("algorithm") if isinstance(declared, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        return VerificationResult.MetadataInvalid("digest.files must map paths to strings")
    if algorithm not in ALGORITHMS:
        violation = DigestViolation("algorithm", "", expected=str(algorithm))
        return VerificationResult.DigestVerificationFailure([violation])
    actual = hash_variant(variant_path, algorithm)
    violations = [
        DigestViolation("missing", p)
        if p not in actual
        else DigestViolation("mismatch", p, expected=want, got=actual[p])
        for p, want in sorted(files.items())
        if actual.get(p) != want
    ]

    violations += [DigestViolation("unknown", p) for p in sorted(set(actual) - set(files))]
    if violations:
        return VerificationResult.DigestVerificationFailure(violations)
    return VerificationResult.Success()


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
TRUSTED_ROOT_ENV = "KERNELS_SIGSTORE_TRUSTED_ROOT"


def verify_variant(
    variant_path: Path | str,
    policies: Sequence[object] | None = None,
    *,
    trusted_root: Path | str | None = None,
) -> Result:
    """The reference's `verify_variant`: the Sigstore bundle `metadata.json.sigstore` over
    metadata.json's bytes, checked against the trust root and `policies` (any one must accept
    the signing certificate; default DEFAULT_POLICIES), then the variant against metadata.json's
    digest. Needs the optional `sigstore` package (`pip install 'kernels[sign]'`).

    The trust root is `trusted_root`, else the file named by KERNELS_SIGSTORE_TRUSTED_ROOT,
    else the public-good root that sigstore has on disk; it is never refreshed over the network
    here, so the check runs offline. Fails closed: any problem is a non-Success result.
    """
    variant_path = Path(variant_path)
    bundle_path = variant_path / BUNDLE
    if not bundle_path.is_file():
        return VerificationResult.SignatureBundleMissing()
    try:
        from sigstore.errors import VerificationError
        from sigstore.models import Bundle, InvalidBundle, TrustedRoot
        from sigstore.verify import Verifier, policy
    except ImportError:
        return VerificationResult.SignatureVerificationFailure(
            "the sigstore package is not installed: pip install 'kernels[sign]'"
        )
    try:
        bundle = Bundle.from_json(bundle_path.read_bytes())
    except (InvalidBundle, ValueError) as exc:
        return VerificationResult.SignatureBundleInvalid(str(exc))
    metadata_path = variant_path / "metadata.json"
    if not metadata_path.is_file():
        return VerificationResult.MetadataMissing()
    root = trusted_root or os.environ.get(TRUSTED_ROOT_ENV)
    try:
        if root:
            verifier = Verifier(trusted_root=TrustedRoot.from_file(str(root)))
        else:
            verifier = Verifier.production(offline=True)
    except Exception as exc:  # noqa: BLE001 - any unusable root is a failure to verify
        return VerificationResult.SignatureVerificationFailure(f"trust root: {exc}")
    # Verify the bytes before parsing them: a forged metadata.json never reaches the parser.
    try:
        verifier.verify_artifact(
            metadata_path.read_bytes(), bundle, policy.AnyOf(list(policies or DEFAULT_POLICIES))
        )
    except VerificationError as exc:
        return VerificationResult.SignatureVerificationFailure(str(exc))
    return verify_digest(variant_path)
