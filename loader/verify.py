"""`kernels.verify`: check a variant folder against the digest its metadata.json declares.

A kernel-builder build records, in metadata.json, `digest = {"algorithm": "sha256" | "sha512",
"files": {relpath: base64 digest}}` over every file of the variant except metadata.json itself,
its Sigstore bundle `metadata.json.sigstore`, `__pycache__` folders and `.pyc` files. A signature
over metadata.json therefore covers the whole variant once the digest holds.

`verify_digest` recomputes the digest and reports missing, unknown and changed files, with the
result types of the reference's `kernels.verify`. `verify_variant` adds the signature step; this
package does not verify Sigstore signatures yet (docs/compatibility.md says what stands in the
way), so a variant is never reported as signature-verified: it fails closed.
"""

from __future__ import annotations

import base64
import hashlib
import os
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
    class SignatureVerificationFailure:
        reason: str


Result = (
    VerificationResult.Success
    | VerificationResult.MetadataMissing
    | VerificationResult.MetadataInvalid
    | VerificationResult.DigestMissing
    | VerificationResult.DigestVerificationFailure
    | VerificationResult.SignatureBundleMissing
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


def verify_variant(variant_path: Path | str, policies: object = None) -> Result:
    """The reference's `verify_variant`: the Sigstore bundle on metadata.json, then the digest.

    Fails closed: without a bundle, SignatureBundleMissing; with one,
    SignatureVerificationFailure, because this package does not verify Sigstore signatures yet.
    Use `verify_digest` for the digest alone.
    """
    variant_path = Path(variant_path)
    if not (variant_path / BUNDLE).is_file():
        return VerificationResult.SignatureBundleMissing()
    return VerificationResult.SignatureVerificationFailure(
        "Sigstore signature verification is not implemented in this package "
        "(see docs/compatibility.md); the digest alone is checked by verify_digest()"
    )
