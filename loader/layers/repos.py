"""Where a layer comes from: repository objects that name a kernel and a layer in it.

Constructing one validates the request and touches nothing else (no network, no import);
`.load()` fetches and imports the kernel through kernels.api and returns the layer class.
Repositories are values: equal requests compare equal and hash alike, so they can key caches.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import InvalidSpec, LayerError
from ..spec import KernelSpec, make_spec

if TYPE_CHECKING:
    from torch import nn


def _check_layer_name(layer_name: object, *, what: str = "layer_name") -> str:
    if not isinstance(layer_name, str) or not layer_name.isidentifier():
        raise InvalidSpec(
            f"{what} must be a Python identifier naming a layer in the kernel, got {layer_name!r}",
            hint=f'pass {what}="RMSNorm" (the class name in the kernel\'s `layers`)',
        )
    return layer_name


def _trust_key(trust_remote_code: object) -> bool | tuple[str, ...]:
    if isinstance(trust_remote_code, bool):
        return trust_remote_code
    if isinstance(trust_remote_code, (list, tuple)) and all(
        isinstance(org, str) for org in trust_remote_code
    ):
        return tuple(trust_remote_code)
    raise InvalidSpec(
        f"trust_remote_code must be a bool or a list of org names, got {trust_remote_code!r}",
        hint="pass trust_remote_code=True, or a list of publishers you trust",
    )


def layer_from_kernel(kernel: ModuleType, layer_name: str, source: object) -> type[nn.Module]:
    """`kernel.layers.<layer_name>`, checked to be an nn.Module subclass (LayerError otherwise)."""
    from torch import nn

    layers = getattr(kernel, "layers", None)
    if layers is None:
        raise LayerError(
            f"kernel {source} has no `layers` namespace, so it offers no layers",
            hint="check the repo and revision; layer kernels expose their classes in `layers`",
        )
    layer = getattr(layers, layer_name, None)
    if layer is None:
        offered = sorted(
            name
            for name, value in vars(layers).items()
            if isinstance(value, type) and issubclass(value, nn.Module) and not name.startswith("_")
        )
        raise LayerError(
            f"kernel {source} has no layer {layer_name!r}; it offers: {', '.join(offered) or 'none'}",
            hint="fix the layer name after ':' in the mapping (names are case-sensitive)",
        )
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise LayerError(
            f"{source}: `layers.{layer_name}` is a {type(layer).__name__}, not an nn.Module subclass",
            hint="map to a layer class; functions are served through use_kernel_forward_from_hub",
        )
    return layer


class _Repository:
    """Shared value semantics: subclasses define `_key()`, `__str__` and `load()`."""

    def _key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def load(self) -> type[nn.Module]:
        raise NotImplementedError


class LayerRepository(_Repository):
    """A layer in a Hub kernel repo, at a `version` (branch v<N>) or a `revision`, not both."""

    def __init__(
        self,
        repo_id: str,
        *,
        layer_name: str,
        revision: str | None = None,
        version: int | None = None,
        trust_remote_code: bool | list[str] = False,
        user_agent: str | dict | None = None,
    ):
        self.layer_name = _check_layer_name(layer_name)
        # The reference's wording, which callers match; make_spec checks the rest.
        if revision is not None and version is not None:
            raise InvalidSpec(
                f"{repo_id}: Either a revision or a version must be specified, not both.",
                hint="version=N means the branch 'v<N>'; pass only one of them",
            )
        if revision is None and version is None:
            raise InvalidSpec(
                f"{repo_id}: Either a revision or a version must be specified.",
                hint="pass version=1 (the branch 'v1') or revision='<branch|tag|commit>'",
            )
        self.spec: KernelSpec = make_spec(repo_id, revision=revision, version=version)
        self._trust = _trust_key(trust_remote_code)
        self.trust_remote_code = trust_remote_code
        self.user_agent = user_agent

    repo_id = property(lambda self: self.spec.repo_id, doc="The Hub repo id, 'org/name'.")
    revision = property(lambda self: self.spec.revision, doc="Branch, tag or commit, if given.")
    version = property(lambda self: self.spec.version, doc="Major version (branch v<N>), if given.")

    def _key(self) -> tuple:
        return (
            self.spec.repo_id,
            self.layer_name,
            self.spec.revision,
            self.spec.version,
            self._trust,
        )

    def load_kernel(self) -> ModuleType:
        """Fetch and import the kernel (the module holding `layers`)."""
        from ..api import get_kernel

        return get_kernel(
            self.spec.repo_id,
            revision=self.spec.revision,
            version=self.spec.version,
            trust_remote_code=self.trust_remote_code,
            user_agent=self.user_agent,
        )

    def load(self) -> type[nn.Module]:
        """The layer class `kernel.layers.<layer_name>`."""
        return layer_from_kernel(self.load_kernel(), self.layer_name, self)

    def __str__(self) -> str:
        return f"{self.spec}:{self.layer_name}"

    def __repr__(self) -> str:
        ref = (
            f"version={self.spec.version}"
            if self.spec.version is not None
            else f"revision={self.spec.revision!r}"
        )
        return (
            f"{type(self).__name__}({self.spec.repo_id!r}, layer_name={self.layer_name!r}, {ref})"
        )


class LocalLayerRepository(_Repository):
    """A layer in a kernel repo on local disk (the repo root, its build/ or a variant folder)."""

    def __init__(self, repo_path: str | Path, *, layer_name: str):
        self.repo_path = Path(repo_path)
        self.layer_name = _check_layer_name(layer_name)

    def _key(self) -> tuple:
        return (str(self.repo_path), self.layer_name)

    def load_kernel(self) -> ModuleType:
        from ..api import get_local_kernel

        return get_local_kernel(self.repo_path)

    def load(self) -> type[nn.Module]:
        return layer_from_kernel(self.load_kernel(), self.layer_name, self)

    def __str__(self) -> str:
        return f"{self.repo_path}:{self.layer_name}"

    def __repr__(self) -> str:
        return f"LocalLayerRepository({str(self.repo_path)!r}, layer_name={self.layer_name!r})"


class LockedLayerRepository(_Repository):
    """A layer in a Hub kernel repo at the commit a kernels.lock pins; the lock is read on load."""

    def __init__(
        self,
        repo_id: str,
        *,
        lockfile: str | Path | None = None,
        layer_name: str,
        trust_remote_code: bool | list[str] = False,
    ):
        self.spec: KernelSpec = make_spec(repo_id, require_ref=False)
        self.lockfile = Path(lockfile) if lockfile is not None else None
        self.layer_name = _check_layer_name(layer_name)
        self._trust = _trust_key(trust_remote_code)
        self.trust_remote_code = trust_remote_code

    repo_id = property(lambda self: self.spec.repo_id, doc="The Hub repo id, 'org/name'.")

    def _key(self) -> tuple:
        lock = str(self.lockfile) if self.lockfile is not None else None
        return (self.spec.repo_id, lock, self.layer_name, self._trust)

    def load_kernel(self) -> ModuleType:
        from ..locked import get_locked_kernel

        return get_locked_kernel(
            self.spec.repo_id, lockfile=self.lockfile, trust_remote_code=self.trust_remote_code
        )

    def load(self) -> type[nn.Module]:
        return layer_from_kernel(self.load_kernel(), self.layer_name, self)

    def __str__(self) -> str:
        return f"{self.spec.repo_id}@locked:{self.layer_name}"

    def __repr__(self) -> str:
        return f"LockedLayerRepository({self.spec.repo_id!r}, layer_name={self.layer_name!r})"


# -- deprecated function repositories -------------------------------------------------------------


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        # "kernels 0.17" is in the reference's text, and code that checks the warning matches it.
        f"{old} is deprecated since kernels 0.16 and was due for removal in kernels 0.17; "
        f"use {new} (a function kernel is a layer too)",
        DeprecationWarning,
        stacklevel=3,
    )


def _function_layer(kernel: ModuleType, func_name: str, source: object) -> type[nn.Module]:
    from .funcs import layer_class_from_function

    func: Any = getattr(kernel, func_name, None)
    if func is None:
        raise LayerError(
            f"kernel {source} has no function {func_name!r}",
            hint="fix func_name, or use LayerRepository(..., layer_name=...) for a layer class",
        )
    if isinstance(func, type):
        return func
    return layer_class_from_function(func)


class FuncRepository(LayerRepository):
    """Deprecated: a function in a Hub kernel; use LayerRepository."""

    def __init__(
        self,
        repo_id: str,
        *,
        func_name: str,
        revision: str | None = None,
        version: int | None = None,
        trust_remote_code: bool | list[str] = False,
    ):
        _deprecated("FuncRepository", "LayerRepository(repo_id, layer_name=...)")
        super().__init__(
            repo_id,
            layer_name=func_name,
            revision=revision,
            version=version,
            trust_remote_code=trust_remote_code,
        )

    func_name = property(lambda self: self.layer_name)

    def load(self) -> type[nn.Module]:
        return _function_layer(self.load_kernel(), self.layer_name, self)


class LocalFuncRepository(LocalLayerRepository):
    """Deprecated: a function in a local kernel; use LocalLayerRepository."""

    def __init__(self, repo_path: str | Path, *, func_name: str):
        _deprecated("LocalFuncRepository", "LocalLayerRepository(repo_path, layer_name=...)")
        super().__init__(repo_path, layer_name=func_name)

    func_name = property(lambda self: self.layer_name)

    def load(self) -> type[nn.Module]:
        return _function_layer(self.load_kernel(), self.layer_name, self)


class LockedFuncRepository(LockedLayerRepository):
    """Deprecated: a function in a locked Hub kernel; use LockedLayerRepository."""

    def __init__(
        self,
        repo_id: str,
        *,
        lockfile: str | Path | None = None,
        func_name: str,
        trust_remote_code: bool | list[str] = False,
    ):
        _deprecated("LockedFuncRepository", "LockedLayerRepository(repo_id, layer_name=...)")
        super().__init__(
            repo_id, lockfile=lockfile, layer_name=func_name, trust_remote_code=trust_remote_code
        )

    func_name = property(lambda self: self.layer_name)

    def load(self) -> type[nn.Module]:
        return _function_layer(self.load_kernel(), self.layer_name, self)
