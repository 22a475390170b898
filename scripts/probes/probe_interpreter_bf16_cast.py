"""How the Triton interpreter converts fp32 to bf16 (CPU): round-to-nearest as torch and the
GPU do, or truncation? Explains one-bf16-step differences between a kernel run under
TRITON_INTERPRET=1 and torch's own bf16 result (e.g. our RMSNorm against HF's module).

    TRITON_INTERPRET=1 python scripts/probes/probe_interpreter_bf16_cast.py
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _cast(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tl.load(X + i).to(tl.bfloat16))


def main(n: int = 4096) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    y = torch.empty(n, dtype=torch.bfloat16)
    _cast[(1,)](x, y, N=n)
    nearest = x.to(torch.bfloat16)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {n} random fp32 values")
    print(f"equal to torch's round-to-nearest: {(y == nearest).float().mean().item():.1%}")
    print(f"equal to truncation:               {(y == truncated).float().mean().item():.1%}")


if __name__ == "__main__":
    main()
