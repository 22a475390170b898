"""RMSNorm at wide rows and the gated MLP's memory: ours against Liger and F.rms_norm (GPU).

    python scripts/probes/probe_norms_glu_gpu.py                 # all sections, < 3 min on an H200
    python scripts/probes/probe_norms_glu_gpu.py --part cand     # some sections: e2e, cand, glu
    python scripts/probes/probe_norms_glu_gpu.py --part cand,e2e --explore  # picking geometries

bf16 throughout; times are the bench harness's (device time with host work hidden behind a
queued sleep kernel, L2 flushed; wall time is do_bench), memory is the extra peak of one warm
fwd+bwd above what is held before and after it. Sections, each one table:

- ``e2e``: RMSNorm {1024, 4096, 16384} x {8192, 16384} and 4096x4096 (ours as the layer runs it,
  Liger, F.rms_norm), fused add + RMSNorm and LayerNorm (ours, Liger) at 1024x8192, 4096x4096
  and 4096x16384. Each RMSNorm shape's ours is checked against an fp32 reference of the same
  bf16 inputs.
- ``cand``: the RMSNorm backward (kernel + dW column sum) alone at each geometry worth
  considering: the shipped candidates ("shipped", the first of each shape is the default),
  then with ``--explore`` proposals in no list ("proposed"): for hidden 8192 and 16384 every
  warps x RELOAD x STAGES combination, and two rows per iteration; with the size of its fp32 dW partials (Liger's: one row
  per SM). "(picked)" marks what the tuner picks, and every geometry's dx and dW are compared
  with the default geometry's. A geometry Triton or the GPU refuses (shared memory) is a row
  with its error. To ship a pick, reorder or trim that width's list in ``_bwd_candidates``
  (rms_norm.py): one line per width.
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
SMALL_SHAPES = [(1024, 8192), (4096, 4096), (4096, 16384)]  # fused add + RMSNorm, LayerNorm
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


def e2e(kt) -> list[dict]:
    keep = ["F.rms_norm", "liger", "ours"]
    rows = []
    for m, n in RMS_SHAPES:
        log(f"e2e RMSNorm {m}x{n}")
        case_rows = run_filtered(rms_norm_case(m, n), keep)
        check = check_rms_norm(kt, m, n)
        for r in case_rows:
            r["check"] = check if r["impl"] == "ours" else ""
        rows += case_rows
    for m, n in SMALL_SHAPES:
        log(f"e2e AddRMSNorm / LayerNorm {m}x{n}")
        rows += run_filtered(add_rms_norm_case(m, n), keep)
        rows += run_filtered(layer_norm_case(m, n), keep)
    return rows


# --- cand ---------------------------------------------------------------------------------------


def candidate_geometries(rn, m: int, n: int, explore: bool = False) -> list[tuple[str, dict]]:
    """(label, cfg): the shipped candidates (the default first), then (with `explore`)
    geometries in no list (one or more programs per SM)."""
    block_n = rn.next_pow2(n)
    m_pow2 = rn.next_pow2(m)

    def cfg(tile, warps, prefetch=False, acc_2d=False, reload=0, stages=1, per_sm=1):
        return rn._geometry(block_n, m_pow2, tile, warps, per_sm, prefetch, acc_2d, reload, stages)

    out = [("shipped", c) for c in rn.bwd_candidates(m, n, spread=True)]
    if not explore:
        return out
    if block_n <= 512:  # short rows: more warps, per-row dW partials, 1 to 4 tiles of 4096
        extra = [cfg(4096 * k, w, acc_2d=True) for k in (1, 2, 4) for w in (4, 8)]
    elif block_n <= 4096:  # one to four rows per iteration, register or asynchronous prefetch
        extra = [
            cfg(block_n * bm, w, p) for bm in (1, 2, 4) for w in (8, 16) for p in (False, True)
        ]
        extra += [cfg(block_n * bm, w, stages=s) for bm in (1, 2) for w in (8, 16) for s in (2, 3)]
        # more programs per SM (more rows in flight; dW partials grow by a row per SM each)
        extra += [cfg(block_n * bm, w, p, per_sm=k) for bm in (4, 8, 16) for w in (4, 8)
                  for p in (False, True) for k in (2, 4)]  # fmt: skip
        extra += [cfg(block_n * bm, 16, per_sm=1) for bm in (32, 64)]
    else:  # one or two rows per iteration: warps x RELOAD x STAGES, and register prefetch
        warps = (8, 16, 32) if block_n <= 8192 else (16, 32)  # 8 warps spill at 16384
        extra = [cfg(block_n, w, reload=r, stages=s) for w in warps
                 for r in ((0, 1, 2) if w >= 16 else (0, 1)) for s in (1, 2, 3)]  # fmt: skip
        extra += [cfg(block_n, w, True, reload=r) for w in (16, 32) for r in (0, 1, 2)]
        extra += [cfg(2 * block_n, w, reload=r, stages=s) for w in (16, 32) for r in (0, 1)
                  for s in (1, 2)]  # fmt: skip
    # An H200 grants a program 227 KiB of shared memory: larger STAGES buffers cannot launch.
    extra = [c for c in extra if rn.stage_bytes(c, n, 4) <= 220 * 1024]
    seen = [c for _, c in out]
    for c in extra:
        if c not in seen and c["BLOCK_M"] * block_n <= 65536:
            seen.append(c)
            out.append(("proposed", c))
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
    rn.backward(dy, x, w, rstd, numer, True)  # what the tuner picks (the first call times it)
    key = ("rms_bwd", m.bit_length(), n, x.dtype, dy.dtype, w.dtype, x.device, rn.LLAMA, True,
           False, False)  # fmt: skip
    picked = rn.cached_config(key)
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
            "label": label + (" (picked)" if c == picked else ""),
            "cfg": c, "ms": statistics.median(spans), "partial_mib": partial_mib(rn, m, n, c),
            "liger_mib": sms * n * 4 / 2**20,
            "check": f"dx {rel_err(dx, base_dx):.0e} dw {rel_err(dw, base_dw):.0e}",
        })  # fmt: skip
    return rows


def cand(kt, explore: bool, shapes: list[tuple[int, int]] | None = None) -> list[dict]:
    rows = []
    for m, n in shapes or CAND_SHAPES:
        log(f"cand RMSNorm backward {m}x{n}")
        rows += cand_shape(importlib.import_module(f"{kt.__name__}.rms_norm"), m, n, explore)
        torch.cuda.empty_cache()
    return rows


def cand_table(rows: list[dict]) -> str:
    lines = ["| shape | geometry | BLOCK_M | warps | per SM | prefetch | acc 2d | reload | "
             "stages | bwd ms | vs best | dW partials MiB (Liger) | vs default |",
             "|" + "---|" * 13]  # fmt: skip
    best: dict[str, float] = {}
    for r in rows:
        if "ms" in r:
            best[r["shape"]] = min(best.get(r["shape"], float("inf")), r["ms"])
    for r in rows:
        c = r["cfg"]
        geo = [str(c[k]) for k in ("BLOCK_M", "num_warps", "per_sm", "PREFETCH", "ACC_2D",
                                    "RELOAD", "STAGES")]  # fmt: skip
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
    parser.add_argument(
        "--part", default="all", help="all, or a comma-separated list of: cand, e2e, glu"
    )
    parser.add_argument(
        "--explore", action="store_true", help="cand: also geometries in no list (slower)"
    )
    parser.add_argument(
        "--shapes", default="", help="cand: these MxN shapes (e.g. 65536x1024) instead of its own"
    )
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    except ValueError:
        parser.error(f"--shapes: comma-separated MxN, e.g. 65536x1024; got {args.shapes}")
    parts = set(args.part.split(","))
    if not parts <= {"all", "cand", "e2e", "glu"}:
        parser.error(f"--part: all, or a comma-separated list of cand, e2e, glu; got {args.part}")
    if not torch.cuda.is_available():
        print("probe_norms_glu_gpu: needs a CUDA GPU; nothing to do on this machine")
        return
    kt = load_training_kernels()
    t0 = time.perf_counter()
    print(f"# probe_norms_glu_gpu ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    sections = [
        ("cand", "RMSNorm backward geometries", lambda: cand_table(cand(kt, args.explore, shapes))),
        ("e2e", "Norms, fwd+bwd", lambda: table(e2e(kt), ("check",))),
        ("glu", "Gated MLP", lambda: table(glu(kt), ("check",))),
    ]
    for part, title, run in sections:
        if "all" not in parts and part not in parts:
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
