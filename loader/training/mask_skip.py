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


def _exporting() -> bool:
    import torch

    return bool(torch.compiler._is_exporting_flag)


def backport() -> None:
    """Make transformers' masking module read the export flag itself (idempotent). Nothing
    changes where that module, its function or the flag is missing."""
    masking = sys.modules.get("transformers.masking_utils")
    torch = sys.modules.get("torch")
    if masking is None or torch is None or not hasattr(torch.compiler, "_is_exporting_flag"):
        return
    if hasattr(masking, "is_torchdynamo_exporting"):
        masking.is_torchdynamo_exporting = _exporting
