"""kernels.layers: bind kernel layers from kernel repos to the modules of a model.

The reference API (Mode, Device, repositories, mappings, kernelize, decorators), plus
`apply_kernels` (spec strings in, a `BindReport` out), `plan_kernels` (a dry run of kernelize)
and `last_report(model)`.
This package imports torch; `import kernels` does not import it until a name here is used.
"""

from __future__ import annotations

from .apply import apply_kernels
from .decorators import (
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernelized_func,
)
from .device import CUDAProperties, Device, ROCMProperties
from .fallback import KernelizeFallback
from .funcs import KernelFunction
from .kernelize import kernelize, plan_kernels
from .mapping import register_kernel_mapping, use_kernel_mapping
from .mode import Mode
from .report import BindEntry, BindReport, last_report
from .repos import (
    FuncRepository,
    LayerRepository,
    LocalFuncRepository,
    LocalLayerRepository,
    LockedFuncRepository,
    LockedLayerRepository,
)

__all__ = [
    "BindEntry",
    "BindReport",
    "CUDAProperties",
    "Device",
    "FuncRepository",
    "KernelFunction",
    "KernelizeFallback",
    "LayerRepository",
    "LocalFuncRepository",
    "LocalLayerRepository",
    "LockedFuncRepository",
    "LockedLayerRepository",
    "Mode",
    "ROCMProperties",
    "apply_kernels",
    "kernelize",
    "last_report",
    "plan_kernels",
    "register_kernel_mapping",
    "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub",
    "use_kernel_func_from_hub",
    "use_kernel_mapping",
    "use_kernelized_func",
]
