"""What a rank runs (worker.py): each scenario builds its model or inputs, runs one training step
under one parallelism with this project's kernels bound, and returns tensors that the test
compares with a one-process run of transformers as it is (no kernels, no parallelism).

Every rank computes that one-process reference itself, from the same checkpoint and batch, so
each rank's loss and gradients are checked, not only rank 0's. Gradients are returned whole
(a DTensor's through full_tensor(), a ZeRO-3 one through DeepSpeed's safe_get_full_grad).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, BATCH, SEQ = 512, 2, 16


# -- models ------------------------------------------------------------------------------------


def tiny_config(family: str):
    """A two-layer model of `family` small enough for the CPU and for 4-way tensor parallelism
    (8 query heads, 4 key/value heads, every split dim divisible by 4)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    )  # fmt: skip
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if family == "gemma":  # GeGLU, (1 + w) norms, tied embeddings
        from transformers import GemmaConfig

        return GemmaConfig(**common)
    if family == "qwen3_moe":  # q/k norms, 3-D experts
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[],
        )  # fmt: skip
    raise ValueError(f"unknown family {family}")


def checkpoint(family: str, out: Path) -> Path:
    """The family's tiny model, saved once by rank 0 (seed 0) for every rank to load."""
    path = out / f"ckpt-{family}"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(path)
    dist.barrier()
    return path


