"""kernels: load compute kernels from the Hugging Face Hub into PyTorch models.

The public names below are resolved lazily (PEP 562), so `import kernels` costs a few
milliseconds and imports neither torch nor huggingface_hub; each name pulls in only the module
that defines it. The pipeline reads top to bottom in loader/: spec -> resolve -> fetch -> select
-> importer -> layers (bind).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# public name -> submodule that defines it
_EXPORTS = {
    # loading kernels (the reference API)
    "get_kernel": "api",
    "get_local_kernel": "api",
    "has_kernel": "api",
    "install_kernel": "api",
    "get_kernel_variants": "api",
    "get_loaded_kernels": "api",
    "get_kernel_dep": "api",
    "load_kernel": "locked",
    "get_locked_kernel": "locked",
    "LoadedKernel": "importer",
    "RepoInfo": "importer",
    "Metadata": "metadata",
    "VariantAccepted": "variants",
    "VariantRejected": "variants",
    "Benchmark": "benchmark",
    # binding layers to models
    "Mode": "layers",
    "Device": "layers",
    "CUDAProperties": "layers",
    "ROCMProperties": "layers",
    "KernelizeFallback": "layers",
    "LayerRepository": "layers",
    "LocalLayerRepository": "layers",
    "LockedLayerRepository": "layers",
    "FuncRepository": "layers",
    "LocalFuncRepository": "layers",
    "LockedFuncRepository": "layers",
    "register_kernel_mapping": "layers",
    "use_kernel_mapping": "layers",
    "kernelize": "layers",
    "use_kernel_forward_from_hub": "layers",
    "use_kernel_func_from_hub": "layers",
    "use_kernelized_func": "layers",
    "replace_kernel_forward_from_hub": "layers",
    "apply_kernels": "layers",
    "plan_kernels": "layers",
    "last_report": "layers",
    "BindReport": "layers",
    "BindEntry": "layers",
    "KernelFunction": "layers",
    # training kernels, the Liger way
    "liger_kernel_mapping": "liger_config",
    # training kernels for any causal LM, by structure (one line)
    "training_kernel_config": "training",
    "training_kernel_mapping": "training",
    "apply_training_kernels": "training",
    "plan_training_kernels": "training",
    # errors
    "KernelsError": "errors",
    "InvalidSpec": "errors",
    "InvalidMetadata": "errors",
    "KernelNotFound": "errors",
    "RevisionNotFound": "errors",
    "NoCompatibleVariant": "errors",
    "IntegrityError": "errors",
    "OfflineCacheMiss": "errors",
    "HubUnavailable": "errors",
    "UntrustedPublisher": "errors",
    "LockfileError": "errors",
    "CacheError": "errors",
    "LayerError": "errors",
    "MissingDependency": "errors",
    "VersionNotFound": "errors",
    "UnsupportedDependency": "errors",
    "LocalKernelsError": "errors",
    "KernelStatusError": "errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .api import (  # noqa: F401
        get_kernel,
        get_kernel_dep,
        get_kernel_variants,
        get_loaded_kernels,
        get_local_kernel,
        has_kernel,
        install_kernel,
    )
    from .errors import *  # noqa: F401,F403
    from .layers import *  # noqa: F401,F403
    from .locked import get_locked_kernel, load_kernel  # noqa: F401
