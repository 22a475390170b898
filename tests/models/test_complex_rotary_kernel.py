"""The complex (freqs_cis) rotary layers on the Triton kernel: Llama 4's and DeepSeek-V2's
apply_rotary_emb(xq, xk, freqs_cis), forward and backward, against the product of complex
numbers in float64. bf16 q/k with complex64 freqs is the case the families run in training:
their forward multiplies in fp32 and rounds once, and so must the kernel (fp32 cos/sin).

The kernel runs in Triton's CPU interpreter, which must be on before triton is imported: the
check runs in a child process (tests/models imports triton without it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

VARIANT = (
    Path(__file__).resolve().parents[2] / "hub_kernels/kernels-lab/training/build/torch-universal"
)

_CHECK = textwrap.dedent(
    """
    import importlib.util, sys
    import torch

    spec = importlib.util.spec_from_file_location(
        "_complex_rope_check", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]]
    )
    kt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kt
    spec.loader.exec_module(kt)
    assert kt.rope.use_triton(torch.empty(1)), "the interpreter is off: the torch path would run"

    def reference(x, freqs, time_dim):
        xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.to(torch.complex128).unsqueeze(3 - time_dim)).flatten(3)

    gen = torch.Generator().manual_seed(0)
    b, t, h, hk, d = 2, 5, 3, 1, 16
    # magnitudes off one: the rotary embedding's attention scaling is in freqs_cis
    freqs = torch.polar(torch.rand(b, t, d // 2, generator=gen) + 0.5,
                        torch.rand(b, t, d // 2, generator=gen) * 6)
    for layer, time_dim in (("complex_rotary_emb", 1), ("complex_rotary_emb_bhtd", 2)):
        for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            # q a strided view (DeepSeek-V2 splits q_pe off a wider projection)
            shape = lambda n: (b, t, n, d) if time_dim == 1 else (b, n, t, d)
            q = torch.randn(*shape(h)[:-1], 2 * d, generator=gen)[..., d:].to(dtype)
            k = torch.randn(shape(hk), generator=gen).to(dtype)
            q.requires_grad_(True); k.requires_grad_(True)
            fn = getattr(kt.layers, layer)()
            qo, ko = fn(q, k, freqs)
            assert qo.dtype == dtype and ko.dtype == dtype, (layer, qo.dtype)
            for got, x in ((qo, q), (ko, k)):
                want = reference(x.detach(), freqs, time_dim)
                err = (got.double() - want).abs().max() / want.abs().max()
                assert err <= rtol, (layer, dtype, float(err))
            # backward: d/dx of sum(w * rot(x)) is the inverse rotation of w scaled by |f|^2 / |f|
            wq, wk = torch.randn(qo.shape, generator=gen), torch.randn(ko.shape, generator=gen)
            ((qo.float() * wq).sum() + (ko.float() * wk).sum()).backward()
            for grad, w in ((q.grad, wq), (k.grad, wk)):
                wc = torch.view_as_complex(w.double().reshape(*w.shape[:-1], -1, 2))
                f = freqs.to(torch.complex128).unsqueeze(3 - time_dim).conj()
                want = torch.view_as_real(wc * f).flatten(3)
                err = (grad.double() - want).abs().max() / want.abs().max()
                assert err <= rtol, (layer, dtype, "grad", float(err))
    print("ok")
    """
)


def test_complex_rotary_layers_on_the_kernel_match_the_complex_product():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _CHECK, str(VARIANT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
