"""RMSNorm at wide rows and the gated MLP's memory: ours against Liger and F.rms_norm (GPU).

    python scripts/probes/probe_norms_glu_gpu.py                 # all sections, < 3 min on an H200
    python scripts/probes/probe_norms_glu_gpu.py --part cand     # one section: e2e, cand or glu
    python scripts/probes/probe_norms_glu_gpu.py --part cand --explore  # + geometries in neither

bf16 throughout; times are the bench harness's (device time with host work hidden behind a
queued sleep kernel, L2 flushed; wall time is do_bench), memory is the extra peak of one warm
fwd+bwd above what is held before and after it. Sections, each one table:

- ``e2e``: RMSNorm {1024, 4096, 16384} x {8192, 16384} and 4096x4096 (ours as the layer runs it,
  with the default backward geometries "v1" and with "v2", Liger, F.rms_norm), fused add +
  RMSNorm and LayerNorm (the same ours, Liger) at 1024x8192 and 4096x4096. Each RMSNorm shape's
  ours is checked against an fp32 reference of the same bf16 inputs.
- ``cand``: the RMSNorm backward (kernel + dW column sum) alone at each geometry worth
  considering: family "v1" (the default), "v2" (KERNELS_NORM_BWD_GEOMETRIES=v2: dW partials one
  row per SM, as Liger's) and further proposals, with the size of its fp32 dW partials; the
  first row of each shape is v1's default, "(picked)" marks what v1's timing picks, and every
  geometry's dx and dW are compared with the default geometry's.
- ``glu``: the SwiGLU product at 16384x14336 and 16384x3072 (ours as the MLP layers run it,
  the functional default out of place, Liger), and whole MLPs at 16384 tokens: Llama's
  (hidden 4096 / 14336 and 1024 / 3072) and Phi-3's fused gate_up (3072 / 8192), ours as
  kernelize binds it against Liger's MLP class and the eager module, gradients checked against
  the eager module's.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
from bench_cases_elementwise import (  # noqa: E402
    DT,
    _closures,
    _liger,
    add_rms_norm_case,
    glu_case,
    layer_norm_case,
    rms_norm_case,
)
from bench_harness import (  # noqa: E402
    Case,
    Ceilings,
    Impl,
    _device_ms,
    load_training_kernels,
    run_case,
)

RMS_SHAPES = [(1024, 8192), (4096, 8192), (16384, 8192), (1024, 16384), (4096, 16384),
              (16384, 16384), (4096, 4096)]  # fmt: skip
SMALL_SHAPES = [(1024, 8192), (4096, 4096)]  # fused add + RMSNorm, LayerNorm
# Backward geometries: the task's shapes, plus anchors that must not get slower.
CAND_SHAPES = RMS_SHAPES + [(16384, 4096), (4096, 128), (262144, 128)]
ROUNDS = 3
CEIL = Ceilings(copy_gbps=4275.0, matmul_tflops=694.0)  # only the harness's floor column uses it


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| in fp32."""
    ref = ref.float()
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def verdict(rows: list[dict]) -> dict[str, str]:
    """Per row of ours: where it is behind the best peer (3 % ties) or Liger's memory."""
    peers = [r for r in rows if not r["impl"].startswith("ours") and "error" not in r]
    out = {}
    for r in rows:
        if not r["impl"].startswith("ours") or "error" in r or not peers:
            continue
        behind = []
        for key, what in (("fwd_bwd_ms", "device"), ("fwd_bwd_wall_ms", "wall")):
            best = min(peers, key=lambda p: p.get(key, float("inf")))
            if r.get(key, 0) > 1.03 * best.get(key, float("inf")):
                behind.append(f"{what} {r[key] / best[key]:.2f}x {best['impl']}")
        liger = next((p for p in peers if p["impl"] == "liger"), None)
        if liger is not None and r["extra_mib"] > liger["extra_mib"] + 0.5:
            behind.append(f"mem {r['extra_mib']:.1f} > liger {liger['extra_mib']:.1f} MiB")
        out[r["impl"]] = "; ".join(behind) or "ok"
    return out


def run_filtered(case: Case, keep: list[str], rounds: int = ROUNDS) -> list[dict]:
    case.impls = [i for i in case.impls if i.name in keep]
    rows = run_case(case, CEIL, rounds=rounds)
    for r in rows:
        r["op"], r["shape"] = case.op, case.shape
    marks = verdict(rows)
    for r in rows:
        r["verdict"] = marks.get(r["impl"], "")
    return rows


