"""The training kernels bundled with the package: `kernels-lab/training` v1 when neither the
endpoint nor the cache has it (issue 31).

The wheel carries the variant folder hub_kernels/kernels-lab/training/build/torch-universal/ as
the package data `kernels._bundled_training` (pyproject.toml maps it, so an editable install
reads the checkout's folder), and `bundled_training.json` beside this module, written by
scripts/bundle_training.py: the repo, version, variant, the commit `kernels mirror build
hub_kernels` gives it, and every file's sha256 and size. Loading it takes a download's steps:
each file is read from the package, checked against its recorded digest and size and stored in
the cache's object store, the tree is published under the pseudo-endpoint "bundled" (records of
one endpoint are never another's answer, so no Hub or mirror load takes it for theirs), and the
verified tree is imported under its content-derived module name. Where the cache cannot be
written (a shared read-only cache), the files are checked the same way and imported from the
package's folder. docs/security.md ("Bundled training kernels") says what the copy is trusted
for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kernels.cache import Cache, Manifest, ManifestError

from ._version import __version__
from .errors import CacheError, IntegrityError, KernelsError
from .fetch import cache_lock
from .guard import open_cache
from .importer import RepoInfo, import_tree
from .metadata import Metadata
from .notices import notice_once
from .select import check_python_depends

ENDPOINT = "bundled"
PACKAGE = "kernels._bundled_training"
RECORD = Path(__file__).with_name("bundled_training.json")
_REPAIR = (
    "reinstall kernels; in a checkout, run `python scripts/bundle_training.py` after editing "
    "the training kernels"
)


@dataclass(frozen=True)
class Bundle:
    """What bundled_training.json says the package carries."""

    repo_id: str
    version: int
    variant: str
    commit: str
    manifest: Manifest


def read_bundle(path: Path = RECORD) -> Bundle:
    """The bundle record; IntegrityError when it is missing or malformed."""
    try:
        data = json.loads(path.read_text("utf-8"))
        return Bundle(
            str(data["repo_id"]),
            int(data["version"]),
            str(data["variant"]),
            str(data["commit"]),
            Manifest.from_json(data),
        )
    except (OSError, ValueError, KeyError, TypeError, ManifestError) as exc:
        raise IntegrityError(
            f"the bundled training kernels' record {path.name} is unreadable: {exc}", hint=_REPAIR
        ) from None


def source_folder() -> Path | None:
    """The folder of the bundled variant (found without importing it), or None when this
    installation carries none (an editable install made before the bundle existed)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _checked_bytes(source: Path, bundle: Bundle) -> dict[str, bytes]:
    """Every recorded file's bytes, each matching its digest and size; nothing else in the
    folder but bytecode. IntegrityError naming the first file that differs."""
    wanted = {entry.path: entry for entry in bundle.manifest.files}
    present = {
        p.relative_to(source).as_posix()
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    problems = [f"{rel} is not in the record" for rel in sorted(present - set(wanted))]
    problems += [f"{rel} is missing" for rel in sorted(set(wanted) - present)]
    out = {}
    for rel, entry in sorted(wanted.items()):
        if rel not in present:
            continue
        data = (source / rel).read_bytes()
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            problems.append(f"{rel} does not match its sha256")
        out[rel] = data
    if problems:
        raise IntegrityError(
            f"the bundled training kernels in {source} differ from their record: "
            + "; ".join(problems[:3]),
            hint=_REPAIR,
        )
    return out


def install(cache: Cache, bundle: Bundle, source: Path) -> Path:
    """Verify the bundled files and publish their tree in `cache` (idempotent); its folder."""
    manifest = bundle.manifest
    found = cache.installed(bundle.repo_id, bundle.commit, bundle.variant)
    if found is not None and found[0].digest == manifest.digest:
        check = cache.trees.check(manifest)
        if check.ok:
            if check.rehashed:
                cache.trees.refresh_stamps(manifest)
            return found[1]
    with cache_lock(cache, f"variant:{bundle.repo_id}:{bundle.commit}:{bundle.variant}"):
        files = _checked_bytes(source, bundle)
        try:
            if cache.trees.exists(manifest.digest) and not cache.trees.check(manifest).ok:
                cache.trees.remove(manifest.digest)  # changed on disk: publish a clean copy
            for entry in manifest.files:
                if not cache.objects.has(entry.sha256, entry.size):
                    cache.objects.ingest_bytes(files[entry.path], entry.sha256)
            return cache.install(bundle.repo_id, bundle.commit, bundle.variant, manifest)
        except OSError as exc:
            if isinstance(exc, KernelsError):
                raise
            raise CacheError(
                f"cannot write to the cache at {cache.root}: {exc.strerror or exc}"
            ) from exc


def load(why: KernelsError) -> tuple[ModuleType, Path] | None:
    """Import the bundled training kernels, installed and verified in the cache, with one
    notice saying so and `why` the endpoint could not serve them; None when this installation
    carries none. Returns the module and its verified tree."""
    source = source_folder()
    if source is None:
        return None
    bundle = read_bundle()
    where = ""
    try:
        tree = install(open_cache(endpoint=ENDPOINT), bundle, source)
    except CacheError as exc:
        # A cache this user cannot write (a shared one made read-only, a full disk): the
        # package's own folder, as trusted as the loader beside it, is checked file by file
        # against the record and imported where it is.
        _checked_bytes(source, bundle)
        tree = source
        where = f"; imported from the package's folder: {exc.message.splitlines()[0]}"
    metadata = Metadata.read(tree / "metadata.json")
    check_python_depends(metadata)
    loaded = import_tree(
        tree,
        metadata,
        bundle.manifest.digest,
        variant=bundle.variant,
        repo_info=RepoInfo(bundle.repo_id, bundle.commit),
    )
    from . import settings

    reason = why.message.splitlines()[0]
    if not settings.offline():
        reason += f" (endpoint {settings.endpoint()})"
    notice_once(
        f"bundled:{bundle.repo_id}",
        f"kernels: {reason}; using the copy of {bundle.repo_id} v{bundle.version} bundled with "
        f"kernels {__version__} ({bundle.commit[:12]}, every file verified){where}",
    )
    return loaded.module, tree
