"""`kernels info`, `kernels versions`, `kernels env`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import add_backend_arguments


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kernel", help="org/repo[@rev] or a local kernel folder")
    parser.add_argument("--json", action="store_true")
    add_backend_arguments(parser)


def _local_info(path: Path, backend) -> dict:
    from ..api import _local_variant_dirs, _system
    from ..metadata import Metadata
    from ..variants import select_variants

    variants, _single = _local_variant_dirs(path.resolve())
    trace = select_variants(variants, _system(backend))
    first = next(iter(variants.values()), None)
    meta = Metadata.read(first / "metadata.json") if first else None
    return {"source": str(path), "metadata": meta, "trace": trace}


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
    resolution = resolve(cache, spec, offline=offline, ttl=settings.resolve_ttl())
    listing = get_listing(cache, spec.repo_id, resolution.commit, offline=offline)
    trace = select_variants(listing.variants, _system(backend))
    return {
        "source": f"{spec.repo_id}@{spec.ref} = {resolution.commit}",
        "metadata": None,
        "trace": trace,
        "listing": listing,
    }


def run_info(args: argparse.Namespace) -> int:
    path = Path(args.kernel)
    if path.exists():
        info = _local_info(path, args.backend)
    else:
        info = _hub_info(args.kernel, args.backend)
    meta = info["metadata"]
    if args.json:
        out = {"source": info["source"], "variants": [str(e) for e in info["trace"]]}
        if meta is not None:
            out["metadata"] = meta.raw
        print(json.dumps(out, sort_keys=True))
        return 0
    print(info["source"])
    if meta is not None:
        print(
            f"  name {meta.name}, version {meta.version}, license {meta.license}, backend {meta.backend_type}"
        )
        if meta.python_depends:
            print(f"  python depends: {', '.join(meta.python_depends)}")
    listing = info.get("listing")
    for entry in info["trace"]:
        extra = ""
        if listing is not None and entry.variant in listing.variants:
            files = listing.variants[entry.variant]
            extra = f"  [{len(files)} files, {sum(f.size for f in files)} bytes]"
        print(f"  {entry}{extra}")
    return 0


def add_versions_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo", help="org/repo")
    parser.add_argument("--json", action="store_true")
    add_backend_arguments(parser)


def run_versions(args: argparse.Namespace) -> int:
    from .. import settings
    from ..api import _cache, _system
    from ..fetch import get_listing
    from ..resolve import available_versions
    from ..spec import parse_version_branch, validate_repo_id
    from ..variants import VariantAccepted, select_variants

    repo_id = validate_repo_id(args.repo)
    cache = _cache()
    if settings.offline():
        # Offline: what this machine has resolved before.
        versions = {}
        for record in cache.records.revisions(repo_id):
            number = parse_version_branch(record.revision)
            if number is not None:
                versions[number] = record.commit
        source = "cache (offline)"
    else:
        versions = available_versions(repo_id)
        source = settings.endpoint()
    system = _system(args.backend)
    rows = []
    for number, commit in sorted(versions.items()):
        try:
            listing = get_listing(cache, repo_id, commit, offline=settings.offline())
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
    if args.json:
        print(json.dumps({"repo_id": repo_id, "source": source, "versions": rows}, sort_keys=True))
        return 0
    if not rows:
        print(f"{repo_id}: no v<N> version branches ({source})")
        return 0
    print(f"{repo_id} ({source})")
    for row in rows:
        if "error" in row:
            print(f"  v{row['version']}  {row['commit'][:12]}  error: {row['error']}")
            continue
        fit = row["variant"] or "no compatible variant here"
        print(f"  v{row['version']}  {row['commit'][:12]}  -> {fit}")
    return 0


def add_env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", help="describe selection for this backend")


def run_env(args: argparse.Namespace) -> int:
    import platform

    from .. import settings
    from .._version import __version__
    from ..api import _cache, _system
    from ..variants import VariantAccepted, select_variants

    system = _system(args.backend)
    cache = _cache()
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
    for repo in cache.records.repos():
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
        "cache": str(cache.root),
        "cache_writable": cache.writable,
        "endpoint": settings.endpoint(),
        "offline": settings.offline(),
        "resolve_ttl_s": settings.resolve_ttl(),
        "trusted_publishers": sorted(settings.trusted_publishers()),
        "cached_kernels": selections,
    }
    if args.json:
        print(json.dumps(env, sort_keys=True))
        return 0
    for key, value in env.items():
        if key == "cached_kernels":
            print("cached kernels (variant this machine would select):")
            for s in value:
                print(
                    f"  {s['repo_id']}@{s['ref']} ({s['commit'][:12]}) -> {s['variant'] or 'none compatible'}"
                )
            if not value:
                print("  none")
        else:
            print(f"{key}: {value}")
    return 0
