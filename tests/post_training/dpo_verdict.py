"""DPO steps measured against a higher-precision TRL at the same weights (see verdict())."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tests.models.bf16_verdict import FACTOR, FLOOR


@dataclass
class Step:
    """One DPO step of a bf16 run and of the exact (fp32 / float64) TRL at its weights.

    Per-token log-probabilities are [B, T] with B = chosen rows then rejected rows (TRL's
    batch order), zero outside the completions; the margins are per pair."""

    beta: float
    loss: float
    loss_exact: float
    grad_dist: float
    policy: torch.Tensor  # per-token log-probs, float64, CPU
    ref: torch.Tensor
    policy_exact: torch.Tensor
    ref_exact: torch.Tensor

    @property
    def loss_dist(self) -> float:
        return abs(self.loss - self.loss_exact) / max(abs(self.loss_exact), 1e-12)

    def margins(self, exact: bool = False) -> torch.Tensor:
        pol, ref = (self.policy_exact, self.ref_exact) if exact else (self.policy, self.ref)
        ratio = (pol - ref).sum(1)
        chosen, rejected = ratio.chunk(2)
        return chosen - rejected

    def describe(self) -> str:
        dm = self.margins() - self.margins(exact=True)
        return (
            f"loss {self.loss:.6f} (exact {self.loss_exact:.6f}) dist {self.loss_dist:.2e}; "
            f"grad dist {self.grad_dist:.2e}; log-probs rel dist policy "
            f"{_rel(self.policy, self.policy_exact):.2e} ref {_rel(self.ref, self.ref_exact):.2e}; "
            f"margins exact {_fmt(self.margins(exact=True))} error {_fmt(dm)}; "
            f"loss noise scale {loss_noise(self):.2e}"
        )


def _fmt(t: torch.Tensor) -> str:
    return "[" + " ".join(f"{v:+.2e}" for v in t.tolist()) + "]"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def loss_noise(step: Step) -> float:
    """The standard deviation of the loss error that the per-token log-ratio errors of this
    step would give if they were independent: sigma_L = (beta / pairs) * sqrt(sum_i
    sigmoid(-beta m_i)^2 * sum_{t in pair i} delta_t^2), delta_t the error of
    log pi_t - log ref_t from exact."""
    delta2 = ((step.policy - step.ref) - (step.policy_exact - step.ref_exact)).pow(2).sum(1)
    chosen, rejected = delta2.chunk(2)
    weight = torch.sigmoid(-step.beta * step.margins(exact=True)).pow(2)
    pairs = chosen.numel()
    return step.beta / pairs * math.sqrt(float((weight * (chosen + rejected)).sum()))


def grad_distance(model, exact_params: dict) -> float:
    """Relative L2 distance of `model`'s gradients from those of `exact_params` (same names),
    over the parameters the exact run has a gradient for; a missing gradient counts as zero."""
    diff = norm = 0.0
    for name, p in model.named_parameters():
        g_exact = exact_params[name].grad
        if g_exact is None:
            continue
        g = p.grad.to(g_exact.dtype) if p.grad is not None else torch.zeros_like(g_exact)
        diff += float((g - g_exact).double().pow(2).sum())
        norm += float(g_exact.double().pow(2).sum())
    return (diff / max(norm, 1e-300)) ** 0.5


class Exact:
    """A TRL DPOTrainer in fp32 or float64, run at another model's weights."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.params = dict(trainer.model.named_parameters())

    def step(self, model, loss: float, inputs: dict, policy, ref, beta) -> Step:
        with torch.no_grad():
            for name, p in model.named_parameters():
                self.params[name].copy_(p)
        self.trainer.model.zero_grad(set_to_none=True)
        with _capture(self.trainer) as seen:
            exact = self.trainer.compute_loss(self.trainer.model, dict(inputs))
        exact.backward()
        return Step(
            beta, loss, float(exact.detach()), grad_distance(model, self.params),
            policy, ref, seen["policy"], seen["ref"],
        )  # fmt: skip


