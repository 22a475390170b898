"""`kernels info`, `kernels versions`, `kernels env`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..safe_text import safe_text
from .common import add_backend_arguments, human_size, plural


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kernel", help="org/repo[@rev] or a local kernel folder")
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"repo_id", "ref", "commit"} or {"path"}, "variants": [{"variant", '
        '"compatible", "preferred", "reason", "files_checked"}], "metadata"',
    )
    add_backend_arguments(parser)


def _probe(trace: list, trees: dict, system) -> tuple[list, list[str]]:
    """The trace after the checks that need a variant's files (metadata, the native libraries'
    ELF headers), run on every accepted variant whose files are here, as `get_kernel` runs
    them; plus the accepted variants whose files are not here and so were not probed."""
    from ..metadata import Metadata
    from ..select import check_metadata, check_native, reject
    from ..variants import VariantAccepted

    unprobed = []
    for entry in list(trace):
        if not isinstance(entry, VariantAccepted):
            continue
        tree = trees.get(entry.variant)
        if tree is None:
            unprobed.append(entry.variant)
            continue
        try:
            metadata = Metadata.read(tree / "metadata.json")
            reason = check_metadata(metadata, system, check_arch=True) or check_native(tree)
        except Exception as exc:  # a broken variant is a rejection, not a crash of `info`
            reason = getattr(exc, "message", str(exc)).splitlines()[0]
        if reason:
            trace = reject(trace, entry.variant, reason)
    return trace, unprobed


def _entry_json(entry, unprobed: list[str]) -> dict:
    from ..variants import VariantAccepted

    accepted = isinstance(entry, VariantAccepted)
    return {
        "variant": entry.variant,
        "compatible": accepted,
        "preferred": accepted and entry.preferred,
        "reason": None if accepted else entry.reason,
        "files_checked": entry.variant not in unprobed,
    }


def _local_info(path: Path, backend) -> dict:
    from ..api import _local_variant_dirs, _system
    from ..metadata import Metadata
    from ..variants import select_variants

    system = _system(backend)
    variants, _single = _local_variant_dirs(path.resolve())
    trace, unprobed = _probe(select_variants(variants, system), variants, system)
    first = next(iter(variants.values()), None)
    meta = Metadata.read(first / "metadata.json") if first else None
    return {
        "source": str(path),
        "where": {"path": str(path.resolve())},
        "metadata": meta,
        "metadata_variant": first.name if first else None,
        "trace": trace,
        "unprobed": unprobed,
    }


def _backend_text(meta, variant: str | None) -> str:
    """The backend a variant runs on: metadata.json's, except for a torch-universal build, which
    runs on any (its metadata names one only because the Hub's schema asks for one)."""
    from ..variants import parse_variant

    parsed = parse_variant(variant) if variant else None
    if parsed is not None and parsed.kind == "universal":
        return f"any (torch-universal; metadata.json says {meta.backend_type})"
    return meta.backend_type


def _hub_info(text: str, backend) -> dict:
    from .. import settings
    from ..api import _cache, _system
    from ..fetch import get_listing
    from ..resolve import resolve
    from ..variants import select_variants
    from .common import spec_with_default_ref

    spec = spec_with_default_ref(text)
    cache = _cache()
    offline = settings.offline()
    system = _system(backend)
    resolution = resolve(cache, spec, offline=offline, ttl=settings.resolve_ttl())
    listing = get_listing(cache, spec.repo_id, resolution.commit, offline=offline)
    trees = {}
    for name in listing.variants:
        installed = cache.installed(spec.repo_id, resolution.commit, name)
        if installed is not None:
            trees[name] = installed[1]
    trace, unprobed = _probe(select_variants(listing.variants, system), trees, system)
    return {
        "source": f"{spec.repo_id}@{spec.ref} = {resolution.commit}",
        "where": {"repo_id": spec.repo_id, "ref": spec.ref, "commit": resolution.commit},
        "metadata": None,
        "trace": trace,
        "unprobed": unprobed,
        "listing": listing,
    }


def run_info(args: argparse.Namespace) -> int:
    path = Path(args.kernel)
    if path.exists():
        info = _local_info(path, args.backend)
    else:
        info = _hub_info(args.kernel, args.backend)
    meta = info["metadata"]
    listing = info.get("listing")
    unprobed = info["unprobed"]
    if args.json:
        variants = []
        for entry in info["trace"]:
            row = _entry_json(entry, unprobed)
            if listing is not None and entry.variant in listing.variants:
                files = listing.variants[entry.variant]
                row.update(files=len(files), bytes=sum(f.size for f in files))
            variants.append(row)
        out = {**info["where"], "variants": variants}
        if meta is not None:
            out["metadata"] = meta.raw
        print(json.dumps(out, sort_keys=True))
        return 0
    # Names, metadata and reasons are the publisher's or the server's words: escaped.
    print(safe_text(info["source"]))
    if meta is not None:
        print(
            safe_text(
                f"  name {meta.name}, version {meta.version}, license {meta.license}, "
                f"backend {_backend_text(meta, info.get('metadata_variant'))}"
            )
        )
        if meta.python_depends:
            print(safe_text(f"  python depends: {', '.join(meta.python_depends)}"))
    native = _native_variants(listing)
    for entry in info["trace"]:
        extra = ""
        if listing is not None and entry.variant in listing.variants:
            files = listing.variants[entry.variant]
            extra = f"  [{plural(len(files), 'file')}, {human_size(sum(f.size for f in files))}]"
        if entry.variant in unprobed and entry.variant in native:
            extra += "  (native libraries not probed: `kernels pull` checks them)"
        print(f"  {safe_text(entry)}{extra}")
    return 0


def _native_variants(listing) -> set[str]:
    """Variants of a Hub listing that ship native libraries (.so, .pyd, .dylib)."""
    from ..select import NATIVE_SUFFIXES

    if listing is None:
        return set()
    return {
        name
        for name, files in listing.variants.items()
        if any(f.path.endswith(NATIVE_SUFFIXES) for f in files)
    }


def _repo_id_arg(text: str) -> str:
    """A bare `org/repo` argument, validated with a hint in CLI terms."""
    from ..errors import InvalidSpec
    from ..spec import parse_spec, validate_repo_id

    try:
        parse_spec(text, require_ref=False)  # a pasted URL gets its own hint here
        return validate_repo_id(text)
    except InvalidSpec as exc:
        if exc.hint != InvalidSpec.hint:
            raise
        raise InvalidSpec(
            exc.message, hint="give the repo alone, e.g. org/repo: this lists its versions"
        ) from None


def add_versions_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo", help="org/repo")
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"repo_id", "source", "versions": [{"version", "commit", '
        '"variant", "trace"} or {"version", "commit", "error"}]}',
    )
    add_backend_arguments(parser)


def run_versions(args: argparse.Namespace) -> int:
    from .. import settings
    from ..api import _cache, _system
    from ..errors import HubUnavailable
    from ..fetch import get_listing
    from ..resolve import available_versions
    from ..spec import parse_version_branch
    from ..variants import VariantAccepted, select_variants

    repo_id = _repo_id_arg(args.repo)
    cache = _cache()
    offline = settings.offline()
    versions = None
    if not offline:
        try:
            versions = available_versions(repo_id)
            source = settings.endpoint()
        except HubUnavailable as exc:
            # Like a load, an unreachable Hub falls back to what this machine knows.
            print(
                f"warning: {safe_text(exc.message)}; listing what the cache knows", file=sys.stderr
            )
            offline = True
    if versions is None:
        # What this machine has resolved before.
        versions = {}
        for record in cache.records.revisions(repo_id):
            number = parse_version_branch(record.revision)
            if number is not None:
                versions[number] = record.commit
        source = "cache (offline)" if settings.offline() else "cache (the Hub is unreachable)"
    system = _system(args.backend)
    rows = []
    for number, commit in sorted(versions.items()):
        try:
            listing = get_listing(cache, repo_id, commit, offline=offline)
            trace = select_variants(listing.variants, system)
        except Exception as exc:  # one broken version must not hide the others
            trace = []
            rows.append(
                {"version": number, "commit": commit, "error": getattr(exc, "message", str(exc))}
            )
            continue
        best = next((e.variant for e in trace if isinstance(e, VariantAccepted)), None)
        rows.append(
            {"version": number, "commit": commit, "variant": best, "trace": [str(e) for e in trace]}
        )
    if not rows and source != settings.endpoint():
        _nothing_known(repo_id)
    if args.json:
        print(json.dumps({"repo_id": repo_id, "source": source, "versions": rows}, sort_keys=True))
        return 0
    if not rows:
        print(safe_text(f"{repo_id}: no v<N> version branches ({source})"))
        return 0
    if source != settings.endpoint():
        source = "from this machine's cache: " + source[len("cache (") : -1]
    print(safe_text(f"{repo_id} ({source})"))
    for row in rows:
        if "error" in row:
            print(safe_text(f"  v{row['version']}  {row['commit'][:12]}  error: {row['error']}"))
            continue
        fit = row["variant"] or "no compatible variant here"
        print(safe_text(f"  v{row['version']}  {row['commit'][:12]}  -> {fit}"))
    return 0


def _nothing_known(repo_id: str) -> None:
    """`versions` could not ask the Hub and the cache knows no version: an error, not an empty
    answer."""
    from .. import settings
    from ..errors import HubUnavailable, OfflineCacheMiss

    never = "and this machine has resolved no version of it"
    if settings.offline():
        raise OfflineCacheMiss(
            f"{repo_id}: offline, {never}",
            hint=f"run `kernels versions {repo_id}` with the network (unset HF_HUB_OFFLINE)",
        )
    raise HubUnavailable(
        f"{repo_id}: the Hub at {settings.endpoint()} cannot be reached, {never}",
        hint="check the network and HF_ENDPOINT",
    )


def add_env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", help="describe selection for this backend")


def run_env(args: argparse.Namespace) -> int:
    import platform

    from .. import settings
    from .._version import __version__
    from ..api import _cache, _system
    from ..errors import KernelsError
    from ..variants import VariantAccepted, select_variants

    system = _system(args.backend)
    try:
        cache, cache_error = _cache(), None
    except KernelsError as exc:  # reported below, with everything else env knows
        cache, cache_error = None, f"{exc.message} ({exc.hint})" if exc.hint else exc.message
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    try:
        from importlib.metadata import version

        hub_version = version("huggingface_hub")
    except Exception:
        hub_version = None
    selections = []
    for repo in cache.records.repos() if cache is not None else []:
        for record in cache.records.revisions(repo):
            listing = cache.index.get_listing(repo, record.commit)
            if listing is None:
                continue
            trace = select_variants(listing.get("variants", {}), system)
            best = next((e.variant for e in trace if isinstance(e, VariantAccepted)), None)
            selections.append(
                {"repo_id": repo, "ref": record.revision, "commit": record.commit, "variant": best}
            )
    env = {
        "kernels": __version__,
        "python": platform.python_version(),
        "torch": torch_version,
        "huggingface_hub": hub_version,
        "system": system.describe(),
        "backend": system.backend,
        "cxx11_abi": system.cxx11_abi,
        "gpu_archs": list(system.gpu_archs),
        "cache": str(settings.cache_root()),
        "cache_writable": cache is not None and cache.writable,
        "cache_error": cache_error,
        "endpoint": settings.endpoint(),
        "offline": settings.offline(),
        "resolve_ttl_s": settings.resolve_ttl(),
        "config": str(settings.config_path()),
        "trusted_publishers": sorted(settings.trusted_publishers()),
        "cached_kernels": selections,
        "cached_other_endpoints": _cached_elsewhere(cache),
    }
    if args.json:
        print(json.dumps(env, sort_keys=True))
        return 0
    elsewhere = env.pop("cached_other_endpoints")
    for key, value in env.items():
        if key == "cache_error":
            if value is not None:
                print(safe_text(f"cache_error: {value}"))
        elif key == "cached_kernels":
            print("cached kernels (variant this machine would select):")
            for s in value:
                print(
                    safe_text(
                        f"  {s['repo_id']}@{s['ref']} ({s['commit'][:12]}) -> "
                        f"{s['variant'] or 'none compatible'}"
                    )
                )
            if not value:
                print("  none at this endpoint" if elsewhere else "  none")
        else:
            print(f"{key}: {safe_text(value)}")
    if elsewhere:
        # `kernels ls` lists these too: say why a load at this endpoint does not use them.
        print(
            "cached from other endpoints (used here by a kernels.lock with digests, "
            "or with HF_ENDPOINT set to theirs):"
        )
        for row in elsewhere:
            print(
                safe_text(
                    f"  {row['repo_id']}@{row['commit'][:12]} ({', '.join(row['variants'])}) "
                    f"from {', '.join(row['endpoints'])}"
                )
            )
    return 0


def _cached_elsewhere(cache) -> list[dict]:
    """Commits installed in this cache only from endpoints other than the current one (none
    when the cache cannot be used)."""
    from ..fetch import valid_install_key

    if cache is None:
        return []
    variants: dict[tuple[str, str], list[str]] = {}
    for repo, commit, variant, _tree in cache.all_index.entries():
        if valid_install_key(repo, commit, variant):  # never echo a malformed entry
            variants.setdefault((repo, commit), []).append(variant)
    rows = []
    for (repo, commit), names in sorted(variants.items()):
        if cache.index.installed_variants(repo, commit):
            continue  # usable at this endpoint: listed above when a revision names it
        endpoints = cache.all_index.variant_endpoints(repo, commit)
        rows.append({"repo_id": repo, "commit": commit, "variants": names, "endpoints": endpoints})
    return rows
