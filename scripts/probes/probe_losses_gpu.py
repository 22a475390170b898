"""Cross-entropy and fused linear CE variants side by side on one GPU (about 3 minutes, H200).

    python scripts/probes/probe_losses_gpu.py [--out DIR] [--budget-s 170] [--no-compile]

Every row is a full call as a training step makes it (loss forward, then autograd.grad of the
loss, bf16 inputs, 5 % ignored targets): device time (bench_harness._device_ms: host work hidden
behind a queued sleep kernel, L2 flushed, median) and wall time (triton's do_bench, median).
Each of our variants is a `CEConfig` that the cross-entropy module's `default_config` is
patched to return, so the fused linear CE runs it too. Each variant's loss and gradients are
checked against the default's on the same inputs (bf16: gradients within 1e-2, the loss within
1e-5, relative); a failed check is printed in the row and the variant never wins.

Stages (a later stage is skipped once --budget-s is spent; with 37 variants at the anchor give it
--budget-s 400 to reach every stage):
1. every CE variant at 8192 x 151936 (the issue's anchor), plus Liger and torch.compile;
2. the default and the three fastest variants of stage 1 at 4096 x 256000, 8192 x 32000,
   8192 x 262144 and 8192 x 50257 (a row length that is not a multiple of 8), plus Liger;
3. the backward's scale kernel alone (grad_output 1: the skip; 2: a full pass);
4. fused linear CE at N16384 H1024 V151936 and N8192 H2048 V256000 with the default and the
   two fastest CE variants, plus Liger and torch.compile, and one chunk's steps timed apart.
One table at the end (and JSON under --out).

``--confirm NAME,...`` instead times the default and the named variants at every shape of the
ce sweep and four FLCE shapes, against Liger (about 2 minutes).

``--host`` instead asks where a call's wall time beyond its device time goes (about a minute), at
the CE anchor, CE 8192 x 32000 and the two FLCE shapes, with the default config: the syncs one
call makes (set_sync_debug_mode("warn")), the host time of one call issued behind a long sleep
kernel (a sync inside the call would show as the sleep's length), device time, do_bench wall time
as the harness takes it (rep 50 ms: a single sample for a 25 ms call) and with rep 1000 ms, the
median of 10 calls run back to back behind one sleep (no host gap possible; with and without an
L2 flush between calls), and the SM clock and power draw read while those calls run. Back to back
close to wall and above device time: the GPU runs slower under sustained load, not the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
import bench_cases_losses as b  # noqa: E402
from bench_harness import _device_ms, _sleep_cycles_per_ms, _wall_ms  # noqa: E402

ce = b._ours("cross_entropy")
fl = b._ours("fused_linear_cross_entropy")
ORIGINAL_DEFAULT = ce.default_config
C = ce.CEConfig


def variants() -> dict[str, object]:
    """name -> CEConfig (None: the shipped default). The candidates around the default come
    first; the queue and pair schedules last (2.0-3.1 ms at the anchor on 12:13 UTC)."""
    return {
        "default": None,
        # the default before issue 17's probe run of 12:13 UTC, and the default itself again
        # (the second copy measures the noise)
        "old kernel spin 8192/2048 w4": C(8192, 2048, 4, spin=True),
        "lean spin 8192/2048 w4 r40": C(8192, 2048, 4, spin=True, lean=True, maxnreg=40),
        "lean spin 8192/2048 w4": C(8192, 2048, 4, spin=True, lean=True),
        # around the default: registers, chunk and block sizes, warps, re-read order, L2 hints
        "lean spin 8192/2048 w4 r32": C(8192, 2048, 4, spin=True, lean=True, maxnreg=32),
        "lean spin 8192/2048 w4 r48": C(8192, 2048, 4, spin=True, lean=True, maxnreg=48),
        "lean spin 16384/2048 w4 r40": C(16384, 2048, 4, spin=True, lean=True, maxnreg=40),
        "lean spin 4096/2048 w4 r40": C(4096, 2048, 4, spin=True, lean=True, maxnreg=40),
        "lean spin 8192/1024 w4 r40": C(8192, 1024, 4, spin=True, lean=True, maxnreg=40),
        "lean spin 8192/2048 w2 r40": C(8192, 2048, 2, spin=True, lean=True, maxnreg=40),
        "lean spin 8192/2048 w8 r40": C(8192, 2048, 8, spin=True, lean=True, maxnreg=40),
        "lean spin 8192/4096 w8 r40": C(8192, 4096, 8, spin=True, lean=True, maxnreg=40),
        "lean spin 8192/2048 w4 r40 reverse": C(
            8192, 2048, 4, spin=True, lean=True, maxnreg=40, reverse=True
        ),
        "lean spin 8192/2048 w4 r40 evict": C(
            8192, 2048, 4, spin=True, lean=True, maxnreg=40, evict=True
        ),
        "lean spin 8192/2048 w4 evict": C(8192, 2048, 4, spin=True, lean=True, evict=True),
        # one block per chunk, spinning: all of a chunk's loads issued at once (only the queue
        # was tried so; the row's re-read is then one load per program)
        "lean spin 8192/8192 w8": C(8192, 8192, 8, spin=True, lean=True),
        "lean spin 8192/8192 w8 r64": C(8192, 8192, 8, spin=True, lean=True, maxnreg=64),
        "lean spin 4096/4096 w4": C(4096, 4096, 4, spin=True, lean=True),
        "lean spin 4096/4096 w8 r40": C(4096, 4096, 8, spin=True, lean=True, maxnreg=40),
        # persistent grids (k programs per SM looping over tiles from the ticket counter): one
        # CTA launch per program instead of per tile (155 k tiles at the anchor)
        "lean spin 8192/2048 w4 r40 persist8": C(
            8192, 2048, 4, spin=True, lean=True, maxnreg=40, persist=8
        ),
        "lean spin 8192/2048 w4 r40 persist12": C(
            8192, 2048, 4, spin=True, lean=True, maxnreg=40, persist=12
        ),
        "lean queue 8192/2048 w4 r32 persist12": C(
            8192, 2048, 4, lean=True, queue=True, maxnreg=32, persist=12
        ),
        # uncapped, the persistent loop needs 64 registers (sm_90, triton 3.9): exactly 8 per SM
        "lean spin 8192/2048 w4 persist8": C(8192, 2048, 4, spin=True, lean=True, persist=8),
        # one block per chunk, 63 registers on 8 warps: 4 programs per SM, 16 KB loads each
        "lean spin 8192/8192 w8 persist4": C(8192, 8192, 8, spin=True, lean=True, persist=4),
        # the queue schedule (any device) and its pair form, all slower on 12:13 UTC
        "lean queue 8192/2048 w4 lag4": C(8192, 2048, 4, lean=True, queue=True),
        "lean queue 8192/2048 w4 lag1": C(8192, 2048, 4, lean=True, queue=True, lag=1),
        "lean queue 8192/2048 w4 evict": C(8192, 2048, 4, lean=True, queue=True, evict=True),
        "lean queue 8192/2048 w4 reverse": C(8192, 2048, 4, lean=True, queue=True, reverse=True),
        "lean queue 8192/4096 w8": C(8192, 4096, 8, lean=True, queue=True),
        "lean queue 16384/4096 w8": C(16384, 4096, 8, lean=True, queue=True),
        # at most 32 registers per thread (no spills for the queue): 16 programs per SM, not 9
        "lean queue 8192/2048 w4 r32": C(8192, 2048, 4, lean=True, queue=True, maxnreg=32),
        "lean queue 4096/2048 w4 r32": C(4096, 2048, 4, lean=True, queue=True, maxnreg=32),
        "lean queue 16384/2048 w4 r32": C(16384, 2048, 4, lean=True, queue=True, maxnreg=32),
        # one program does a reduce task, then the write task lag rows back: half the tickets
        "lean pair 8192/2048 w4": C(8192, 2048, 4, lean=True, queue=True, pair=True),
        "lean pair 8192/2048 w4 r32": C(
            8192, 2048, 4, lean=True, queue=True, pair=True, maxnreg=32
        ),
        # one block per chunk: all of a chunk's loads in flight at once
        "lean queue 4096/4096 w4": C(4096, 4096, 4, lean=True, queue=True),
        "lean queue 8192/8192 w8": C(8192, 8192, 8, lean=True, queue=True),
    }


# Tasks by program id instead of a start-order ticket: these wait on siblings that only the GPU's
# in-order dispatch of programs guarantees to be running, so they run last, after everything
# else is printed (a hang there costs nothing measured before it).
BY_PROGRAM_ID = {
    "lean spin 8192/2048 w4 pid": C(8192, 2048, 4, spin=True, lean=True, ticket=False),
    "lean queue 8192/2048 w4 pid": C(8192, 2048, 4, lean=True, queue=True, ticket=False),
    # the default without its ticket atomic (155 k atomics on one address at the anchor)
    "lean spin 8192/2048 w4 r40 pid": C(
        8192, 2048, 4, spin=True, lean=True, maxnreg=40, ticket=False
    ),
    # a fixed grid of 8 programs per SM, tiles pid, pid + grid, ...: needs the grid resident
    "lean spin 8192/2048 w4 r40 persist8 pid": C(
        8192, 2048, 4, spin=True, lean=True, maxnreg=40, persist=8, ticket=False
    ),
}


def use(cfg) -> None:
    ce.default_config = ORIGINAL_DEFAULT if cfg is None else (lambda vocab, device, c=cfg: c)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def timed(fn) -> dict:
    fn()  # compile / warm
    torch.cuda.synchronize()
    return {"device_ms": _device_ms(fn), "wall_ms": _wall_ms(fn)}


def ce_inputs(n: int, vocab: int):
    torch.manual_seed(0)
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    return logits, b._targets(n, vocab)


def ce_once(logits, target):
    x = logits.clone().requires_grad_(True)
    loss = ce.cross_entropy(x, target)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


def ce_rows_for(name, cfg, logits, target, ref) -> dict:
    row = {"op": "CE", "shape": f"{logits.shape[0]}x{logits.shape[1]}", "impl": name}
    try:
        use(cfg)
        loss, g = ce_once(logits, target)
        if ref is not None:
            row["loss_rel"], row["grad_rel"] = rel(loss, ref[0]), rel(g, ref[1])
            row["ok"] = row["loss_rel"] < 1e-5 and row["grad_rel"] < 1e-2
        del g
        x = logits.clone().requires_grad_(True)
        row.update(timed(lambda: torch.autograd.grad(ce.cross_entropy(x, target), x)))
    except Exception as exc:  # noqa: BLE001 - one variant failing is a result, not the end
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    finally:
        use(None)
    print(row, flush=True)
    return row


def ce_peer(name, logits, target, compiled=False) -> dict:
    row = {"op": "CE", "shape": f"{logits.shape[0]}x{logits.shape[1]}", "impl": name}
    try:
        x = logits.clone().requires_grad_(True)
        if name == "liger":
            from liger_kernel.transformers.functional import liger_cross_entropy

            def fn():
                return torch.autograd.grad(liger_cross_entropy(x, target, ignore_index=-100), x)
        else:
            f = torch.compile(b._eager_ce, dynamic=False)

            def fn():
                return torch.autograd.grad(f(x, target), x)

        row.update(timed(fn))
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    print(row, flush=True)
    return row


def flce_inputs(n, h, v):
    torch.manual_seed(0)
    hid = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h**-0.5).requires_grad_()
    return hid, w, b._targets(n, v)


def flce_row(name, cfg, hid, w, t, ref, peer=None) -> dict:
    row = {"op": "FLCE", "shape": f"N{hid.shape[0]} H{hid.shape[1]} V{w.shape[0]}", "impl": name}
    try:
        if peer == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            def fn():
                return torch.autograd.grad(liger_fused_linear_cross_entropy(hid, w, t), [hid, w])
        elif peer == "torch.compile":
            f = torch.compile(b._eager_flce, dynamic=False)

            def fn():
                return torch.autograd.grad(f(hid, w, t), [hid, w])
        else:
            use(cfg)

            def fn():
                return torch.autograd.grad(fl.fused_linear_cross_entropy(hid, w, t), [hid, w])

            loss = fl.fused_linear_cross_entropy(hid, w, t)
            dh, dw = torch.autograd.grad(loss, [hid, w])
            if ref is not None:
                row["loss_rel"] = rel(loss, ref[0])
                row["grad_rel"] = max(rel(dh, ref[1]), rel(dw, ref[2]))
                row["ok"] = row["loss_rel"] < 1e-5 and row["grad_rel"] < 1e-2
            else:
                ref = (loss.detach(), dh, dw)
            row["_ref"] = ref
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        row["extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20 - sum(
            o.numel() * o.element_size() for o in out
        ) / 2**20
        del out
        row.update(timed(fn))
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    finally:
        use(None)
    print({k: v for k, v in row.items() if k != "_ref"}, flush=True)
    return row


def breakdown(cfg_name, cfg, n, h, v) -> dict:
    """One FLCE chunk's four steps timed apart (the CE kernel with `cfg`)."""
    use(cfg)
    try:
        return b._breakdown_one(n, h, v) | {"ce": cfg_name}
    finally:
        use(None)


