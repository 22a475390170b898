"""The registry sweep's bf16 verdict: is the kernelized model as near float64 as the plain bf16
model is?

In fp32 the sweep asks that the plain and the kernelized model agree (1e-4 relative). In bf16
that question measures noise: each bf16 rounding is a perturbation that the tiny random models
amplify, and two bf16 computations of one float64 quantity can be further from each other than
either is from it. Gemma 4's plain and kernelized models differ by 4e-2 in gradient norm after 3
AdamW steps while the kernelized one is the nearer of the two to float64
(scripts/probes/probe_bf16_vs_fp64.py). Neither bf16 model can be the other's reference.

The reference is float64, taken *where each bf16 model is*: at every step, the plain model's
float64 copy is loaded with that bf16 model's current weights and run on the same batch. The
distance of a run is its worst step's

- loss: ``|loss - loss64| / |loss64|``;
- gradient: ``||g - g64|| / ||g64||`` over the whole flattened gradient (all parameters at once:
  an average of many roundings, steady from run to run, where a scalar such as the gradient norm
  can land near float64 by luck).

Taking float64 at each model's own weights keeps the trajectories out of it: after a step the
plain and the kernelized models sit at different weights, and a float64 *trajectory* drifts from
both; a token whose top-k experts nearly tie is then routed one way or the other by chance (in
hunyuan_v1_moe, one token routed differently in the third step makes ours 1.5x further from the
float64 trajectory than plain, or plain than ours, depending on the batches). A kernel whose
result depends on the step (a stale cache, a wrong in-place update) is still caught: its gradient
is compared with float64's at the very weights it was computed at.

Even at the same weights, a top-k choice (MoE routing, DeepSeek's group choice) can nearly tie and
fall one way in bf16 and the other in float64; the two then compute different functions, and a
token sent to another expert moves the whole gradient (GPT-OSS: 8e-2 in that step, 6e-3 in the
others). Such a step is left out and counted (``Run.rerouted``); where every step is, the sweep
falls back on plain vs ours and says so.

The kernelized model matches when each of its distances is at most ``FACTOR`` times the plain
model's, or below ``FLOOR``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

# One bf16 rounding: a distance below 2^-8 (bf16's machine epsilon) is within one rounding of
# float64, and no bf16 computation can be asked to do better; it also keeps the ratio from
# judging two distances that are both that small (their ratio says nothing).
FLOOR = 2.0**-8
# How much further from float64 than the plain model ours may land. Measured on the CPU over 38
# model types (Liger's and others, docs/models-bf16-cpu.md): the gradient distance ours/plain lies
# within 0.86..1.06 (our kernels round each output once, as the plain modules do; the loss
# distances seen stay under 3e-4, far under FLOOR). A Llama or Qwen3 whose norms round their outputs
# to 3 mantissa bits instead of bf16's 7 lands 5.5x / 6.8x further (test_bf16_verdict.py).
# 1.5 sits well above the first and far below the second.
FACTOR = 1.5


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    if isinstance(a, torch.Tensor):
        return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
    return abs(a - b) / max(abs(b), 1e-12)


def model_inputs(batch) -> dict:
    """A batch as the model's keyword arguments: a token tensor is its own labels; a dict
    (pixels, image tokens, grids: vlm_registry.py) is passed as it is."""
    return dict(batch) if isinstance(batch, dict) else {"input_ids": batch, "labels": batch}


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients, flattened into one float64 CPU vector (zeros where None)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p))
            .detach()
            .double()
            .flatten()
            .cpu()
            for p in model.parameters()
        ]
    )


@dataclass
class Run:
    """One bf16 model's training steps, each compared with `exact` (the plain model's float64
    copy) at that step's weights: ``losses`` and ``grads`` hold the relative distances."""

    exact: torch.nn.Module | None
    losses: list[float] = field(default_factory=list)
    grads: list[float] = field(default_factory=list)
    # steps left out: float64's top-k picks (MoE routing) differ from the bf16 model's
    rerouted: int = 0
    # why float64 could not be run (then the distances stop)
    error: str = ""

    def record(self, model: torch.nn.Module, batch, loss: float) -> None:
        """Compare this step (called after backward, before the optimizer step); `batch` is a
        token tensor (its own labels) or a dict of the model's inputs."""
        if self.exact is None or self.error:
            return
        try:
            self._record(model, batch, loss)
        except Exception as exc:  # noqa: BLE001 - a model that cannot run in float64: said
            lines = str(exc).strip().splitlines()
            self.error = f"{type(exc).__name__}: {lines[0][:120] if lines else ''}"

    def _record(self, model: torch.nn.Module, batch, loss: float) -> None:
        exact = self.exact
        inputs = model_inputs(batch)
        ids = inputs["input_ids"]
        # pixels and other float inputs in the float64 model's dtype
        inputs64 = {
            k: v.to(torch.float64) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs.items()
        }
        with torch.no_grad():
            for p64, p in zip(exact.parameters(), model.parameters(), strict=True):
                p64.copy_(p)
        exact.zero_grad(set_to_none=True)
        exact.train()
        # the float64 passes must not move the random stream the bf16 training draws from
        devices = [torch.cuda.current_device()] if ids.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            # with the labels: an encoder-decoder makes its decoder's inputs from them
            with torch.no_grad(), _TopK() as routed:
                model(**inputs)
            torch.manual_seed(0)
            with _TopK() as routed64:
                loss64 = exact(**inputs64).loss
            loss64.backward()
        if routed.picks != routed64.picks:
            # a token whose experts nearly tie went another way: the two compute different
            # functions here, and how far apart they land says nothing of the kernels
            self.rerouted += 1
        else:
            self.losses.append(_rel(loss, loss64.item()))
            self.grads.append(_rel(flat_grad(model), flat_grad(exact)))
        exact.zero_grad(set_to_none=True)

    def distance(self) -> tuple[float, float] | None:
        """(loss, gradient) distance to float64: the worst compared step's (None: no step)."""
        return (max(self.losses), max(self.grads)) if self.losses else None


class _TopK(torch.overrides.TorchFunctionMode):
    """Records which indices every top-k inside the block picks (MoE routing, group choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.picks: list[list[list[int]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk):
            self.picks.append(out[1].detach().sort(-1).values.cpu().tolist())
        return out


@dataclass
class Verdict:
    """The bf16 verdict and the distances it was drawn from, each (loss, gradient)."""

    match: bool
    plain: tuple[float, float]
    ours: tuple[float, float]

    def note(self) -> str:
        """One line for the sweep's table."""
        return (
            f"to float64 (loss, grads): plain {self.plain[0]:.1e}, {self.plain[1]:.1e}; "
            f"ours {self.ours[0]:.1e}, {self.ours[1]:.1e}"
        )


def judge(plain: tuple[float, float], ours: tuple[float, float]) -> Verdict:
    """Whether ours' (loss, gradient) distances to float64 are no more than FACTOR times the
    plain model's, or below FLOOR."""
    match = all(o <= max(FACTOR * p, FLOOR) for o, p in zip(ours, plain, strict=True))
    return Verdict(match, tuple(plain), tuple(ours))


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model in float64 for `Run`: MoE experts loop instead of grouped matmuls,
    which take no float64 (the same sum)."""
    exact = copy.deepcopy(model).to(torch.float64)
    if getattr(exact.config, "_experts_implementation", None) not in (None, "eager"):
        exact.set_experts_implementation("eager")
    return exact
