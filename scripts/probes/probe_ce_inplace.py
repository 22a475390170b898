"""In-place CE check and launch-shape sweep (GPU): for a few launch shapes, the loss and the
gradient written over the logits against fp32 torch at 2048 x 151936; then the timing sweep of
bench_cases_losses.tune_ce, saved as ce_tune.json under $OUT.

    OUT=DIR python scripts/probes/probe_ce_inplace.py
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the bench harness
import bench_cases_losses as b  # noqa: E402

ce = b._ours("cross_entropy")
# correctness of each one-pass config against fp32 torch at a real shape
n, V = 2048, 151936
logits = torch.randn(n, V, device="cuda", dtype=torch.bfloat16) * 3
t = b._targets(n, V)
one = torch.ones(1, device="cuda")
ref_l = torch.nn.functional.cross_entropy(logits.float(), t, reduction="none", ignore_index=-100)
lf = logits.float().requires_grad_()
torch.nn.functional.cross_entropy(lf, t, reduction="sum", ignore_index=-100).backward()
for cfg in [
    ce.CEConfig(8192, 8192, 8, spin=True, one_pass=True),
    ce.CEConfig(16384, 16384, 16, spin=True, one_pass=True),
    ce.CEConfig(8192, 2048, 4, spin=True),
]:
    g = logits.clone()
    loss, _ = ce.ce_rows(g, t, g, one, config=cfg)
    le = ((loss - ref_l).abs().max() / ref_l.abs().max()).item()
    ge = ((g.float() - lf.grad).norm() / lf.grad.norm()).item()
    print("check", cfg, "loss rel", f"{le:.2e}", "grad rel", f"{ge:.2e}", flush=True)
cfg, rows = b.tune_ce()
print("BEST", cfg)
json.dump(rows, open(os.environ["OUT"] + "/ce_tune.json", "w"), indent=1, default=str)