def scale_rows() -> list[dict]:
    """The backward's in-place scale kernel alone over 8192 x 151936 bf16."""
    buf = torch.randn(8192, 151936, device="cuda", dtype=torch.bfloat16)
    out = []
    for g in (1.0, 2.0):
        go = torch.full((), g, device="cuda")

        def fn(go=go):
            ce.scale_rows_(buf, go)

        row = {"op": "scale_rows_", "shape": "8192x151936", "impl": f"grad_output {g}"}
        row.update(device_ms=_device_ms(fn), wall_ms=_wall_ms(fn))
        print(row, flush=True)
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| op | shape | impl | device ms | wall ms | extra MiB | loss rel | grad rel | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | error: {r['error']} |||||")
            continue
        chk = "" if "ok" not in r else ("ok" if r["ok"] else "FAIL")
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['impl']} | {r['device_ms']:.3f} | "
            f"{r['wall_ms']:.3f} | {r.get('extra_mib', float('nan')):.0f} | "
            f"{r.get('loss_rel', float('nan')):.1e} | {r.get('grad_rel', float('nan')):.1e} "
            f"| {chk} |"
        )
    return "\n".join(lines)


CONFIRM_CE = [(8192, v) for v in (32000, 50257, 128256, 151936, 262144)] + [
    (2048, 151936),
    (16384, 128256),
    (4096, 256000),
]
CONFIRM_FLCE = [(16384, 1024, 151936), (8192, 2048, 256000), (8192, 2048, 32000),
                (8192, 2048, 128256)]  # fmt: skip


