"""Does the RMSNorm forward's tuner pick the geometry that is fastest inside a CUDA graph (GPU)?

For each wide-row shape: every forward candidate, forced, and Inductor's compiled module, timed
in alternating turns inside a CUDA graph of 32 calls (each call allocates its outputs, as a
model's step does); then the pick of three ways a tuner could time the candidates:

  events    what pick_config does: one launch between two CUDA events, behind a sleep kernel,
            median of 5 rounds (run three times, fresh each time)
  graph     each candidate as replays of a captured graph of 16 calls, alternating, 5 rounds
  graph-1   the same, but all 16 launches write one set of outputs (what a tuner's launch does)
  span      16 launches between two events behind a sleep kernel, each into new outputs

bf16, LLAMA casting, a weight, no grad.

    python scripts/probes/probe_norm_fwd_tuner_gpu.py
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_norm_fwd_ab_gpu import llama_norm_case, norm_modules  # noqa: E402
from probe_norm_fwd_wide_gpu import round_times  # noqa: E402

SHAPES = [
    (1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096),
    (1024, 8192), (4096, 8192), (1024, 16384), (4096, 16384),
]  # fmt: skip


def name(c: dict) -> str:
    return f"{c['BLOCK_M']}r{c['num_warps']}w"


def pick_events(rms, common, x, w) -> str:
    for k in [k for k in common._CHOICES if k[0] == "rms_fwd"]:
        del common._CHOICES[k]
    rms._FORWARD_PLANS.clear()
    rms.forward(x, w, 1e-6, False)
    torch.cuda.synchronize()
    return name([v for k, v in common._CHOICES.items() if k[0] == "rms_fwd"][0])


def pick_graph(rms, x, w, cands, rounds=5) -> str:
    impls = {name(c): lambda x, c=c: rms.forward(x, w, 1e-6, False, cfg=c)[0] for c in cands}
    times = round_times(impls, x, rounds, ops=16, replays=3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return min(med, key=med.get)


def pick_graph_one_output(rms, x, w, cands, rounds=5) -> str:
    plan = rms._ForwardPlan(x, w, 1e-6, False, None)
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    args = (x, x, w, y, y, rstd, *plan.scalars)
    launches = {name(c): plan._choose(args, c) for c in cands}
    impls = {k: lambda _x, f=f: f(*args) for k, f in launches.items()}
    times = round_times(impls, x, rounds, ops=16, replays=3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return min(med, key=med.get)


def pick_span(rms, x, w, cands, rounds=5, k=16) -> str:
    times = {name(c): [] for c in cands}
    keep = []
    for _ in range(rounds):
        for c in cands:
            torch.cuda._sleep(5_000_000)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(k):
                keep.append(rms.forward(x, w, 1e-6, False, cfg=c))
            e1.record()
            times[name(c)].append((e0, e1))
        torch.cuda.synchronize()
        keep.clear()
    med = {n: statistics.median(a.elapsed_time(b) for a, b in v) for n, v in times.items()}
    return min(med, key=med.get)


def main(rounds: int = 9) -> None:
    rms, common = norm_modules()
    torch.manual_seed(0)
    rows = []
    for m, n in SHAPES:
        x, mod, w = llama_norm_case(m, n)
        cands = rms.fwd_candidates(m, n)
        with torch.no_grad():
            compiled = torch.compile(mod)
            compiled(x)
            impls = {"inductor": compiled}
            for c in cands:
                rms.forward(x, w, 1e-6, False, cfg=c)
                impls[name(c)] = lambda x, c=c, w=w: rms.forward(x, w, 1e-6, False, cfg=c)[0]
            times = round_times(impls, x, rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            picks = {
                "events": [pick_events(rms, common, x, w) for _ in range(3)],
                "graph": [pick_graph(rms, x, w, cands) for _ in range(2)],
                "graph-1": [pick_graph_one_output(rms, x, w, cands) for _ in range(2)],
                "span": [pick_span(rms, x, w, cands) for _ in range(2)],
            }
        best = min((k for k in med if k != "inductor"), key=med.get)
        ind = med["inductor"]
        cells = " ".join(f"{k} {v:.2f}" for k, v in med.items() if k != "inductor")
        pick_cells = " | ".join(
            ",".join(f"{p} ({med[p] / ind:.3f}x)" for p in ps) for ps in picks.values()
        )
        rows.append(
            f"| {m}x{n} | {ind:.2f} | {cells} | {best} {med[best] / ind:.3f}x | {pick_cells} |"
        )
        print(rows[-1], flush=True)
    print("\n| shape | Inductor µs | ours per candidate µs | best / Inductor | picks: events x3 "
          "| graph x2 | graph-1 x2 | span x2 (each / Inductor) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
