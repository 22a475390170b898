"""Is the GPU DPO test's loss rule well conditioned? (issue 29; CPU, bf16 against float64)

tests/gpu/test_post_training_gpu.py judges each step's DPO loss by its relative distance from
a higher-precision run at the same weights, ours <= 1.5x plain bf16 TRL's. This probe runs TRL
1.16's DPOTrainer.compute_loss for a few steps on a mid-sized random Qwen3 (bf16, AdamW at lr
1e-6 as the GPU test) for several seeds, three bf16 setups each:

  plain      TRL as is
  plain-perm TRL as is on the same network with its MLP units permuted (the same function to
             the last bit of every weight; only the order of the down projection's sums
             changes): an equally accurate bf16 computation, the kind of difference another
             GEMM kernel makes
  ours       this package's training kernels (on the CPU, their torch formulas)

and for each step prints the loss and gradient distances from float64 at that run's weights,
plus what the loss is made of: the per-sequence log-probability sums of the policy and the
reference, their errors from float64, and the errors of the margins
(chosen - ref chosen) - (rejected - ref rejected).

    LOCAL_KERNELS=kernels-lab/training=hub_kernels/kernels-lab/training \\
        python scripts/probes/probe_dpo_loss_conditioning.py [--seeds 0,1,2,3] [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import bench_post_training as bench  # noqa: E402

from tests.post_training import dpo_verdict  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128, help="prompt and completion, each")
    p.add_argument("--setups", default="plain,plain-perm,ours")
    a = p.parse_args()
    dims = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=a.hidden // 4)  # fmt: skip
    shape = bench.Shape(a.pairs, a.tokens, a.tokens)
    torch.set_num_threads(2)
    print(f"dims {dims}; {a.pairs} pairs x ({a.tokens} + {a.tokens}) tokens; lr 1e-6; "
          "distances from float64 at each run's own weights", flush=True)  # fmt: skip
    for seed in [int(s) for s in a.seeds.split(",")]:
        work = Path(tempfile.mkdtemp(prefix="probe-dpo-"))
        runs = {}
        for setup in a.setups.split(","):
            path = dpo_verdict.save_checkpoint(work / f"m-{setup}", seed, dims,
                                               permute=setup == "plain-perm")  # fmt: skip
            exact = dpo_verdict.Exact(
                dpo_verdict.cpu_trainer("trl", path, work, shape, torch.float64)
            )
            bf16 = dpo_verdict.cpu_trainer("trl" if setup.startswith("plain") else "ours", path,
                                           work, shape, "bfloat16")  # fmt: skip
            inputs, _ = bench.step_inputs("dpo", bf16, shape, "cpu")
            runs[setup] = dpo_verdict.run_steps(bf16, exact, a.steps, inputs)
        print(f"\nseed {seed}")
        for setup, steps in runs.items():
            for i, s in enumerate(steps):
                print(f"  {setup:10s} step {i + 1}: {s.describe()}")
        base = runs.get("plain")
        for setup, steps in runs.items():
            if setup == "plain" or base is None:
                continue
            old = dpo_verdict.old_rule(base, steps)
            new = dpo_verdict.verdict(base, steps)
            ratios = " ".join(
                f"{o.loss_dist / p.loss_dist:.2f}" if p.loss_dist else "-"
                for p, o in zip(base, steps, strict=True)
            )
            sigmas = " ".join(
                f"{abs(o.loss - o.loss_exact) / dpo_verdict.loss_noise(o):.2f}"
                if dpo_verdict.loss_noise(o)
                else "-"
                for o in steps
            )
            print(
                f"  {setup} vs plain: loss distance ratio per step {ratios}; own loss error "
                f"in sigma_L {sigmas}; old rule {old or 'passes'}; new verdict {new or 'passes'}"
            )


if __name__ == "__main__":
    main()
