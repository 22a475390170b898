"""float64 references written from the formulas, independent of the kernels' own torch paths."""

from __future__ import annotations

import math

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere counts as infinitely wrong)."""
    out = out.detach().double()
    ref = ref.detach().double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype: torch.dtype) -> float:
    """Relative tolerance against a float64 reference, from each dtype's rounding: fp32 ~1e-5,
    fp16 ~1e-3 (10 mantissa bits), bf16 ~1e-2 (7 bits). fp16 held to bf16's bound would let a
    kernel that rounds fp16 results through bf16 pass."""
    return TOLERANCE[dtype]


def assert_close(out, ref, dtype, what: str, factor: float = 1.0) -> None:
    err = rel_err(out, ref)
    assert err <= tol(dtype) * factor, (
        f"{what}: relative error {err:.3e} > {tol(dtype) * factor:.1e}"
    )


def leaf64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_(t.requires_grad)


def rms_norm64(x, w, eps, gemma=False):
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * ((1.0 + w) if gemma else w)


def layer_norm64(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def rope64(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def check_rope(q, k, cos, sin, qo, ko, unsqueeze_dim, dtype, grads=None, ref=rope64) -> None:
    """q_embed, k_embed (qo, ko) and the gradients of the leaves q, k against `ref` in float64.
    The gradients reaching qo and ko are `grads` (cast to their dtypes; the reference takes them
    uncast), else fresh random ones."""
    dq, dk = grads if grads is not None else (torch.randn_like(qo), torch.randn_like(ko))
    torch.autograd.backward((qo, ko), (dq.to(qo.dtype), dk.to(ko.dtype)))
    q64, k64 = leaf64(q), leaf64(k)
    qr, kr = ref(q64, k64, cos.double(), sin.double(), unsqueeze_dim)
    torch.autograd.backward((qr, kr), (dq.double(), dk.double()))
    assert_close(qo, qr, dtype, "q_embed")
    assert_close(ko, kr, dtype, "k_embed")
    assert_close(q.grad, q64.grad, dtype, "dq")
    assert_close(k.grad, k64.grad, dtype, "dk")


def silu64(x):
    return x / (1.0 + torch.exp(-x))


def gelu64(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
