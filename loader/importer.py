"""Stage 5: import a verified variant tree as a Python package.

The module name is derived from the tree's content digest: two different builds never share a
`sys.modules` entry, and the same build loaded twice (from any repo, version or path) is the same
module. Sources are compiled from the files themselves, never from a `__pycache__` that nobody
verified; native extensions load from the tree. Imports hold a process-wide lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import settings
from .errors import InvalidMetadata
from .metadata import Metadata
from .select import warn_if_dirty


@dataclass(frozen=True)
class RepoInfo:
    """Where a kernel loaded from the Hub came from: the repo and the resolved commit."""

    repo_id: str
    revision: str


@dataclass(frozen=True)
class LoadedKernel:
    """A kernel imported in this process.

    The first three fields are the reference's (`metadata`, `module`, `repo_info`); the rest
    are optional extras this package fills in: the variant name, its folder, and the content
    digest of the verified tree.
    """

    metadata: Metadata
    module: ModuleType
    repo_info: RepoInfo | None = None
    variant: str | None = None
    path: Path | None = None
    digest: str | None = None

    def describe(self) -> str:
        origin = (
            f"{self.repo_info.repo_id}@{self.repo_info.revision[:12]}"
            if self.repo_info
            else str(self.path)
        )
        return f"{origin}/{self.variant}"


_lock = threading.RLock()
_loaded: dict[str, LoadedKernel] = {}  # module name -> record
_kernel_deps: contextvars.ContextVar[dict[str, ModuleType] | None] = contextvars.ContextVar(
    "kernels_deps", default=None
)


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles from the source file itself: no bytecode cache is read or written."""

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)

    def set_data(self, *args, **kwargs):  # never write __pycache__ into the cache
        return None


def module_name_for(metadata: Metadata, digest: str) -> str:
    slug = re.sub(r"[^0-9a-zA-Z_]", "_", metadata.name)
    return f"_kernels_{slug}_{digest[:16]}"


def _package_root(tree: Path, metadata: Metadata) -> Path:
    if (tree / "__init__.py").is_file():
        return tree
    compat = tree / metadata.name.replace("-", "_")
    if (compat / "__init__.py").is_file():
        return compat
    raise InvalidMetadata(
        f"{tree}: no __init__.py at the variant root or in {compat.name}/",
        hint="a kernel variant must be a Python package",
    )


def _install_finders(root: Path) -> None:
    """Make submodule imports under `root` use the verifying source loader."""
    loaders = (
        (_SourceLoader, importlib.machinery.SOURCE_SUFFIXES),
        (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
    )
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        sys.path_importer_cache[dirpath] = importlib.machinery.FileFinder(dirpath, *loaders)


def import_tree(
    tree: Path,
    metadata: Metadata,
    digest: str,
    *,
    variant: str,
    repo_info: RepoInfo | None = None,
    deps: dict[str, ModuleType] | None = None,
) -> LoadedKernel:
    """Import the package in `tree` (already verified against `digest`); idempotent per digest.

    A kernel from an endpoint (`repo_info`) must first pass the signature policy
    (signatures.py; default "off": nothing is read)."""
    if repo_info is not None:
        mode = settings.signature_policy(repo_info.repo_id)
        if mode != "off":
            from .signatures import enforce

            enforce(tree, digest, repo_info.repo_id, mode)
    name = module_name_for(metadata, digest)
    with _lock:
        existing = _loaded.get(name)
        if existing is not None and sys.modules.get(name) is existing.module:
            if repo_info is not None and existing.repo_info is None:
                existing = LoadedKernel(metadata, existing.module, repo_info, variant, tree, digest)
                _loaded[name] = existing
            return existing
        root = _package_root(tree, metadata)
        warn_if_dirty(metadata, variant)  # once per build: later loads reuse the module
        _install_finders(root)
        init = root / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            name,
            init,
            loader=_SourceLoader(name, str(init)),
            submodule_search_locations=[str(root)],
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        token = _kernel_deps.set(dict(deps or {}))
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            with contextlib.suppress(AttributeError, TypeError):
                exc.add_note(f"while importing kernel {metadata.name} ({variant}) from {tree}")
            raise
        finally:
            _kernel_deps.reset(token)
        record = LoadedKernel(metadata, module, repo_info, variant, tree, digest)
        _loaded[name] = record
        return record


def loaded_kernel_of(module: ModuleType) -> LoadedKernel | None:
    """The record of a kernel module (or of a module inside a kernel package)."""
    top = getattr(module, "__name__", "").split(".")[0]
    with _lock:
        record = _loaded.get(top)
    return record


def get_loaded_kernels() -> list[LoadedKernel]:
    with _lock:
        return list(_loaded.values())


def get_kernel_dep(repo_id: str) -> ModuleType:
    """Called by a kernel while it is being imported, to get a kernel it declared it depends on."""
    deps = _kernel_deps.get()
    if deps is None:
        raise RuntimeError("get_kernel_dep() can only be called while a kernel is being imported")
    try:
        return deps[repo_id]
    except KeyError:
        raise InvalidMetadata(
            f"{repo_id} is not among this kernel's kernel-depends ({', '.join(deps) or 'none'})"
        ) from None
