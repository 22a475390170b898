"""RoPE in place (issue 17): extra peak memory, device and host time of ours against Liger at
the anchor shape (q 8x32x2048x128, k 8x8x2048x128, bf16), in the flow a training step has. GPU.

    python scripts/probes/probe_rope_inplace_memory_gpu.py

The flow: q/k are [B, H, T, D] views of an op's output (as the projections give them) and the
upstream gradients come out of an op's backward (as attention's do). Each column is the fwd+bwd
with the rotation minus the same fwd+bwd without it. "ours, out of place" forces the new-buffer
path (the checks answer no) to show what in place saves. bench_kernels.py's RoPE case passes
leaves and root gradients instead: ours then keeps both untouched and allocates (160 MiB),
while Liger rotates the caller's tensors; the second table shows which tensors each changed.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the bench harness
import torch  # noqa: E402
from bench_harness import _device_ms, host_us, load_training_kernels  # noqa: E402

B, T, HQ, HK, D = 8, 2048, 32, 8, 128
DT = torch.bfloat16
kt = load_training_kernels()
rope = sys.modules[kt.__name__ + ".rope"]


def _liger():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def inputs():
    xq = torch.randn(B, T, HQ * D, device="cuda", dtype=DT, requires_grad=True)
    xk = torch.randn(B, T, HK * D, device="cuda", dtype=DT, requires_grad=True)
    angles = torch.rand(B, T, D // 2, device="cuda") * 100
    emb = torch.cat((angles, angles), dim=-1)
    gq = torch.randn(B, HQ, T, D, device="cuda", dtype=DT)
    gk = torch.randn(B, HK, T, D, device="cuda", dtype=DT)
    return xq, xk, emb.cos().to(DT), emb.sin().to(DT), gq, gk


def flow(fn, xq, xk, cos, sin, gq, gk):
    def fwd_bwd():
        q = (xq * 1.0).view(B, T, HQ, D).transpose(1, 2)
        k = (xk * 1.0).view(B, T, HK, D).transpose(1, 2)
        if fn is not None:
            q, k = fn(q, k, cos, sin)
        return torch.autograd.grad((q * gq).sum() + (k * gk).sum(), (xq, xk))

    return fwd_bwd


def extra_mib(fwd_bwd) -> float:
    fwd_bwd()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - max(base, torch.cuda.memory_allocated())
    del result
    return peak / 2**20


class OutOfPlace:
    """Within it, ours takes the new-buffer path (a measurement switch, not a mode of rope.py)."""

    def __enter__(self):
        self.saved = rope._own_memory, rope._private_grad
        rope._own_memory = rope._private_grad = lambda x: False

    def __exit__(self, *exc):
        rope._own_memory, rope._private_grad = self.saved


def bench_flow_row(name: str, fn, cos, sin) -> str:
    """One row of the second table: the benchmark's leaves and root gradients."""
    leaf = torch.randn(B, T, HQ, D, device="cuda", dtype=DT, requires_grad=True)
    kleaf = torch.randn(B, T, HK, D, device="cuda", dtype=DT, requires_grad=True)
    q, k = leaf.transpose(1, 2), kleaf.transpose(1, 2)
    g = (torch.randn(B, HQ, T, D, device="cuda", dtype=DT), torch.randn_like(k))
    before = leaf.detach().clone(), g[0].clone()
    mib = extra_mib(lambda: torch.autograd.grad(fn(q, k, cos, sin), (leaf, kleaf), g))
    leaf_changed = not torch.equal(leaf.detach(), before[0])
    grad_changed = not torch.equal(g[0], before[1])
    return f"| {name} | {mib:.0f} | {leaf_changed} | {grad_changed} |"


def main() -> None:
    data = inputs()
    impls = {"ours": kt.apply_rotary_pos_emb, "ours, out of place": kt.apply_rotary_pos_emb}
    liger = _liger()
    if liger is not None:
        impls["liger"] = liger
    base = flow(None, *data)
    rows = [("none (the flow alone)", extra_mib(base), _device_ms(base), host_us(base))]
    for name, fn in impls.items():
        f = flow(fn, *data)
        with OutOfPlace() if name.endswith("out of place") else contextlib.nullcontext():
            rows.append((name, extra_mib(f), _device_ms(f), host_us(f)))
    print("| rotation | fwd+bwd extra MiB | device ms | host us |")
    print("|---|---|---|---|")
    for i, (name, mib, ms, us) in enumerate(rows):
        if i:  # the rotation's share: minus the flow alone
            mib, ms, us = mib - rows[0][1], ms - rows[0][2], us - rows[0][3]
        print(f"| {name} | {mib:.0f} | {ms:.3f} | {us:.0f} |")

    print("\nThe benchmark's flow (leaf q/k views, root gradients): which tensors changed")
    print("| rotation | extra MiB | leaf q changed | root gradient changed |")
    print("|---|---|---|---|")
    for name, fn in (("ours", kt.apply_rotary_pos_emb), ("liger", liger)):
        if fn is not None:
            print(bench_flow_row(name, fn, data[2], data[3]))


if __name__ == "__main__":
    main()