def load(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.train()
    return model


def tokens(seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def bind(model) -> list[str]:
    """Bind the training kernels (from LOCAL_KERNELS) by structure; the bound module paths."""
    import kernels

    mapping = kernels.training_kernel_mapping(model.config)  # classified on a meta copy
    report = kernels.apply_kernels(model, mapping, mode=kernels.Mode.TRAINING)
    return sorted(f"{e.path}:{e.layer_name}" for e in report.bound)


def full_grads(model) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def one_process(path: Path, batches: list[torch.Tensor], shift_labels=None) -> dict:
    """transformers as it is, one process, the ranks' batches concatenated."""
    model = load(path)
    ids = torch.cat(batches)
    kw = {} if shift_labels is None else {"shift_labels": shift_labels}
    loss = model(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    return {"ref_loss": loss.detach(), "ref_grads": full_grads(model)}


# -- tensor parallel ---------------------------------------------------------------------------


def tp(*, family: str, out: Path, **_) -> dict:
    """transformers' tp_plan="auto" over all ranks, the kernels bound after it (as use_kernels
    does); every rank feeds the same batch."""
    path = checkpoint(family, out)
    ids = tokens(1)
    result = one_process(path, [ids])
    model = load(path, tp_plan="auto")
    bound = bind(model)
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    head = model.lm_head.weight
    mlp = model.model.layers[0].mlp
    megatron = None
    if hasattr(mlp, "gate_proj"):  # dense MLPs: the lean TP path serves them
        tp = _kernels().tensor_parallel
        megatron = tp.megatron_split(mlp.gate_proj, mlp.up_proj, mlp.down_proj) is not None
    return {
        "megatron_mlp": megatron,
        **result,
        "loss": output.loss.detach(),
        "grads": full_grads(model),
        "bound": bound,
        "logits_none": output.logits is None,
        "head_rows": head.to_local().shape[0] if hasattr(head, "to_local") else head.shape[0],
    }


# -- the vocab-parallel loss on its own ----------------------------------------------------------


def _kernels():
    import kernels

    return kernels.get_kernel("kernels-lab/training", version=1)


VP_CASES = {
    "mean": {},
    "options": {"label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 4.0},
    "sum_bias": {"reduction": "sum", "bias": True},
    "none": {"reduction": "none"},
    "num_items_chunks": {"num_items": 17.0, "chunk_rows": 5},
}


LOGPROB_CASES = {
    "logprob": {},
    "logprob_transform": {"temperature": 0.7, "softcap": 3.0, "logit_scale": 1.3, "bias": True},
}


def vocab_parallel(*, out: Path, vocab: int = 101, **_) -> dict:
    """fused_linear_cross_entropy with the head's weight (and bias) a Shard(0) DTensor over all
    ranks, every option the vocab-parallel path takes; the inputs are returned for the test's
    float64 reference. 101 rows do not split evenly: the last rank holds fewer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    kt = _kernels()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(7)  # the same inputs on every rank
    n, h = 24, 16
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(vocab, h, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[::5] = -100
    upstream = torch.randn(n, generator=gen)
    results = {"hidden": hidden, "weight": weight, "bias": bias, "target": target, "up": upstream}
    for case, opts in VP_CASES.items():
        opts = dict(opts)
        x = hidden.clone().requires_grad_()
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        b = (
            distribute_tensor(bias.clone(), mesh, [Shard(0)]).requires_grad_()
            if opts.pop("bias", False)
            else None
        )
        loss = kt.fused_linear_cross_entropy(x, w, target, b, **opts)
        loss.backward(upstream if opts.get("reduction") == "none" else None)
        results[case] = {
            "loss": loss.detach(),
            "dx": x.grad,
            "dw": w.grad.full_tensor(),
            "dw_placements": str(w.grad.placements),
            "local_rows": w.to_local().shape[0],
            "db": None if b is None else b.grad.full_tensor(),
        }
    # the fused log-prob head (logprob.py), every field, both gradients
    up_ent = torch.randn(n, generator=gen)
    results["up_ent"] = up_ent
    for case, opts in LOGPROB_CASES.items():
        opts = dict(opts)
        x = hidden.clone().requires_grad_()
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        b = (
            distribute_tensor(bias.clone(), mesh, [Shard(0)]).requires_grad_()
            if opts.pop("bias", False)
            else None
        )
        got = kt.fused_linear_logprob(x, w, target, b, outputs=kt.logprob.OUTPUTS, **opts)
        torch.autograd.backward([got.log_probs, got.entropy], [upstream, up_ent])
        results[case] = {
            **{f: getattr(got, f).detach() for f in got._fields},
            "dx": x.grad,
            "dw": w.grad.full_tensor(),
            "db": None if b is None else b.grad.full_tensor(),
        }
    # ranks handed different tokens (data parallelism): a NaN loss, never a silently wrong one
    x = (hidden + dist.get_rank()).requires_grad_()
    w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    results["differs"] = {
        "loss": kt.fused_linear_cross_entropy(x, w, target).detach(),
        "log_probs": kt.fused_linear_logprob(x, w, target).log_probs.detach(),
    }
    return results


class _Collectives:
    """Records every collective an op list ran (name, elements), through a dispatch mode."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if any(k in name for k in ("all_reduce", "allreduce", "all_gather", "allgather")):
                    t = next(
                        a
                        for a in torch.utils._pytree.tree_leaves(args)
                        if isinstance(a, torch.Tensor)
                    )
                    seen.append((name, t.numel()))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def dtensor_ops(*, out: Path, **_) -> dict:
    """The norms, RoPE and the gated product on DTensors laid out as sequence- and tensor-
    parallel plans lay them out; inputs and results whole for the test's float64 reference, and
    the collectives each ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    kt = _kernels()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(11)
    n, h = 12, 16  # 12 tokens, a hidden dim of 16: both split over 2 or 4 ranks
    x = torch.randn(n, h, generator=gen)
    w = torch.rand(h, generator=gen) + 0.5
    dy = torch.randn(n, h, generator=gen)
    res = {"x": x, "w": w, "dy": dy}
    for case, dim in (("norm_rows", 0), ("norm_hidden", 1)):
        for gemma in (False, True):
            xd = distribute_tensor(x.clone(), mesh, [Shard(dim)]).requires_grad_()
            wp = torch.nn.Parameter(w.clone())  # a plain replicated weight, as HF norms hold
            with _Collectives() as seen:
                y = kt.rms_norm(xd, wp, 1e-6, gemma=gemma)
                y.backward(distribute_tensor(dy.clone(), mesh, [Shard(dim)]))
            res[f"{case}_{'gemma' if gemma else 'llama'}"] = {
                "y": y.full_tensor().detach(),
                "placements": str(y.placements),
                "dx": xd.grad.full_tensor(),
                "dw": wp.grad.clone(),
                "collectives": seen.seen,
            }
    # the fused residual add + RMSNorm with tokens split (sequence parallel)
    r = torch.randn(n, h, generator=gen)
    xd = distribute_tensor(x.clone(), mesh, [Shard(0)]).requires_grad_()
    rd = distribute_tensor(r.clone(), mesh, [Shard(0)]).requires_grad_()
    wp = torch.nn.Parameter(w.clone())
    with _Collectives() as seen:
        y, total = kt.fused_add_rms_norm(xd, rd, wp, 1e-6)
        y.backward(distribute_tensor(dy.clone(), mesh, [Shard(0)]))
    res["add_norm"] = {
        "r": r, "y": y.full_tensor().detach(), "s": total.full_tensor().detach(),
        "dx": xd.grad.full_tensor(), "dr": rd.grad.full_tensor(), "dw": wp.grad.clone(),
        "collectives": seen.seen,
    }  # fmt: skip
    b, heads, t, d = 2, 4, 6, 8
    q = torch.randn(b, heads, t, d, generator=gen)
    k = torch.randn(b, heads, t, d, generator=gen)
    ang = torch.randn(b, t, d // 2, generator=gen)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    dq, dk = torch.randn(b, heads, t, d, generator=gen), torch.randn(b, heads, t, d, generator=gen)
    qd = distribute_tensor(q.clone(), mesh, [Shard(1)]).requires_grad_()
    kd = distribute_tensor(k.clone(), mesh, [Shard(1)]).requires_grad_()
    with _Collectives() as seen:
        qo, ko = kt.apply_rotary_pos_emb(qd, kd, cos, sin)
        torch.autograd.backward(
            [qo, ko],
            [
                distribute_tensor(dq.clone(), mesh, [Shard(1)]),
                distribute_tensor(dk.clone(), mesh, [Shard(1)]),
            ],
        )
    res["rope"] = {
        "q": q, "k": k, "cos": cos, "sin": sin, "dq": dq, "dk": dk,
        "qo": qo.full_tensor().detach(), "ko": ko.full_tensor().detach(),
        "gq": qd.grad.full_tensor(), "gk": kd.grad.full_tensor(),
        "placements": str(qo.placements), "collectives": seen.seen,
    }  # fmt: skip
    a, g2, dc = (
        torch.randn(n, h, generator=gen),
        torch.randn(n, h, generator=gen),
        torch.randn(n, h, generator=gen),
    )
    ad = distribute_tensor(a.clone(), mesh, [Shard(1)]).requires_grad_()
    bd = distribute_tensor(g2.clone(), mesh, [Shard(1)]).requires_grad_()
    with _Collectives() as seen:
        c = kt.silu_mul(ad, bd)
        c.backward(distribute_tensor(dc.clone(), mesh, [Shard(1)]))
    res["silu_mul"] = {
        "a": a, "b": g2, "dc": dc, "c": c.full_tensor().detach(),
        "da": ad.grad.full_tensor(), "db": bd.grad.full_tensor(), "collectives": seen.seen,
    }  # fmt: skip
    return res


def _probe_class():
    from tests.kernels._live_bytes import LiveBytes, plain

    class Probe(LiveBytes):
        """LiveBytes, plus the largest single tensor any op made (bytes)."""

        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t = plain(t)
                    self.largest = max(self.largest, t.numel() * t.element_size())
            return out

    return Probe


def _Probe():  # noqa: N802 - a class made on first use (tests.kernels imports at call time)
    return _probe_class()()


def vocab_parallel_memory(*, out: Path, gather: bool = False, **_) -> dict:
    """Peak live tensor bytes of one fwd+bwd of the vocab-parallel loss, at a shape where the
    full weight and the full [tokens, V] logits are each 4 MiB (fp32, N = H = 64, V = 16384).
    `gather=True` passes weight.full_tensor() instead: what the loss did before, for the test
    to show that the bound it asserts is one a gathering path breaks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    kt = _kernels()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(3)
    n, h, v = 64, 64, 16384
    x = torch.randn(n, h, generator=gen).requires_grad_()
    w = distribute_tensor(torch.randn(v, h, generator=gen) * 0.1, mesh, [Shard(0)])
    w.requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    # The gathered weight goes to the single-device loss, whose CE kernel Triton's interpreter
    # would run for ~25 s of CPU here; its torch path (chosen per call from TRITON_INTERPRET)
    # allocates the same buffers.
    interpret = os.environ.get("TRITON_INTERPRET", "0")
    os.environ["TRITON_INTERPRET"] = "0" if gather else interpret
    try:
        with _Probe() as probe:
            weight = w.full_tensor() if gather else w
            loss = kt.fused_linear_cross_entropy(x, weight, target, chunk_rows=16)
            loss.backward()
            del weight
    finally:
        os.environ["TRITON_INTERPRET"] = interpret
    return {
        "peak": probe.peak,
        "largest": probe.largest,
        "full_weight_bytes": v * h * 4,
        "full_logits_bytes": n * v * 4,
        "loss": loss.detach(),
    }


def vocab_parallel_bf16(
    *, out: Path, n: int = 4096, h: int = 2048, v: int = 151936, device: str = "cuda", **_
) -> dict:
    """The vocab-parallel loss in bf16 at Qwen3's vocabulary on this rank's GPU (NCCL), against
    the single-device fused loss on the full weight on the same device; on a GPU also the extra
    memory the vocab-parallel call peaks at (allocator statistics), with 256-row chunks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    kt = _kernels()
    cuda = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, h, generator=gen).to(dev, torch.bfloat16)
    weight = (torch.randn(v, h, generator=gen) * 0.02).to(dev, torch.bfloat16)
    target = torch.randint(0, v, (n,), generator=gen).to(dev)
    target[::7] = -100
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    ref = kt.fused_linear_cross_entropy(x, w, target)
    ref.backward()
    ref_dx, ref_dw = x.grad, w.grad
    del x, w
    wd = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    x = hidden.clone().requires_grad_()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = kt.fused_linear_cross_entropy(x, wd, target, chunk_rows=256)
    loss.backward()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    dw = wd.grad.full_tensor()

    def err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    return {
        "loss": float(loss),
        "ref_loss": float(ref),
        "dx_err": err(x.grad, ref_dx),
        "dw_err": err(dw, ref_dw),
        "peak": peak,
        "full_weight_bytes": v * h * 2,
        "full_logits_bytes": n * v * 2,
    }


# -- context parallel --------------------------------------------------------------------------


class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every rank's chunk along dim 2 (the tokens of [B, H, T, D]); the backward
    sums the gradient over the ranks and keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.chunk = x.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        r = dist.get_rank()
        return grad[:, :, r * ctx.chunk : (r + 1) * ctx.chunk]


def _cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """Causal attention of this rank's query chunk against every rank's keys and values (the
    all-gather form of context parallelism; torch's ring attention has no CPU kernel)."""
    k, v = _AllGatherSeq.apply(key), _AllGatherSeq.apply(value)
    rep = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = query.shape[2]
    q_pos = dist.get_rank() * t + torch.arange(t)
    mask = torch.arange(k.shape[2])[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return o.transpose(1, 2).contiguous(), None


@functools.cache
def _register_cp_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("kernels_test_cp", _cp_attention)
    AttentionMaskInterface.register("kernels_test_cp", lambda *args, **kwargs: None)
    return "kernels_test_cp"


def cp_labels(ids: torch.Tensor) -> torch.Tensor:
    """Pre-shifted labels with the first rank's first five ignored, so the ranks keep
    different token counts (a local mean would then differ from the global one)."""
    shift = F.pad(ids, (0, 1), value=-100)[:, 1:].clone()
    shift[:, :5] = -100
    return shift


def cp(*, family: str, out: Path, **_) -> dict:
    """The sequence split over the ranks (input_ids, position_ids and shift_labels chunked as
    accelerate's context parallelism does), the kernels bound, the loss reduced over the global
    token count from the kernel repo's `token_count` (one all-reduce). Each rank's loss is its
    share; the test sums losses and gradients over the ranks (what the data-parallel gradient
    sync over the CP ranks does) and compares them with the one-process run."""
    path = checkpoint(family, out)
    ids = tokens(2)
    shift = cp_labels(ids)
    result = one_process(path, [ids], shift_labels=shift)
    model = load(path, attn_implementation=_register_cp_attention())
    bound = bind(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    chunk = ids.shape[1] // world
    part = slice(rank * chunk, (rank + 1) * chunk)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    count = _kernels().token_count(shift[:, part])
    output = model(
        input_ids=ids[:, part].contiguous(),
        position_ids=positions[:, part].contiguous(),
        labels=ids[:, part].contiguous(),
        shift_labels=shift[:, part].contiguous(),
        num_items_in_batch=count,
    )
    output.loss.backward()
    return {
        **result,
        "loss": output.loss.detach(),
        "grads": full_grads(model),
        "bound": bound,
        "count": count,
        "local_count": (shift[:, part] != -100).sum(),
    }


# -- data parallel: FSDP2 and ZeRO-3 ---------------------------------------------------------


def fsdp2(*, family: str, out: Path, **_) -> dict:
    """fully_shard on every decoder layer, on lm_head alone (untied heads: its weight is then
    whole only inside lm_head's own hooks, where the fused loss must read it) and on the root,
    the kernels bound first (as scripts/train_fsdp.py does); each rank its own batch."""
    from torch.distributed.fsdp import fully_shard

    path = checkpoint(family, out)
    batches = [tokens(100 + r) for r in range(dist.get_world_size())]
    result = one_process(path, batches)
    model = load(path)
    bound = bind(model)
    for layer in model.model.layers:
        fully_shard(layer)
    own_head = model.lm_head.weight is not model.get_input_embeddings().weight
    if own_head:
        fully_shard(model.lm_head)
    fully_shard(model)
    ids = batches[dist.get_rank()]
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    return {
        **result,
        "loss": output.loss.detach(),
        "grads": full_grads(model),
        "bound": bound,
        "own_head_unit": own_head,
    }


def zero3(*, family: str, out: Path, **_) -> dict:
    """DeepSpeed ZeRO-3 (every parameter partitioned, lm_head.weight an empty shard outside its
    module's hooks), the kernels bound before deepspeed.initialize; each rank its own batch."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    path = checkpoint(family, out)
    batches = [tokens(200 + r) for r in range(dist.get_world_size())]
    result = one_process(path, batches)
    model = load(path)
    bound = bind(model)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        # no parameter kept whole for being small: every weight is partitioned, as a real
        # model's large ones are (the default keeps those under 1e5 elements whole)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    shard_numel = model.lm_head.weight.numel()
    ids = batches[dist.get_rank()]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = {}
    for name, p in model.named_parameters():
        g = safe_get_full_grad(p)
        grads[name] = None if g is None else g.detach().clone().float()
    # The fused loss called after the forward returned (a loss outside the model, as TRL- or
    # Liger-style code computes it): an empty shard and a clear error; gathered, the same loss.
    kt = _kernels()
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1].flatten(0, 1)
        target = ids[:, 1:].flatten()
        try:
            kt.fused_linear_cross_entropy(hidden, model.lm_head.weight, target)
            outside = "no error"
        except ValueError as exc:
            outside = str(exc)
        with deepspeed.zero.GatheredParameters([model.lm_head.weight]):
            gathered = kt.fused_linear_cross_entropy(hidden, model.lm_head.weight, target)
    return {
        "outside_error": outside,
        "gathered_loss": gathered,
        **result,
        "loss": loss.detach(),
        "grads": grads,
        "bound": bound,
        "head_shard_numel": shard_numel,
        "deepspeed": deepspeed.__version__,
    }