def table(rows: list[dict], extra_cols: tuple[str, ...] = ()) -> str:
    head = ["op", "shape", "impl", "fwd+bwd ms", "wall ms", "extra MiB", *extra_cols, "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['error']} |")
            continue
        cells = [r["op"], r["shape"], r["impl"], f"{r['fwd_bwd_ms']:.3f}",
                 f"{r['fwd_bwd_wall_ms']:.3f}", f"{r['extra_mib']:.1f}"]  # fmt: skip
        cells += [str(r.get(c, "")) for c in extra_cols] + [r.get("verdict", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- e2e ----------------------------------------------------------------------------------------


def check_rms_norm(kt, m: int, n: int) -> str:
    """Ours (the layer on a LlamaRMSNorm) against the fp32 module on the same bf16 values."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(n, eps=1e-6).to("cuda", DT)
    with torch.no_grad():
        mod.weight.normal_(1.0, 0.1)
    ref = LlamaRMSNorm(n, eps=1e-6).to("cuda", torch.float32)
    with torch.no_grad():
        ref.weight.copy_(mod.weight.float())
    x = torch.randn(m, n, device="cuda", dtype=DT, requires_grad=True)
    x32 = x.detach().float().requires_grad_()
    mod.forward = types.MethodType(kt.layers.RMSNorm.forward, mod)
    y, y32 = mod(x), ref(x32)
    dy = torch.randn_like(y)
    y.backward(dy)
    y32.backward(dy.float())
    errs = [rel_err(y, y32), rel_err(x.grad, x32.grad), rel_err(mod.weight.grad, ref.weight.grad)]
    ok = all(e < 2e-2 for e in errs)  # bf16: ~2^-8 per rounding, a few roundings
    return ("ok" if ok else "FAIL") + " (y {:.1e}, dx {:.1e}, dw {:.1e})".format(*errs)


def with_v2(case: Case, rn) -> Case:
    """`case` plus "ours v2": ours with the v2 backward geometries (its own tuned choices)."""
    ours = next(i for i in case.impls if i.name == "ours")

    def switched(fn):
        def run():
            before, rn.BWD_GEOMETRIES = rn.BWD_GEOMETRIES, "v2"
            try:
                return fn()
            finally:
                rn.BWD_GEOMETRIES = before

        return run

    def make():
        fwd, fwd_bwd = ours.make()
        return switched(fwd), switched(fwd_bwd)

    case.impls.append(Impl("ours v2", make))
    return case


def e2e(kt) -> list[dict]:
    rn = importlib.import_module(f"{kt.__name__}.rms_norm")
    keep = ["F.rms_norm", "liger", "ours", "ours v2"]
    rows = []
    for m, n in RMS_SHAPES:
        log(f"e2e RMSNorm {m}x{n}")
        case_rows = run_filtered(with_v2(rms_norm_case(m, n), rn), keep)
        check = check_rms_norm(kt, m, n)
        for r in case_rows:
            r["check"] = check if r["impl"] == "ours" else ""
        rows += case_rows
    for m, n in SMALL_SHAPES:
        log(f"e2e AddRMSNorm / LayerNorm {m}x{n}")
        rows += run_filtered(with_v2(add_rms_norm_case(m, n), rn), keep)
        rows += run_filtered(with_v2(layer_norm_case(m, n), rn), keep)
    return rows


# --- cand ---------------------------------------------------------------------------------------


def candidate_geometries(rn, m: int, n: int, explore: bool = False) -> list[tuple[str, dict]]:
    """(label, cfg): v1 (the default, in its order), then v2's geometries not in it, then (with
    `explore`) one-program-per-SM geometries in neither list."""
    block_n = rn.next_pow2(n)
    m_pow2 = rn.next_pow2(m)

    def cfg(block_m, warps, per_sm, prefetch, acc_2d=False):
        return {"BLOCK_M": max(1, min(block_m, m_pow2)), "num_warps": warps, "per_sm": per_sm,
                "PREFETCH": prefetch, "ACC_2D": acc_2d}  # fmt: skip

    shipped = [("v1", c) for c in rn.bwd_candidates(m, n, family="v1")]
    v2 = rn.bwd_candidates(m, n, family="v2")
    if block_n <= 512:  # short rows: one program per SM, more warps, per-row dW partials
        rows = 4096 // block_n
        extra = [cfg(rows * k, w, 1, False, True) for k in (1, 2, 4) for w in (4, 8)]
    else:  # wide rows: one program per SM, one to four rows per program-iteration
        sizes, warps = ((1, 2, 4), (8, 16)) if block_n <= 4096 else ((1, 2), (8, 16, 32))
        extra = [cfg(bm, w, 1, p) for bm in sizes for w in warps for p in (False, True)]
    seen = [c for _, c in shipped]
    out = list(shipped)
    for label, group in (("v2", v2), ("proposed", extra if explore else [])):
        for c in group:
            if c not in seen and c["BLOCK_M"] * block_n <= 65536:
                seen.append(c)
                out.append((label, c))
    return out


def partial_mib(rn, m: int, n: int, c: dict) -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = min(c["per_sm"] * sms, rn.cdiv(m, c["BLOCK_M"]))
    programs = rn.cdiv(m, rn.cdiv(m, programs))
    return programs * n * 4 / 2**20


def cand_shape(rn, m: int, n: int, explore: bool) -> list[dict]:
    """Every geometry's backward at one shape, timed in turns; checked against the default's."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    numer = (0.0, rn.LLAMA)
    x = torch.randn(m, n, device="cuda", dtype=DT)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(DT)
    dy = torch.randn(m, n, device="cuda", dtype=DT)
    _y, rstd, _s = rn.forward(x, w, 1e-6, numer)
    # What each family picks by timing (the first call tunes and caches it).
    picked = {}
    for family in rn.GEOMETRY_FAMILIES:
        before, rn.BWD_GEOMETRIES = rn.BWD_GEOMETRIES, family
        try:
            rn.backward(dy, x, w, rstd, numer, True)
        finally:
            rn.BWD_GEOMETRIES = before
        key = ("rms_bwd", m.bit_length(), n, x.dtype, dy.dtype, w.dtype, x.device, rn.LLAMA,
               True, False, False, family)  # fmt: skip
        picked[family] = rn.cached_config(key)
    rows, runs = [], []
    for label, c in candidate_geometries(rn, m, n, explore):
        dx = torch.empty_like(x)

        def fn(c=c, dx=dx):
            return rn.column_sum(rn._launch_bwd(dy, x, w, rstd, dx, numer, True, c), w.dtype)

        try:
            dw = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a geometry Triton rejects is reported
            rows.append({"shape": f"{m}x{n}", "label": label, "cfg": c, "error": str(exc)[:80]})
            continue
        runs.append((label, c, fn, dx, dw))
    base_dx, base_dw = runs[0][3], runs[0][4]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(ROUNDS):  # geometries take turns: a drift of the GPU favours none
        for spans, (_label, _c, fn, _dx, _dw) in zip(times, runs, strict=True):
            spans.append(_device_ms(fn))
    for spans, (label, c, _fn, dx, dw) in zip(times, runs, strict=True):
        rows.append({
            "shape": f"{m}x{n}",
            "label": label + "".join(f" ({f} picks)" for f, p in picked.items() if p == c),
            "cfg": c, "ms": statistics.median(spans), "partial_mib": partial_mib(rn, m, n, c),
            "liger_mib": sms * n * 4 / 2**20,
            "check": f"dx {rel_err(dx, base_dx):.0e} dw {rel_err(dw, base_dw):.0e}",
        })  # fmt: skip
    return rows


def cand(kt, explore: bool) -> list[dict]:
    rows = []
    for m, n in CAND_SHAPES:
        log(f"cand RMSNorm backward {m}x{n}")
        rows += cand_shape(importlib.import_module(f"{kt.__name__}.rms_norm"), m, n, explore)
        torch.cuda.empty_cache()
    return rows


def cand_table(rows: list[dict]) -> str:
    lines = ["| shape | geometry | BLOCK_M | warps | per SM | prefetch | acc 2d | bwd ms | "
             "vs best | dW partials MiB (Liger) | vs default |",
             "|" + "---|" * 11]  # fmt: skip
    best: dict[str, float] = {}
    for r in rows:
        if "ms" in r:
            best[r["shape"]] = min(best.get(r["shape"], float("inf")), r["ms"])
    for r in rows:
        c = r["cfg"]
        geo = [str(c["BLOCK_M"]), str(c["num_warps"]), str(c["per_sm"]), str(c["PREFETCH"]),
               str(c["ACC_2D"])]  # fmt: skip
        if "error" in r:
            lines.append(
                f"| {r['shape']} | {r['label']} | " + " | ".join(geo) + f" | {r['error']} |"
            )
            continue
        lines.append(
            f"| {r['shape']} | {r['label']} | " + " | ".join(geo)
            + f" | {r['ms']:.4f} | {r['ms'] / best[r['shape']]:.3f} | {r['partial_mib']:.2f}"
            f" ({r['liger_mib']:.2f}) | {r['check']} |"
        )  # fmt: skip
    return "\n".join(lines)


# --- glu ----------------------------------------------------------------------------------------


def mlp_case(kt, tokens: int, hidden: int, inter: int, fused: bool) -> tuple[Case, str]:
    """A whole MLP: the eager module, Liger's class, ours bound as kernelize binds it."""
    liger = _liger()
    if fused:
        from transformers.models.phi3.configuration_phi3 import Phi3Config
        from transformers.models.phi3.modeling_phi3 import Phi3MLP as Module

        config = Phi3Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
        layer = kt.layers.FusedSwiGLUMLP
    else:
        from transformers.models.llama.configuration_llama import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP as Module

        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
        layer = kt.layers.SwiGLUMLP
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Module(config).state_dict().items()}
    state = {k: torch.randn(s, device="cuda", dtype=DT) * 0.02 for k, s in shapes.items()}

    def build(which):
        with torch.device("cuda"):  # initialised on the GPU: seconds less than on the host
            if which == "liger":
                from liger_kernel.transformers.swiglu import LigerPhi3SwiGLUMLP, LigerSwiGLUMLP

                mod = (LigerPhi3SwiGLUMLP if fused else LigerSwiGLUMLP)(config)
            else:
                mod = Module(config)
        mod = mod.to(DT)
        mod.load_state_dict(state)
        if which == "ours":
            mod.forward = types.MethodType(layer.forward, mod)
        return mod

    def maker(which):
        def make():
            if which == "liger" and isinstance(liger, str):
                raise RuntimeError(liger)
            mod = build(which)
            x = torch.randn(tokens, hidden, device="cuda", dtype=DT, requires_grad=True)
            return _closures(lambda: mod(x), [x, *mod.parameters()])

        return make

    # Gradient check: ours against the eager module, same bf16 inputs and upstream gradient.
    x = torch.randn(tokens, hidden, device="cuda", dtype=DT)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=DT)
    grads = {}
    for which in ("eager", "ours"):
        mod, xi = build(which), x.clone().requires_grad_()
        mod(xi).backward(dy)
        grads[which] = [xi.grad, *(p.grad for p in mod.parameters())]
    errs = [rel_err(o, e) for o, e in zip(grads["ours"], grads["eager"], strict=True)]
    check = ("ok" if max(errs) < 3e-2 else "FAIL") + f" (max grad rel err {max(errs):.1e})"
    del grads
    impls = [Impl(w, maker(w)) for w in ("eager", "liger", "ours")]
    name = "Phi3 MLP (gate_up)" if fused else "Llama MLP"
    return Case(op=name, shape=f"{tokens} tok, {hidden}/{inter}", impls=impls), check


