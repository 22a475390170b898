"""What kernels.training's Plan.mark changes process-wide on the model classes it classifies
(layer names, conditions, the reasons and attributes the layers read, the rotary functions it
routes), saved and put back around a test: tests elsewhere in the same worker process (a file
that loads a Qwen3 through transformers' ``use_kernels``) then see transformers' classes as they
are."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

MARKS = (
    "kernel_layer_name", "kernel_condition", "__init__", "_kernels_unserved",
    "_kernels_attached_funcs", "kernels_logit_ops", "kernels_output_head",
    "kernels_shift_labels", "kernels_aux_loss", "kernels_mlp_projections",
    "kernels_qkv_projections", "kernels_step_cache", "kernels_input_embedding",
    "kernels_norm_casts_to_weight",
)  # fmt: skip


def _marked_objects(families: tuple[str, ...]):
    for family in families:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        rotary = {k: v for k, v in vars(module).items() if k.startswith("apply_rotary")}
        yield module, rotary
        classes = [c for c in vars(module).values() if isinstance(c, type)]
        classes += [type(f) for f in rotary.values()]
        for cls in classes:
            yield cls, {a: cls.__dict__[a] for a in MARKS if a in cls.__dict__}


@contextmanager
def restored(families: tuple[str, ...]) -> Iterator[None]:
    """The marks of the families' modeling modules as they were on entry, put back on exit."""
    saved = list(_marked_objects(families))
    try:
        yield
    finally:
        for obj, attrs in saved:
            if isinstance(obj, type):
                for name in MARKS:
                    if name in attrs:
                        setattr(obj, name, attrs[name])
                    elif name in obj.__dict__:
                        delattr(obj, name)
            else:
                vars(obj).update(attrs)
