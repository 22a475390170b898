"""transformers' implicit causal mask under torch.compile, on torches whose Dynamo answers
``torch.compiler.is_exporting()`` with True in any trace.

transformers (5.x) hands SDPA no mask and ``is_causal=True`` when nothing is masked but
causality, unless it is exporting. It asks ``torch.compiler.is_exporting()``, which Dynamo
before PyTorch 2.13 folds to True while compiling too, so every compiled step builds an
explicit [S, S] mask and SDPA loses its flash / cuDNN kernels (twice the attention time on an
H200 at 8 x 2048). The flag that function returns outside a trace,
``torch.compiler._is_exporting_flag``, is True only while ``torch.export`` traces, and Dynamo
reads it as the value it is; ``backport`` points transformers' masking module at it, as
later torches do. An export still gets its explicit mask.
"""

from __future__ import annotations

import sys

_MARK = "_kernels_mask_skip"


def _exporting() -> bool:
    import torch

    return bool(torch.compiler._is_exporting_flag)


setattr(_exporting, _MARK, True)


def backport() -> bool:
    """Make transformers' masking module read the export flag itself (idempotent); whether it
    now does. Nothing changes where transformers' masking module or the flag is missing."""
    masking = sys.modules.get("transformers.masking_utils")
    torch = sys.modules.get("torch")
    if masking is None or torch is None:
        return False
    if not hasattr(torch.compiler, "_is_exporting_flag"):
        return False
    current = getattr(masking, "is_torchdynamo_exporting", None)
    if current is None:
        return False
    if not getattr(current, _MARK, False):
        masking.is_torchdynamo_exporting = _exporting
    return True
