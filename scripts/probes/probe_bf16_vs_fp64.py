"""Which bf16 model is nearer the float64 one: the plain model or the kernelized one?

    python scripts/probes/probe_bf16_vs_fp64.py --only gemma4_text            # CPU, torch paths
    TRITON_INTERPRET=1 python scripts/probes/probe_bf16_vs_fp64.py --only gemma4_text
    python scripts/probes/probe_bf16_vs_fp64.py --device cuda --only gemma4_text,llama

The registry sweep (scripts/sweep_models.py) compares a plain bf16 model with the same model
after ``kernels.apply_training_kernels`` and wants 2e-2 relative. Two bf16 computations of one
float64 quantity can differ by more than either differs from it, so this probe asks the question
that decides which side is wrong: for the sweep's tiny model and batches, with the plain model
cast to float64 (same weights, same inputs) as the reference, how far is each bf16 model from it?

Per model type it prints, with rel(a) = ||a - a64|| / ||a64||:

1. *in model*, one forward and backward: for every module a layer is bound to, its output and the
   gradient at its input (a full backward hook), plain and ours against float64. The errors
   here include everything upstream of the module.
2. *isolated*: each bound module alone, fed the float64 run's input and output gradient rounded
   to bf16, against the float64 module on exactly those values: the module's own error. The loss
   head is isolated the same way: the decoder's last hidden state replaced by the float64 one.
3. the parameter gradients after one step: the gradient norm (the sweep's number) and the
   parameters where ours is furthest from float64 relative to plain.
4. three AdamW steps (lr 1e-3, the sweep's): each step's loss and gradient norm for plain, ours
   and float64.

``ratio`` is rel(ours) / rel(plain): at most 1 means ours is as close to float64 as the plain
model or closer.

Under ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter, whose fp32 -> bf16 cast
(an explicit ``.to(tl.bfloat16)`` or the implicit one of a store) drops the low bits, i.e. rounds
toward zero, where the GPU rounds to nearest even: every bf16 value our kernels write carries up
to twice the rounding error it has on the GPU, and a bias. ``--gpu-rounding`` makes the
interpreter round to nearest even, as the GPU does, so that the CPU shows the GPU's numerics.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402


def round_like_gpu() -> None:
    """Make Triton's interpreter round fp32 -> bf16 to nearest even (the GPU's default)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def rounded(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.ascontiguousarray(src.data, dtype=np.float32)
            bits = data.view(np.uint32)
            # add half an ulp of bf16 (minus one when the kept last bit is even), keep the top half
            out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(
                np.uint16
            )
            out[np.isnan(data)] = 0x7FC0
            return interpreter.TensorHandle(out, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = rounded


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64 (0 where both are zero)."""
    a, ref = a.detach().double(), ref.detach().double()
    den = ref.norm().item()
    num = (a - ref).norm().item()
    return num / den if den else (0.0 if num == 0 else float("inf"))


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict) or hasattr(value, "to_tuple"):
        value = value.to_tuple() if hasattr(value, "to_tuple") else tuple(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def bound_modules(model, report) -> dict[str, torch.nn.Module]:
    """Module path -> module for each bound entry; a bound function is probed through the
    module that calls it (``attn.rotary`` -> ``attn``); the root (the loss head) is left out."""
    found = {}
    for e in report:
        if e.status != "bound" or not e.path:
            continue
        try:
            found[e.path] = (e.layer_name, model.get_submodule(e.path))
        except AttributeError:
            owner = e.path.rpartition(".")[0]
            found[owner] = (e.layer_name, model.get_submodule(owner))
    return found


class Recorder:
    """Forward/backward hooks on named modules: inputs, outputs, output and input gradients
    (one record per call; a module called twice keeps both)."""

    def __init__(self, model, paths):
        self.calls: dict[str, list[dict]] = {p: [] for p in paths}
        self.handles = []
        for path in paths:
            module = model.get_submodule(path)
            self.handles.append(
                module.register_forward_hook(self._fwd(path), with_kwargs=True, always_call=False)
            )
            self.handles.append(module.register_full_backward_hook(self._bwd(path)))

    def _fwd(self, path):
        def hook(module, args, kwargs, output):
            self.calls[path].append(
                {
                    "args": [a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                    "kwargs": kwargs,
                    "out": _first_tensor(output).detach(),
                }
            )

        return hook

    def _bwd(self, path):
        def hook(module, grad_input, grad_output):
            # backward visits calls in reverse: fill the latest call without gradients
            for rec in reversed(self.calls[path]):
                if "dy" not in rec:
                    rec["dy"] = _first_tensor(grad_output)
                    rec["dx"] = _first_tensor(grad_input)
                    break

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def in_model(plain, ours, ref, paths, ids) -> list[dict]:
    """One forward + backward of each model with hooks on `paths`."""
    recs = {}
    for name, model in (("plain", plain), ("ours", ours), ("ref", ref)):
        rec = Recorder(model, paths)
        model.zero_grad(set_to_none=True)
        _loss(model, ids).backward()
        rec.remove()
        recs[name] = rec.calls
    rows = []
    for path in paths:
        for i, r64 in enumerate(recs["ref"][path]):
            p, o = recs["plain"][path][i], recs["ours"][path][i]
            row = {"module": path, "call": i}
            for what in ("out", "dx"):
                if r64.get(what) is None or p.get(what) is None or o.get(what) is None:
                    continue
                row[f"{what} plain"] = rel(p[what], r64[what])
                row[f"{what} ours"] = rel(o[what], r64[what])
            rows.append(row)
    return rows, recs["ref"]


def _module_run(module, args, kwargs, x, dy, params):
    """Output, input gradient and parameter gradients of `module(x, *args[1:])` for `dy`."""
    x = x.detach().clone().requires_grad_(True)
    out = _first_tensor(module(x, *args[1:], **kwargs))
    grads = torch.autograd.grad(out, [x, *params], dy, allow_unused=True)
    return out.detach(), grads[0], grads[1:]


def isolated(plain, ours, ref, paths, ref_calls, dtype) -> list[dict]:
    """Each module alone on the float64 run's input and output gradient rounded to `dtype`."""

    def cast(v, dt):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dt)
        return v

    rows = []
    for path in paths:
        for i, call in enumerate(ref_calls[path]):
            if call.get("dy") is None or not call["args"]:
                continue
            x = call["args"][0].to(dtype)  # the bf16 value all three modules see
            dy = call["dy"].to(dtype)
            row = {"module": path, "call": i}
            res = {}
            for name, model, dt in (
                ("plain", plain, dtype),
                ("ours", ours, dtype),
                ("ref", ref, torch.float64),
            ):
                module = model.get_submodule(path)
                params = [p for p in module.parameters() if p.requires_grad]
                args = [cast(a, dt) for a in call["args"]]
                kwargs = {k: cast(v, dt) for k, v in call["kwargs"].items()}
                res[name] = _module_run(module, args, kwargs, x.to(dt), dy.to(dt), params)
            o64, dx64, dp64 = res["ref"]
            for name in ("plain", "ours"):
                out, dx, dps = res[name]
                row[f"out {name}"] = rel(out, o64)
                row[f"dx {name}"] = rel(dx, dx64)
                dw = [rel(a, b) for a, b in zip(dps, dp64, strict=True) if b is not None]
                if dw:
                    row[f"dW {name}"] = max(dw)
            rows.append(row)
    return rows


def isolated_head(plain, ours, ref, ids, dtype) -> dict:
    """The loss head alone: the decoder's last hidden state replaced by the float64 run's
    (rounded to `dtype`); loss, d(hidden) and d(lm_head.weight) against float64."""
    decoder = _decoder_path(ref)
    if decoder is None:
        return {}
    captured = {}

    def grab(module, args, output):
        captured["h"] = _first_tensor(output).detach()

    handle = ref.get_submodule(decoder).register_forward_hook(grab)
    with torch.no_grad():
        _loss(ref, ids)
    handle.remove()
    h = captured["h"].to(dtype)
    res = {}
    for name, model, dt in (
        ("plain", plain, dtype),
        ("ours", ours, dtype),
        ("ref", ref, torch.float64),
    ):
        leaf = h.to(dt).clone().requires_grad_(True)

        def swap(module, args, output, leaf=leaf):
            if isinstance(output, torch.Tensor):
                return leaf
            output["last_hidden_state"] = leaf
            return output

        handle = model.get_submodule(decoder).register_forward_hook(swap)
        model.zero_grad(set_to_none=True)
        loss = _loss(model, ids)
        loss.backward()
        handle.remove()
        w = model.get_output_embeddings().weight
        res[name] = (loss.detach(), leaf.grad, w.grad.detach().clone())
        model.zero_grad(set_to_none=True)
    row = {"module": "<loss head>"}
    for name in ("plain", "ours"):
        row[f"out {name}"] = rel(res[name][0], res["ref"][0])
        row[f"dx {name}"] = rel(res[name][1], res["ref"][1])
        row[f"dW {name}"] = rel(res[name][2], res["ref"][2])
    return row


def _decoder_path(model) -> str | None:
    """The submodule whose first output is the hidden state the head reads."""
    for path in ("model.language_model", "model", "transformer"):
        try:
            model.get_submodule(path)
            return path
        except AttributeError:
            continue
    return None


def param_grads(plain, ours, ref, ids, top: int) -> dict:
    norms = {}
    per = []
    for model in (plain, ours, ref):
        model.zero_grad(set_to_none=True)
        _loss(model, ids).backward()
    named = {
        n: (p, o, r)
        for (n, p), (_, o), (_, r) in zip(
            plain.named_parameters(), ours.named_parameters(), ref.named_parameters(), strict=True
        )
    }
    for name, model in (("plain", plain), ("ours", ours), ("ref", ref)):
        grads = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
        norms[name] = torch.stack(grads).norm().item()
    for n, (p, o, r) in named.items():
        if r.grad is None:
            continue
        rp, ro = rel(p.grad, r.grad), rel(o.grad, r.grad)
        per.append(
            {
                "param": n,
                "grad norm": r.grad.norm().item(),
                "plain": rp,
                "ours": ro,
                "ratio": ro / rp if rp else float("inf") if ro else 1.0,
            }
        )
    for model in (plain, ours, ref):
        model.zero_grad(set_to_none=True)
    per.sort(key=lambda r: -r["grad norm"])
    return {
        "grad norm": norms,
        "grad norm rel plain": abs(norms["plain"] - norms["ref"]) / norms["ref"],
        "grad norm rel ours": abs(norms["ours"] - norms["ref"]) / norms["ref"],
        "grad norm rel plain-vs-ours": abs(norms["ours"] - norms["plain"]) / norms["plain"],
        "largest grads": per[:top],
        "worst ratio": sorted(per, key=lambda r: -r["ratio"])[:top],
    }


def three_steps(plain, ours, ref, batches) -> dict:
    from tests.models.registry import train_steps

    runs = {
        name: train_steps(copy.deepcopy(m), batches)
        for name, m in (("plain", plain), ("ours", ours), ("ref", ref))
    }
    out = {"steps": runs}
    for what, k in (("loss", 0), ("grad norm", 1)):
        for name in ("plain", "ours"):
            out[f"{what} rel {name}"] = max(
                abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(runs[name], runs["ref"], strict=True)
            )
        out[f"{what} rel plain-vs-ours"] = max(
            abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(runs["ours"], runs["plain"], strict=True)
        )
    return out


def probe(model_type: str, device: str, top: int = 6) -> dict:
    import kernels

    from tests.models.registry import VOCAB, build

    dtype = torch.bfloat16
    plain = build(model_type).to(device=device, dtype=dtype)
    ref = copy.deepcopy(plain).to(torch.float64)
    if getattr(ref.config, "_experts_implementation", None) not in (None, "eager"):
        ref.set_experts_implementation("eager")  # grouped matmuls take no float64
    ours = copy.deepcopy(plain)
    report = kernels.apply_training_kernels(ours)
    for m in (plain, ours, ref):
        m.train()
    gen = torch.Generator().manual_seed(1)  # the sweep's batches
    batches = [torch.randint(0, VOCAB, (2, 16), generator=gen).to(device) for _ in range(3)]
    mods = bound_modules(ours, report)
    paths = list(mods)
    torch.manual_seed(0)
    rows, ref_calls = in_model(plain, ours, ref, paths, batches[0])
    for r in rows:
        r["layer"] = mods[r["module"]][0]
    iso = isolated(plain, ours, ref, paths, ref_calls, dtype)
    for r in iso:
        r["layer"] = mods[r["module"]][0]
    head = isolated_head(plain, ours, ref, batches[0], dtype)
    if head:
        head["layer"] = next(
            (e.layer_name for e in report if e.status == "bound" and not e.path), ""
        )
        iso.append(head)
    grads = param_grads(plain, ours, ref, batches[0], top)
    steps = three_steps(plain, ours, ref, batches)
    return {
        "model_type": model_type,
        "bound": sorted({e.layer_name for e in report if e.status == "bound"}),
        "in_model": rows,
        "isolated": iso,
        "grads": grads,
        "three_steps": steps,
    }


def _ratio(row, what):
    p, o = row.get(f"{what} plain"), row.get(f"{what} ours")
    if p is None or o is None:
        return ""
    r = o / p if p else (float("inf") if o else 1.0)
    return f"{p:8.1e} {o:8.1e} {r:6.2f}"


def print_result(res: dict) -> None:
    print(f"\n=== {res['model_type']}  (bound: {', '.join(res['bound'])})")
    for title, rows in (("in model, 1 step", res["in_model"]), ("isolated", res["isolated"])):
        print(f"-- {title}: rel to float64 as plain / ours / ratio")
        print(
            f"{'module':44s} {'layer':20s} {'output':24s} {'input grad':24s} {'weight grads':24s}"
        )
        for r in rows:
            name = r["module"] + (f"#{r['call']}" if r.get("call") else "")
            print(
                f"{name[-44:]:44s} {r.get('layer', '')[:20]:20s} {_ratio(r, 'out'):24s} "
                f"{_ratio(r, 'dx'):24s} {_ratio(r, 'dW'):24s}"
            )
    g = res["grads"]
    print(
        f"-- grad norm after 1 step: rel to float64 plain {g['grad norm rel plain']:.1e}, "
        f"ours {g['grad norm rel ours']:.1e}; plain vs ours {g['grad norm rel plain-vs-ours']:.1e}"
    )
    print(f"{'parameter (largest gradients)':56s} {'|g64|':>8s} {'plain':>8s} {'ours':>8s} ratio")
    for r in g["largest grads"]:
        print(
            f"{r['param'][-56:]:56s} {r['grad norm']:8.2e} {r['plain']:8.1e} {r['ours']:8.1e} {r['ratio']:5.2f}"
        )
    print(f"{'parameter (worst ours/plain)':56s}")
    for r in g["worst ratio"]:
        print(
            f"{r['param'][-56:]:56s} {r['grad norm']:8.2e} {r['plain']:8.1e} {r['ours']:8.1e} {r['ratio']:5.2f}"
        )
    s = res["three_steps"]
    print("-- 3 AdamW steps (loss, grad norm): plain | ours | float64")
    for i, (p, o, r) in enumerate(
        zip(s["steps"]["plain"], s["steps"]["ours"], s["steps"]["ref"], strict=True)
    ):
        print(f"step {i}: {p[0]:.5f} {p[1]:.4f} | {o[0]:.5f} {o[1]:.4f} | {r[0]:.5f} {r[1]:.4f}")
    for what in ("loss", "grad norm"):
        print(
            f"max {what} rel: plain-vs-ours {s[f'{what} rel plain-vs-ours']:.1e}; "
            f"to float64 plain {s[f'{what} rel plain']:.1e}, ours {s[f'{what} rel ours']:.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="gemma4_text", help="comma-separated model types")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default="", help="write the numbers here")
    parser.add_argument(
        "--gpu-rounding",
        action="store_true",
        help="under TRITON_INTERPRET=1: round fp32 -> bf16 to nearest even, as the GPU does",
    )
    args = parser.parse_args(argv)
    if args.gpu_rounding:
        round_like_gpu()
    warnings.filterwarnings("ignore")
    import sweep_models

    sweep_models.start_mirror()
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')} device={args.device} "
        f"gpu-rounding={args.gpu_rounding}"
    )
    results = []
    for model_type in [t for t in args.only.split(",") if t]:
        res = probe(model_type, args.device)
        print_result(res)
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