class _capture:
    """Records the per-token log-probs TRL's fused head gave the policy and the reference
    during one compute_loss (forward hooks on both models)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.seen: dict[str, torch.Tensor] = {}

    def __enter__(self) -> dict[str, torch.Tensor]:
        def hook(name):
            def record(module, args, output):
                self.seen[name] = output.log_probs.detach().double().cpu()

            return record

        self.handles = [
            self.trainer.model.register_forward_hook(hook("policy")),
            self.trainer.ref_model.register_forward_hook(hook("ref")),
        ]
        return self.seen

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def run_steps(trainer, exact: Exact, steps: int, inputs: dict, around=nullcontext) -> list[Step]:
    """`steps` optimizer steps of `trainer` on one batch (`inputs`, as its collator made it),
    each measured by `exact`; `around()` is entered around each step's loss and backward."""
    model = trainer.model
    opt = trainer.create_optimizer()
    out = []
    for _ in range(steps):
        with around(), _capture(trainer) as seen:
            loss = trainer.compute_loss(model, dict(inputs))
            loss.backward()
        out.append(
            exact.step(
                model, float(loss.detach()), inputs, seen["policy"], seen["ref"], trainer.beta
            )  # fmt: skip
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def old_rule(plain: list[Step], ours: list[Step]) -> str:
    """The rule the GPU test had: each step's loss and gradient distance <= FACTOR x plain's or
    <= FLOOR. "" when it holds, else the first failure."""
    for i, (p, o) in enumerate(zip(plain, ours, strict=True)):
        for what, a, b in (
            ("loss", p.loss_dist, o.loss_dist),
            ("gradient", p.grad_dist, o.grad_dist),
        ):
            if b > max(FACTOR * a, FLOOR):
                return f"step {i + 1} {what}: {b:.2e} > {FACTOR} x plain {a:.2e}"
    return ""


# How many standard deviations of the loss error its inputs' noise explains (see verdict()).
Z = 4.0


def sums_rounding(step: Step) -> float:
    """The loss error that rounding the four per-pair log-prob sums in fp32 can make (TRL sums
    fp32 per-token values: a few ulp of sums that reach thousands of nats), per pair mean."""
    total = sum(t.sum(1).abs() for t in (step.policy_exact, step.ref_exact))
    return step.beta * 2.0**-21 * float(total.sum()) / (total.numel() / 2)


def verdict(plain: list[Step], ours: list[Step]) -> str:
    """ "" when `ours` is as near the exact run as `plain` is, at every step; else why not.

    Per step, each side against the exact TRL at its own weights:

    - gradient: distance <= FACTOR x plain's, or <= FLOOR (as the model sweep);
    - per-token log-probs of the policy and of the reference (the only values our kernels hand
      the loss): relative distance <= FACTOR x plain's. Thousands of tokens: steady from run
      to run, and no floor needed (bf16 log-probs are never within fp32 of exact);
    - the noise of the log-ratios: sigma_L (loss_noise) <= FACTOR x plain's, or <= the fp32
      rounding of the sums. At step 1 policy and reference have the same weights: plain's
      sigma_L is 0 (the same bits twice); ours runs the policy through the op that saves for
      the backward and the reference through the no-grad one, whose fp32 per-token values
      may differ by an ulp (seen on the H200: margins off by 3e-6 nats, sigma_L 1e-7);
    - the loss: |loss - exact| <= Z sigma_L(ours) + the fp32 rounding of the sums. The loss is
      a sigmoid of a difference of log-prob sums that the first steps barely move, so its error
      is the log-ratio noise summed, a zero-mean draw as large as the signal; comparing two such
      draws (ours' loss distance against plain's) fails a correct run about every second time.
      Compared with its own noise it is well conditioned: a bias that adds up over the tokens
      (a reference at another precision or temperature) grows with their number, the noise
      with its square root.
    """
    for i, (p, o) in enumerate(zip(plain, ours, strict=True)):
        at = f"step {i + 1}"
        if o.grad_dist > max(FACTOR * p.grad_dist, FLOOR):
            return (
                f"{at} gradient: {o.grad_dist:.3e} from exact > {FACTOR} x plain {p.grad_dist:.3e}"
            )
        for name in ("policy", "ref"):
            d_o = _rel(getattr(o, name), getattr(o, f"{name}_exact"))
            d_p = _rel(getattr(p, name), getattr(p, f"{name}_exact"))
            if d_o > FACTOR * d_p:
                return f"{at} {name} log-probs: {d_o:.3e} from exact > {FACTOR} x plain {d_p:.3e}"
        s_o, s_p = loss_noise(o), loss_noise(p)
        if s_o > max(FACTOR * s_p, sums_rounding(o)):
            return f"{at} log-ratio noise: sigma_L {s_o:.3e} > {FACTOR} x plain {s_p:.3e}"
        err, tol = abs(o.loss - o.loss_exact), Z * s_o + sums_rounding(o)
        if err > tol:
            return (
                f"{at} loss: |{o.loss:.6f} - exact {o.loss_exact:.6f}| = {err:.3e} > "
                f"{Z:g} sigma_L {s_o:.3e} + fp32 sums {sums_rounding(o):.1e}"
            )
    return ""


def save_checkpoint(path, seed: int, dims: dict, permute: bool = False):
    """A random bf16 Qwen3 of `dims` with bench_post_training's word tokenizer, saved at `path`
    (with `permute`, the same network with its MLP units permuted)."""
    import bench_post_training as bench
    from transformers import AutoModelForCausalLM, Qwen3Config

    vocab = dims["vocab_size"]
    config = Qwen3Config(**dims, tie_word_embeddings=True, pad_token_id=vocab - 2,
                         eos_token_id=vocab - 1, bos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if permute:
        permute_mlp_units(model, torch.Generator().manual_seed(1000 + seed))
    model.save_pretrained(path)
    bench.word_tokenizer(vocab, vocab - 2, vocab - 1).save_pretrained(path)
    return path


def cpu_trainer(setup: str, path, work, shape, dtype):
    """bench_post_training's DPO trainer of `setup` ("trl" or "ours") on the CPU, in `dtype`
    (a torch dtype for float64, which TRL's string check refuses), ready for compute_loss."""
    from types import SimpleNamespace

    import bench_post_training as bench

    args = SimpleNamespace(device="cpu", work=str(work), no_gradient_checkpointing=True,
                           dtype=dtype)  # fmt: skip
    trainer = bench.build_trainer("dpo", setup, {"student": path, "teacher": path}, shape, args)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def permute_mlp_units(model, gen: torch.Generator) -> None:
    """Permute each MLP's intermediate units (gate/up rows, down columns): the same function to
    the last bit of every weight, only the down projection's sums run in another order."""
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            perm = torch.randperm(mlp.gate_proj.weight.shape[0], generator=gen)
            mlp.gate_proj.weight.copy_(mlp.gate_proj.weight[perm])
            mlp.up_proj.weight.copy_(mlp.up_proj.weight[perm])
            mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, perm])