def glu(kt) -> list[dict]:
    rows = []
    for m, n in ((16384, 14336), (16384, 3072)):
        log(f"glu product {m}x{n}")
        case = glu_case(m, n, "silu")
        case_rows = run_filtered(case, ["liger", "ours", "ours out of place"])
        a = torch.randn(m, n, device="cuda", dtype=DT)
        b = torch.randn(m, n, device="cuda", dtype=DT)
        dc = torch.randn(m, n, device="cuda", dtype=DT)
        got = []
        for in_place in (True, False):
            la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
            kt.silu_mul(la * 1, lb * 1, in_place=in_place).backward(dc)
            got.append((la.grad, lb.grad))
        a32, b32 = a.float().requires_grad_(), b.float().requires_grad_()
        (torch.nn.functional.silu(a32) * b32).backward(dc.float())
        same = torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
        errs = max(rel_err(got[0][0], a32.grad), rel_err(got[0][1], b32.grad))
        check = f"{'ok' if same and errs < 2e-2 else 'FAIL'} (in place == out of place: {same}, " \
            f"vs fp32 {errs:.1e})"  # fmt: skip
        for r in case_rows:
            r["check"] = check if r["impl"] == "ours" else ""
        rows += case_rows
        del a, b, dc, got, a32, b32
        torch.cuda.empty_cache()
    for tokens, hidden, inter, fused in ((16384, 4096, 14336, False), (16384, 1024, 3072, False),
                                         (16384, 3072, 8192, True)):  # fmt: skip
        log(f"glu MLP {tokens} {hidden}/{inter} fused={fused}")
        case, check = mlp_case(kt, tokens, hidden, inter, fused)
        case_rows = run_filtered(case, ["eager", "liger", "ours"], rounds=1)
        for r in case_rows:
            r["check"] = check if r["impl"] == "ours" else ""
        rows += case_rows
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "e2e", "cand", "glu"], default="all")
    parser.add_argument(
        "--explore", action="store_true", help="cand: also geometries in neither family (slower)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_norms_glu_gpu: needs a CUDA GPU; nothing to do on this machine")
        return
    kt = load_training_kernels()
    t0 = time.perf_counter()
    print(f"# probe_norms_glu_gpu ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    sections = [
        ("cand", "RMSNorm backward geometries", lambda: cand_table(cand(kt, args.explore))),
        ("e2e", "Norms, fwd+bwd", lambda: table(e2e(kt), ("check",))),
        ("glu", "Gated MLP", lambda: table(glu(kt), ("check",))),
    ]
    for part, title, run in sections:
        if args.part not in ("all", part):
            continue
        try:
            body = run()
        except Exception:  # noqa: BLE001 - one failed section still leaves the others' tables
            body = "```\n" + traceback.format_exc() + "```"
        print(f"\n## {title}\n\n{body}", flush=True)
        torch.cuda.empty_cache()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
