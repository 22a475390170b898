"""kernels.training: bind this project's training kernels to any causal LM, by structure.

``training_kernel_config(path_or_repo_or_config)`` (transformers' ``KernelConfig``),
``training_kernel_mapping(...)`` (the mapping dict) and ``apply_training_kernels(model)`` (a
built model, any device) classify the model's modules (classify.py, probes.py) and bind what
the kernels serve; the rest keeps its forward, with the reason in ``kernels.last_report``.
"""

from .classify import Plan, Verdict, classify
from .entry import (
    TRAINING_REPO,
    apply_training_kernels,
    plan_training_kernels,
    training_kernel_config,
    training_kernel_mapping,
)

__all__ = [
    "TRAINING_REPO",
    "Plan",
    "Verdict",
    "apply_training_kernels",
    "classify",
    "plan_training_kernels",
    "training_kernel_config",
    "training_kernel_mapping",
]
