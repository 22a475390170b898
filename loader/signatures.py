"""The signature policy at load time: "off", "warn" or "require" (settings.signature_policy).

Before a kernel loaded from an endpoint is imported (importer.import_tree), its verified tree is
checked with verify.verify_variant: the Sigstore bundle over metadata.json, then every file
against the digest parsed from those same bytes, each file read once, links and bytecode
refused. The verdict is recorded in the cache per endpoint (`v1/signatures/<tree>-<key>.json`,
a bucket the cache's permission check covers), where `key` names the signers and the trust root
it was checked against; a warm load reads that one record and does no crypto and no request.
`warn` logs the problem once per tree per process and imports; `require` raises SignatureError
and imports nothing. A missing sigstore package is never recorded (installing it changes the
answer).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

from kernels.cache import Cache, VerdictRecord

from . import settings
from .errors import InvalidSpec, SignatureError
from .notices import notice_once

SIGNED = "signed"
_WORKFLOW = re.compile(r"^https://github\.com/([^/]+/[^/]+)/\.github/workflows/[^@\s]+@\S+\Z")


def signer_policies(publisher: str) -> list:
    """Who may sign `publisher`'s kernels: the config's `[signatures.signers]` entry for it,
    else the reference's default signers (kernels-community's CI)."""
    return _policies(publisher)[0]


def _policies(publisher: str) -> tuple[list, list[str]]:
    """The sigstore policies for `publisher`'s kernels and what they accept (for the key)."""
    from .verify import DEFAULT_POLICIES, GitHubWorkflowPolicy

    uris = settings.signature_signers(publisher)
    if not uris:
        return list(DEFAULT_POLICIES), ["default"]
    by_repo: dict[str, list[str]] = {}
    for uri in uris:
        match = _WORKFLOW.match(uri)
        if match is None:
            raise InvalidSpec(
                f"{settings.config_path()} [signatures.signers] {publisher}: {uri!r} is not a "
                "GitHub workflow URI",
                hint="use https://github.com/<org>/<repo>/.github/workflows/<file>@<ref>",
            )
        by_repo.setdefault(match[1], []).append(uri)
    return [GitHubWorkflowPolicy(r, tuple(u)) for r, u in sorted(by_repo.items())], sorted(uris)


def _root_identity() -> tuple[Path | None, str]:
    """The trust root in use and a name for it that changes when the file does, or when its
    owner or mode does. A verdict is only recorded after a check that found the root safe
    (verify_variant refuses one others can write), so a warm load needs this one stat; the
    owner and mode in the name also set aside verdicts recorded before roots were checked."""
    root = settings.sigstore_trusted_root()
    if root is None:
        return None, "public-good"
    try:
        st = os.stat(root)
    except OSError:
        return root, f"{root}:missing"
    return root, f"{root}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_uid}:{st.st_mode:o}"


def _check(tree: Path, policies: list, root: Path | None) -> tuple[str, str, bool]:
    """(verdict, one-line detail, whether to record it) of verifying `tree` now."""
    from .verify import SIGSTORE_MISSING, VerificationResult, details, summary, verify_variant

    result = verify_variant(tree, policies, trusted_root=root)
    if isinstance(result, VerificationResult.Success):
        return SIGNED, summary(result), True
    if isinstance(result, VerificationResult.SignatureBundleMissing):
        verdict = "unsigned"
    elif isinstance(result, (VerificationResult.MetadataMissing, VerificationResult.DigestMissing)):
        verdict = "no-digest"
    else:
        verdict = "invalid"
    more = details(result)
    detail = summary(result) + (f": {more[0]}" if more else "")
    if len(more) > 1:
        detail += f" (and {len(more) - 1} more)"
    missing = getattr(result, "reason", None) == SIGSTORE_MISSING
    return ("unavailable" if missing else verdict), detail, not missing


def enforce(tree: Path, digest: str, repo_id: str, mode: str) -> None:
    """Apply `mode` ("warn" or "require") to the tree `digest` of `repo_id` before its import:
    SignatureError unless it is correctly signed (require), a notice once (warn)."""
    publisher = repo_id.split("/", 1)[0]
    policies, accepted = _policies(publisher)
    root, root_name = _root_identity()
    key = hashlib.sha256(json.dumps([accepted, root_name]).encode()).hexdigest()[:16]
    store = Cache(settings.cache_root(), endpoint=settings.endpoint()).signatures
    record = store.get(digest, key)
    if record is None:
        verdict, detail, keep = _check(tree, policies, root)
        if keep:
            try:
                store.put(VerdictRecord(digest, key, verdict, detail, time.time()))
            except OSError:
                pass  # a read-only cache: the next process checks again
    else:
        verdict, detail = record.verdict, record.detail
    if verdict == SIGNED:
        return
    if mode == "require":
        hint = SignatureError.hint
        if verdict == "unavailable":
            hint = "pip install 'kernels[sign]' (sigstore) to check signatures"
        elif verdict in ("unsigned", "no-digest"):
            hint = (
                f"the publisher does not sign this build; to load it anyway set "
                f"KERNELS_SIGNATURE_POLICY={publisher}=warn (or [signatures.publishers] in the "
                "config file)"
            )
        raise SignatureError(
            f"{repo_id}: {detail}; the signature policy requires a valid signature, so nothing "
            "was imported",
            hint=hint,
        )
    notice_once(f"signature:{digest}", f"kernels: {repo_id}: {detail} (signature policy: warn)")
