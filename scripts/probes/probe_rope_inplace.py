"""Does writing in place explain Liger's lead at RoPE? One table: device time of the RoPE forward
for our kernel out of place (as shipped), the same kernel and launch geometry writing over its
input, and Liger's (in place). GPU only.

    python scripts/probes/probe_rope_inplace.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_harness import _device_ms, load_training_kernels  # noqa: E402
from liger_kernel.transformers.rope import liger_rotary_pos_emb  # noqa: E402

kt = load_training_kernels()
rope = sys.modules[kt.__name__ + ".rope"]
DT = torch.bfloat16


class InPlace:
    """Stands in for `torch` inside rope.py: empty_like hands back its argument."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty_like(self, t):
        return t


def inputs(b, hq, hk, t, d):
    q = torch.randn(b, t, hq, d, device="cuda", dtype=DT).transpose(1, 2)
    k = torch.randn(b, t, hk, d, device="cuda", dtype=DT).transpose(1, 2)
    a = torch.rand(b, t, d // 2, device="cuda") * 100
    e = torch.cat((a, a), -1)
    return q, k, e.cos().to(DT), e.sin().to(DT)


def measure(shape) -> tuple[float, float, float]:
    """(out of place, in place, Liger) forward device times in ms."""
    q, k, c, s = inputs(*shape)
    with torch.no_grad():
        rope.torch = torch
        out = _device_ms(lambda: rope.rotate(q, k, c, s, 1, False))
        ref = rope.rotate(q, k, c, s, 1, False)
        rope.torch = InPlace()
        q2, k2 = q.clone(), k.clone()
        res = rope.rotate(q2, k2, c, s, 1, False)
        assert res[0].data_ptr() == q2.data_ptr(), "the in-place run must write over q"
        assert torch.equal(res[0], ref[0]) and torch.equal(res[1], ref[1])
        inp = _device_ms(lambda: rope.rotate(q, k, c, s, 1, False))
        rope.torch = torch
        lig = _device_ms(lambda: liger_rotary_pos_emb(q, k, c, s))
    return out, inp, lig


print("| shape (b, hq, hk, t, d) | ours out of place | ours in place | Liger (in place) |")
print("|---|---|---|---|")
for shape in [(1, 32, 8, 2048, 128), (8, 32, 8, 2048, 128), (8, 16, 8, 2048, 128)]:
    out, inp, lig = measure(shape)
    print(f"| {shape} | {out * 1e3:.1f} us | {inp * 1e3:.1f} us | {lig * 1e3:.1f} us |", flush=True)
