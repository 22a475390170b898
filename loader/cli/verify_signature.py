"""`kernels verify-signature REPO_ID VERSION [--all-variants] [--filter-unsigned]
[--filter-no-digest]`: the reference's command, with its arguments and exit codes.

It installs version VERSION (the branch v<N>) of the kernel, the variant for this machine or
every variant, and checks each with kernels.verify.verify_variant: the Sigstore bundle over
metadata.json (offline, against KERNELS_SIGSTORE_TRUSTED_ROOT or the public-good root; signed by the
reference's signers, or by those the config names for the publisher), then every file against
the digest in those bytes. Exit 0 when every variant checked is correctly
signed, 1 otherwise; unsigned variants (--filter-unsigned) and variants without a digest
(--filter-no-digest) can be skipped rather than failed. Downloading needs no trust decision here:
nothing is imported, and no trust is recorded.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..safe_text import safe_text


def add_verify_signature_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="the kernel repo, org/repo")
    parser.add_argument("version", type=int, help="the kernel version to verify (branch v<N>)")
    parser.add_argument(
        "--all-variants",
        action="store_true",
        help="verify every build variant, not only the one for this machine",
    )
    parser.add_argument(
        "--filter-unsigned",
        action="store_true",
        help="skip variants without a signature (builds that predate signing)",
    )
    parser.add_argument(
        "--filter-no-digest",
        action="store_true",
        help="skip variants whose metadata has no digest (builds that predate digests)",
    )
    parser.add_argument(
        "--backend", help="select the variant for this backend (cpu or the detected one)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"repo_id", "version", "commit", "variants": [{"variant", '
        '"result", "ok", "skipped", "summary", "details"}]}',
    )


def _installed(spec, args) -> list:
    """The variant for this machine, or every variant, installed (trust is not asked: nothing
    is imported, and passing True records nothing)."""
    if args.all_variants:
        from .pull import _install_variants

        which = argparse.Namespace(all_variants=True, variant=None)
        return _install_variants(spec, which, True, None)
    from ..api import install_with_details

    return [install_with_details(spec, backend=args.backend, trust_remote_code=True)]


def _skipped(result, args) -> str | None:
    from ..verify import VerificationResult as R

    if args.filter_unsigned and isinstance(result, R.SignatureBundleMissing):
        return "--filter-unsigned"
    if args.filter_no_digest and isinstance(result, (R.MetadataMissing, R.DigestMissing)):
        return "--filter-no-digest"
    return None


def run_verify_signature(args: argparse.Namespace) -> int:
    from ..errors import InvalidSpec, SignatureError
    from ..spec import make_spec, validate_repo_id
    from ..verify import VerificationResult, details, summary, verify_variant

    try:
        spec = make_spec(validate_repo_id(args.repo_id), version=args.version)
    except InvalidSpec as exc:
        raise InvalidSpec(
            exc.message, hint="give the repo and the version number, e.g. `org/repo 1`"
        ) from None
    from ..signatures import signer_policies

    policies = signer_policies(spec.repo_id.split("/", 1)[0])
    rows = []
    commit = None
    for found in _installed(spec, args):
        commit = found.resolution.commit
        result = verify_variant(found.tree, policies)
        rows.append(
            {
                "variant": found.variant,
                "result": type(result).__name__,
                "ok": isinstance(result, VerificationResult.Success),
                "skipped": _skipped(result, args),
                "summary": summary(result),
                "details": details(result),
            }
        )
    failed = [r for r in rows if not r["ok"] and not r["skipped"]]
    where = f"{spec.repo_id}@{(commit or '')[:12]}"
    if args.json:
        out = {"repo_id": spec.repo_id, "version": args.version, "commit": commit, "variants": rows}
        print(json.dumps(out, sort_keys=True))
    else:
        for row in rows:
            verdict = "OK" if row["ok"] else "SKIPPED" if row["skipped"] else "FAILED"
            why = f" ({row['skipped']})" if row["skipped"] else ""
            print(
                f"{verdict} {safe_text(where)}/{safe_text(row['variant'])}: {row['summary']}{why}"
            )
            for line in row["details"]:  # the server's file names, sigstore's reasons: escaped
                print(f"  {safe_text(line)}")
    if failed:
        unsigned = {"SignatureBundleMissing", "MetadataMissing", "DigestMissing"}
        if all(r["result"] in unsigned for r in failed):
            hint = (
                "these builds carry no signature or digest (older builds predate signing): "
                "pass --filter-unsigned / --filter-no-digest to skip them"
            )
        else:
            hint = "do not use these builds; tell the kernel's publisher"
        raise SignatureError(
            f"{len(failed)} of {len(rows)} variants of {spec.repo_id} v{args.version} failed "
            "signature verification",
            hint=hint,
        )
    if not args.json:
        ok = sum(r["ok"] for r in rows)
        skipped = len(rows) - ok
        print(
            f"{ok} of {len(rows)} variants correctly signed"
            + (f", {skipped} skipped" if skipped else "")
        )
    return 0


def verify_signature(args: object) -> None:
    """The reference's `kernels.cli.verify_signature.verify_signature(args)` (`repo_id`,
    `version`, `all_variants`, `filter_unsigned`, `filter_no_digest`): SystemExit(1) where the
    command would exit 1."""
    from ..errors import KernelsError
    from .main import report_error

    namespace = argparse.Namespace(
        repo_id=args.repo_id,
        version=args.version,
        all_variants=bool(getattr(args, "all_variants", False)),
        filter_unsigned=bool(getattr(args, "filter_unsigned", False)),
        filter_no_digest=bool(getattr(args, "filter_no_digest", False)),
        backend=None,
        json=False,
    )
    try:
        code = run_verify_signature(namespace)
    except KernelsError as exc:
        code = report_error(exc)
    if code:
        sys.exit(code)
