"""A transformers ``KernelConfig`` that survives being used for more than one model.

transformers rewrites ``kernel_config.kernel_mapping`` in place while it loads a model (into
``(repo, metadata)`` tuples, then into ``{layer: {device: {Mode: LayerRepository}}}``), and a
second ``from_pretrained`` with the same object fails inside transformers on the nested form.
TRL's trainers do exactly that: the reference model (DPO, KTO, GRPO and RLOO with a KL term) is
loaded with the policy's ``model_init_kwargs``, the same object. The config made here keeps the
tuple form, which every load accepts, and hands each model its own copy for the nested form
(``model.kernel_config``, which transformers reads again on every ``train()``/``eval()``).
"""

from __future__ import annotations

import copy
from typing import Any

_CLASS: list[type] = []


def reusable_kernel_config(mapping: dict[str, Any], *, use_local_kernel: bool = False) -> Any:
    """``KernelConfig(kernel_mapping=mapping, use_local_kernel=...)`` that any number of
    ``from_pretrained`` calls (and TRL's policy plus reference models) can share."""
    if not _CLASS:
        from transformers import KernelConfig

        class TrainingKernelConfig(KernelConfig):
            """KernelConfig whose own mapping stays in the form a load accepts; each model
            gets a copy holding the nested form transformers makes from it."""

            def create_compatible_mapping(self, model, compile=False):  # noqa: ANN001, ANN201
                own = copy.copy(self)
                own.kernel_mapping = dict(self.kernel_mapping)
                if self.use_local_kernel:
                    own.kernel_mapping = local_form(own.kernel_mapping)
                KernelConfig.create_compatible_mapping(own, model, compile)
                # set_use_kernels set model.kernel_config to this shared object just before
                model.kernel_config = own

        _CLASS.append(TrainingKernelConfig)
    return _CLASS[0](kernel_mapping=mapping, use_local_kernel=use_local_kernel)


def local_form(mapping: dict[str, Any]) -> dict[str, Any]:
    """``{layer: "/path:Layer"}`` again: transformers' load rewrites every value into a
    ``("/path:Layer", metadata)`` tuple before it builds the nested form, and its local branch
    (``use_local_kernel``) then splits the tuple as if it were the string (transformers 5.24)."""
    return {name: v[0] if isinstance(v, tuple) else v for name, v in mapping.items()}