def confirm(names: list[str], args) -> int:
    """The default and the named variants at every shape of the sweeps, with Liger."""
    table_vars = variants() | BY_PROGRAM_ID
    unknown = [n for n in names if n not in table_vars]
    if unknown:
        print(f"unknown variants {unknown}; known: {list(table_vars)}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    for n, v in CONFIRM_CE:
        logits, t = ce_inputs(n, v)
        use(None)
        ref = ce_once(logits, t)
        for name in ["default", *names]:
            cfg = table_vars[name]
            rows.append(ce_rows_for(name, cfg, logits, t, ref if cfg is not None else None))
        rows.append(ce_peer("liger", logits, t))
        del logits, ref
        torch.cuda.empty_cache()
    for n, h, v in CONFIRM_FLCE:
        hid, w, t = flce_inputs(n, h, v)
        first = flce_row("default", None, hid, w, t, None)
        ref = first.pop("_ref", None)
        rows.append(first)
        for name in names:
            r = flce_row(name, table_vars[name], hid, w, t, ref)
            r.pop("_ref", None)
            rows.append(r)
        rows.append(flce_row("liger", None, hid, w, t, None, peer="liger"))
        del hid, w, t, ref
        torch.cuda.empty_cache()
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_losses_confirm.json").write_text(json.dumps(rows, indent=1, default=str))
        (args.out / "probe_losses_confirm.md").write_text(table(rows) + "\n")
    return 0


def _sleep(ms: float) -> None:
    torch.cuda._sleep(int(_sleep_cycles_per_ms() * ms))


def _gpu_readings() -> dict:
    """SM clock (MHz) and power (W) now, where torch can read them (pynvml)."""
    out = {}
    for key, read in (("sm_mhz", torch.cuda.clock_rate), ("power_w", torch.cuda.power_draw)):
        try:
            value = read()
            out[key] = value / 1000 if key == "power_w" else value  # power_draw is in mW
        except Exception:  # noqa: BLE001 - no pynvml: the reading is left out
            pass
    return out


def host_gap_row(op: str, shape: str, fn) -> dict:
    """Where fn()'s wall time beyond its device time goes (see the module docstring)."""
    import warnings

    row: dict = {"op": op, "shape": shape, "impl": "default"}
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    syncs = [str(w.message).splitlines()[0][:80] for w in seen if "synchroniz" in str(w.message)]
    row["syncs"] = len(syncs)
    if syncs:
        row["first_sync"] = syncs[0]
    # Host time of one call with the GPU busy for 200 ms: a sync inside would wait that out.
    _sleep(200.0)
    t0 = time.perf_counter()
    fn()
    row["host_ms"] = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    row["device_ms"] = _device_ms(fn)
    row["wall_ms"] = _wall_ms(fn)
    from triton.testing import do_bench

    row["wall_ms_rep1000"] = do_bench(fn, warmup=100, rep=1000, return_mode="median")
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for flush in (False, True):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(10)
        ]
        _sleep(min(500.0, 20 * row["host_ms"] + 5))  # the host queues all 10 calls first
        for start, end in events:
            if flush:
                cache.zero_()
            start.record()
            fn()
            end.record()
        readings = [_gpu_readings() for _ in range(3)]  # while the queued calls run
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        key = "back_to_back_flushed_ms" if flush else "back_to_back_ms"
        row[key] = times[len(times) // 2]
        for k in ("sm_mhz", "power_w"):
            vals = [r[k] for r in readings if k in r]
            if vals:
                row[f"{k}_{'flushed' if flush else 'b2b'}"] = max(vals)
    row.update({f"{k}_idle": v for k, v in _gpu_readings().items()})
    print(row, flush=True)
    return row


def host_gaps(args) -> int:
    """--host: the default's wall-versus-device gap, taken apart (module docstring)."""
    rows = []
    for n, v in ((8192, 151936), (8192, 32000)):
        logits, t = ce_inputs(n, v)
        x = logits.clone().requires_grad_(True)
        rows.append(
            host_gap_row(
                "CE", f"{n}x{v}", lambda x=x, t=t: torch.autograd.grad(ce.cross_entropy(x, t), x)
            )
        )
        del logits, x
        torch.cuda.empty_cache()
    for n, h, v in ((16384, 1024, 151936), (8192, 2048, 256000)):
        hid, w, t = flce_inputs(n, h, v)

        def fn(hid=hid, w=w, t=t):
            return torch.autograd.grad(fl.fused_linear_cross_entropy(hid, w, t), [hid, w])

        rows.append(host_gap_row("FLCE", f"N{n} H{h} V{v}", fn))
        del hid, w, t
        torch.cuda.empty_cache()
    keys = ["syncs", "host_ms", "device_ms", "wall_ms", "wall_ms_rep1000", "back_to_back_ms",
            "back_to_back_flushed_ms", "sm_mhz_b2b", "power_w_b2b", "sm_mhz_idle"]  # fmt: skip
    lines = ["| op | shape | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        lines.append(f"| {r['op']} | {r['shape']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_losses_host.json").write_text(json.dumps(rows, indent=1, default=str))
        (args.out / "probe_losses_host.md").write_text("\n".join(lines) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=170.0)
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument(
        "--host",
        action="store_true",
        help="instead: where the default's wall time beyond its device time goes (syncs, host "
        "time, back-to-back device time, clocks) at two CE and two FLCE shapes",
    )
    ap.add_argument(
        "--confirm",
        default="",
        help="comma-separated variant names: time only these and the default, at every CE shape "
        "of the ce sweep and four FLCE shapes, against Liger (no torch.compile)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_losses_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.host:
        return host_gaps(args)
    if args.confirm:
        return confirm([n for n in args.confirm.split(",") if n], args)
    t_end = time.monotonic() + args.budget_s
    torch._dynamo.config.cache_size_limit = 64
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    print(env, flush=True)
    rows: list[dict] = []

    # 1. every variant at the anchor
    logits, t = ce_inputs(8192, 151936)
    use(None)
    ref = ce_once(logits, t)
    anchor = []
    for name, cfg in variants().items():
        if time.monotonic() > t_end:
            break
        anchor.append(ce_rows_for(name, cfg, logits, t, ref if cfg is not None else None))
    rows += anchor
    rows.append(ce_peer("liger", logits, t))
    if not args.no_compile and time.monotonic() < t_end - 100:
        rows.append(ce_peer("torch.compile", logits, t))
    del logits, ref
    good = [r for r in anchor if r["impl"] != "default" and r.get("ok") and "error" not in r]
    best = [r["impl"] for r in sorted(good, key=lambda r: r["device_ms"])[:3]]
    print("fastest variants at the anchor:", best, flush=True)
    table_vars = variants()

    # 2. the other CE shapes
    for n, v in ((4096, 256000), (8192, 32000), (8192, 262144), (8192, 50257)):
        if time.monotonic() > t_end - 60:
            break
        logits, t = ce_inputs(n, v)
        use(None)
        ref = ce_once(logits, t)
        for name in ["default", *best]:
            cfg = table_vars[name]
            rows.append(ce_rows_for(name, cfg, logits, t, ref if cfg is not None else None))
        rows.append(ce_peer("liger", logits, t))
        del logits, ref
        torch.cuda.empty_cache()

    # 3. the backward's scale kernel alone
    rows += scale_rows()
    torch.cuda.empty_cache()

    # 4. fused linear CE
    parts = []
    for n, h, v in ((16384, 1024, 151936), (8192, 2048, 256000)):
        if time.monotonic() > t_end - 25:
            break
        hid, w, t = flce_inputs(n, h, v)
        first = flce_row("default", None, hid, w, t, None)
        ref = first.pop("_ref", None)
        rows.append(first)
        for name in best[:2]:
            r = flce_row(name, table_vars[name], hid, w, t, ref)
            r.pop("_ref", None)
            rows.append(r)
        rows.append(flce_row("liger", None, hid, w, t, None, peer="liger"))
        if not args.no_compile and time.monotonic() < t_end - 40:
            rows.append(flce_row("torch.compile", None, hid, w, t, None, peer="torch.compile"))
        for r in rows[-5:]:
            r.pop("_ref", None)
        del hid, w, t, ref
        torch.cuda.empty_cache()
        for name in ["default", *best[:1]]:
            parts.append(breakdown(name, table_vars[name], n, h, v))
            print(parts[-1], flush=True)
        torch.cuda.empty_cache()

    if time.monotonic() < t_end:
        logits, t = ce_inputs(8192, 151936)
        use(None)
        ref = ce_once(logits, t)
        for name, cfg in BY_PROGRAM_ID.items():
            rows.append(ce_rows_for(name, cfg, logits, t, ref))
        del logits, ref
    print(json.dumps(env))
    print(table(rows))
    for p in parts:
        print("FLCE chunk breakdown:", {k: round(x, 4) if isinstance(x, float) else x
                                        for k, x in p.items()})  # fmt: skip
    print(f"done in {args.budget_s - (t_end - time.monotonic()):.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_losses_gpu.json").write_text(
            json.dumps({"env": env, "rows": rows, "flce_breakdown": parts}, indent=1, default=str)
        )
        (args.out / "probe_losses_gpu.md").write_text(json.dumps(env) + "\n\n" + table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
