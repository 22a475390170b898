"""Where does Liger's lead at small RoPE shapes come from? One table per shape: device time of the
RoPE forward (L2 flushed before each call) for variants of our kernel, each at its best launch
geometry found under the same cold-L2 timing, next to the shipped path (its geometry as
`pick_config` chose it), Liger, and a plain copy of q and k. GPU only.

Variants switch one difference from Liger's kernel at a time:
  half_cs   read only the first half of cos/sin (assumes the cat(freqs, freqs) layout)
  no_tmask  no token-range mask (the launch covers whole tokens only)
  const_hs  the head stride is the compile-time constant D (q, k laid out [B, T, H, D])
  lowp      rotate in the input dtype instead of float32
  flag      skip the second halves when a device flag (the halves check, run once) says so

    python scripts/probes/probe_rope_variants.py
"""

import itertools
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_harness import _device_ms, load_training_kernels  # noqa: E402
from liger_kernel.transformers.rope import liger_rotary_pos_emb  # noqa: E402

kt = load_training_kernels()
rope = sys.modules[kt.__name__ + ".rope"]
COMMON = sys.modules[kt.__name__ + "._common"]
DT = torch.bfloat16


@triton.jit
def _heads(X, XO, sx_h, sxo_h, H: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
           d, tok, n_tokens, c1, c2, s1, s2,
           NO_TMASK: tl.constexpr, CONST_HS: tl.constexpr, LOWP: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    if NO_TMASK:
        mask = (h < H)[:, None] & (d < HALF)[None, :]
    else:
        mask = ((h < H) & (h * 0 + tok < n_tokens))[:, None] & (d < HALF)[None, :]
    if CONST_HS:
        p = X + h[:, None] * (2 * HALF) + d[None, :]
        po = XO + h[:, None] * (2 * HALF) + d[None, :]
    else:
        p = X + h[:, None] * sx_h + d[None, :]
        po = XO + h[:, None] * sxo_h + d[None, :]
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    if not LOWP:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(po, o1.to(XO.dtype.element_ty), mask=mask)
    tl.store(po + HALF, o2.to(XO.dtype.element_ty), mask=mask)


@triton.jit
def _rope_variant(Q, K, QO, KO, COS, SIN, FLAG, n_tokens, T,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
                  sc_b, sc_t,
                  HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_T: tl.constexpr, HALF_CS: tl.constexpr, NO_TMASK: tl.constexpr,
                  CONST_HS: tl.constexpr, LOWP: tl.constexpr, USE_FLAG: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    if USE_FLAG:
        dup = d * 0 + tl.load(FLAG) != 0  # cos/sin halves equal: the second halves are not read
    for i in tl.static_range(BLOCK_T):
        tok = pid * BLOCK_T + i
        b = (tok // T).to(tl.int64)
        t = (tok % T).to(tl.int64)
        if NO_TMASK:
            cm = d < HALF
        else:
            cm = (d < HALF) & (d * 0 + tok < n_tokens)
        pc = COS + b * sc_b + t * sc_t + d
        ps = SIN + b * sc_b + t * sc_t + d
        c1 = tl.load(pc, mask=cm, other=0.0)
        s1 = tl.load(ps, mask=cm, other=0.0)
        if HALF_CS:
            c2 = c1
            s2 = s1
        elif USE_FLAG:
            c2 = tl.where(dup, c1, tl.load(pc + HALF, mask=cm & ~dup, other=0.0))
            s2 = tl.where(dup, s1, tl.load(ps + HALF, mask=cm & ~dup, other=0.0))
        else:
            c2 = tl.load(pc + HALF, mask=cm, other=0.0)
            s2 = tl.load(ps + HALF, mask=cm, other=0.0)
        if not LOWP:
            c1 = c1.to(tl.float32)
            c2 = c2.to(tl.float32)
            s1 = s1.to(tl.float32)
            s2 = s2.to(tl.float32)
        _heads(Q + b * sq_b + t * sq_t, QO + b * sqo_b + t * sqo_t, sq_h, sqo_h, HQ, BLOCK_HQ,
               HALF, d, tok, n_tokens, c1, c2, s1, s2, NO_TMASK, CONST_HS, LOWP)  # fmt: skip
        _heads(K + b * sk_b + t * sk_t, KO + b * sko_b + t * sko_t, sk_h, sko_h, HK, BLOCK_HK,
               HALF, d, tok, n_tokens, c1, c2, s1, s2, NO_TMASK, CONST_HS, LOWP)  # fmt: skip


VARIANTS = {
    "base": {},
    "half_cs": {"HALF_CS": True},
    "no_tmask": {"NO_TMASK": True},
    "const_hs": {"CONST_HS": True},
    "lowp": {"LOWP": True},
    "flag": {"USE_FLAG": True},
    "flag+lowp": {"USE_FLAG": True, "LOWP": True},
    "flag+no_tmask+const_hs": {"USE_FLAG": True, "NO_TMASK": True, "CONST_HS": True},
    "half_cs+no_tmask+const_hs": {"HALF_CS": True, "NO_TMASK": True, "CONST_HS": True},
    "all four": {"HALF_CS": True, "NO_TMASK": True, "CONST_HS": True, "LOWP": True},
}
GEOMETRIES = [{"BLOCK_T": bt, "num_warps": w} for bt, w in itertools.product((1, 2, 4), (2, 4, 8))]


def launch_variant(q, k, qo, ko, cos, sin, flags, geo, flag):
    b, hq, t, d = q.shape
    hk = k.shape[1]
    n = b * t
    cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
    assert cos.stride() == sin.stride()
    full = {"HALF_CS": False, "NO_TMASK": False, "CONST_HS": False, "LOWP": False}
    full |= {"USE_FLAG": False, **flags}
    _rope_variant[(triton.cdiv(n, geo["BLOCK_T"]),)](
        q, k, qo, ko, cos, sin, flag, n, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        cos.stride(0), cos.stride(1),
        HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d // 2),
        BLOCK_T=geo["BLOCK_T"], num_warps=geo["num_warps"], **full,
    )  # fmt: skip


def inputs(b, hq, hk, t, d):
    q = torch.randn(b, t, hq, d, device="cuda", dtype=DT).transpose(1, 2)
    k = torch.randn(b, t, hk, d, device="cuda", dtype=DT).transpose(1, 2)
    a = torch.rand(b, t, d // 2, device="cuda") * 100  # as bench_kernels: cos/sin [B, T, D]
    e = torch.cat((a, a), -1)
    return q, k, e.cos().to(DT), e.sin().to(DT)


def probe(shape) -> None:
    q, k, c, s = inputs(*shape)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    with torch.no_grad():
        flag = rope._check_halves(c, s)  # the shipped check
        assert flag.item() == 1
        launch_variant(q, k, qo, ko, c, s, {}, GEOMETRIES[0], flag)
        ref = qo.clone(), ko.clone()  # float32 math, one rounding: the exact check for the rest
        shipped = rope.rotate(q, k, c, s, 1, False)
        torch.testing.assert_close(shipped[0], ref[0], atol=0.1, rtol=0.05)
        torch.testing.assert_close(shipped[1], ref[1], atol=0.1, rtol=0.05)
        chosen = [v for k_, v in COMMON._CHOICES.items() if k_[0] == "rope"]
        rows = [("shipped (as tuned)", str(chosen[-1] if chosen else "first candidate"),
                 _device_ms(lambda: rope.rotate(q, k, c, s, 1, False)))]  # fmt: skip
        rows.append(
            ("(the halves check alone)", "32 rows", _device_ms(lambda: rope._check_halves(c, s)))
        )
        for name, flags in VARIANTS.items():
            best = None
            for geo in GEOMETRIES:
                if shape[0] * shape[3] % geo["BLOCK_T"] and flags.get("NO_TMASK"):
                    continue
                launch_variant(q, k, qo, ko, c, s, flags, geo, flag)
                tol = {"atol": 0.1, "rtol": 0.05} if flags.get("LOWP") else {"atol": 0, "rtol": 0}
                torch.testing.assert_close(qo, ref[0], **tol)
                torch.testing.assert_close(ko, ref[1], **tol)
                ms = _device_ms(
                    lambda f=flags, g=geo: launch_variant(q, k, qo, ko, c, s, f, g, flag)
                )
                if best is None or ms < best[1]:
                    best = (geo, ms)
            rows.append((name, f"BLOCK_T={best[0]['BLOCK_T']} warps={best[0]['num_warps']}",
                         best[1]))  # fmt: skip
        rows.append(("Liger (in place)", "1 token, 4 warps",
                     _device_ms(lambda: liger_rotary_pos_emb(q, k, c, s))))  # fmt: skip
        qk = torch.cat([q.reshape(-1), k.reshape(-1)])
        out = torch.empty_like(qk)
        rows.append(("copy of q and k", "torch", _device_ms(lambda: out.copy_(qk))))
    print(f"\n### q {shape[0]}x{shape[1]}x{shape[3]}x{shape[4]}, k {shape[2]} heads\n")
    print("| variant | best geometry (cold L2) | fwd us |")
    print("|---|---|---|")
    for name, geo, ms in rows:
        print(f"| {name} | {geo} | {ms * 1e3:.1f} |", flush=True)


def alternate(shapes, rounds: int = 5) -> None:
    """fwd+bwd exactly as bench_kernels times it, ours and Liger measured turn about."""
    import bench_cases_elementwise

    print(
        f"\n### fwd+bwd as bench_kernels times it, Liger and ours in turn, {rounds} rounds x 30 calls\n"
    )
    print("| shape | Liger median (min-max) us | ours median (min-max) us |")
    print("|---|---|---|")
    for shape in shapes:
        impls = {i.name: i for i in bench_cases_elementwise.rope_case(*shape).impls}
        runs = {name: impls[name].make()[1] for name in ("liger", "ours")}
        times = {name: [] for name in runs}
        for fwd_bwd in runs.values():
            fwd_bwd()  # compile and tune before the first timed round
        for _ in range(rounds):
            for name, fwd_bwd in runs.items():
                times[name].append(_device_ms(fwd_bwd) * 1e3)
        cells = [f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})" for t in times.values()]
        print(f"| {shape} | {cells[0]} | {cells[1]} |", flush=True)


SHAPES = [(1, 32, 8, 2048, 128), (8, 32, 8, 2048, 128), (8, 16, 8, 2048, 128)]
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
for shape in SHAPES:
    probe(shape)
alternate(SHAPES)
