"""Tensor, context and data parallelism with the training kernels bound, on CPU ranks (gloo).

Every scenario runs in real processes joined by torch.distributed (tests/distributed/launch.py)
and returns each rank's loss and gradients next to a one-process run of transformers as it is
(scenarios.py). The default run holds one representative of each path on 2 ranks (tensor
parallel Llama, the vocab-parallel loss and its memory bound, context parallel Llama, the DTensor
ops); the matrix (TP 2 and 4, CP 2, FSDP2 and ZeRO-3 over Llama, Qwen3-MoE and Gemma) runs under
KERNELS_SWEEP=1 (docs/distributed.md has its last results).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.launch import run_ranks
from tests.gpu.variant import rel_err
from tests.sweep import sweep_only

FP32 = 2e-5  # norm-wise relative error of fp32 results computed in another order
FAMILIES = ("llama", "qwen3_moe", "gemma")
DEFAULT = [
    {"name": "ops", "kind": "dtensor_ops"},
    {"name": "vp", "kind": "vocab_parallel"},
    {"name": "memory", "kind": "vocab_parallel_memory"},
    {"name": "memory-gather", "kind": "vocab_parallel_memory", "gather": True},
    {"name": "tp-llama", "kind": "tp", "family": "llama"},
    {"name": "cp-llama", "kind": "cp", "family": "llama"},
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(2, DEFAULT, tmp_path_factory.mktemp("two-ranks"))


# -- checks ------------------------------------------------------------------------------------


def check_grads(grads: dict, ref: dict, what: str) -> None:
    assert grads.keys() == ref.keys(), what
    for name, q in ref.items():
        g = grads[name]
        assert g is not None and q is not None, f"{what}: {name} has no gradient"
        err = rel_err(g, q)
        assert err <= FP32, f"{what}: {name} gradient off by {err:.2e}"


def check_same_batch(ranks: list[dict], what: str) -> None:
    """Tensor parallel: every rank's loss and gradients are the one-process run's."""
    for r, res in enumerate(ranks):
        assert rel_err(res["loss"], res["ref_loss"]) <= FP32, (what, r)
        check_grads(res["grads"], res["ref_grads"], f"{what} rank {r}")
        assert res["logits_none"], "the fused head made logits in training"


def check_split_batch(ranks: list[dict], what: str) -> None:
    """Data parallel: the ranks' mean loss and every rank's (averaged) gradients are those of
    one process over all the ranks' batches."""
    mean = sum(res["loss"] for res in ranks) / len(ranks)
    assert rel_err(mean, ranks[0]["ref_loss"]) <= FP32, what
    for r, res in enumerate(ranks):
        check_grads(res["grads"], res["ref_grads"], f"{what} rank {r}")


def check_split_sequence(ranks: list[dict], what: str) -> None:
    """Context parallel: each rank's loss is its share over the global token count, so the
    shares and the ranks' gradients add up to the one-process run's."""
    counts = [int(res["local_count"]) for res in ranks]
    assert len(set(counts)) > 1, "the ranks must keep different token counts for this check"
    for res in ranks:
        assert int(res["count"]) == sum(counts)  # the global count, on every rank
    total = sum(res["loss"] for res in ranks)
    assert rel_err(total, ranks[0]["ref_loss"]) <= FP32, what
    summed = {n: sum(res["grads"][n] for res in ranks) for n in ranks[0]["ref_grads"]}
    check_grads(summed, ranks[0]["ref_grads"], what)


def bound_kinds(res: dict) -> set[str]:
    return {entry.split(":")[1] for entry in res["bound"]}


# -- the default run: 2 ranks ----------------------------------------------------------------


def test_tp2_llama_trains_like_one_process_with_every_kernel_bound(two_ranks):
    ranks = two_ranks["tp-llama"]
    check_same_batch(ranks, "TP=2 llama")
    for res in ranks:
        # 2 layers x (2 norms + rotary + MLP) + the final norm + the head
        assert len(res["bound"]) == 10, res["bound"]
        assert bound_kinds(res) == {"RMSNorm", "rotary_pos_emb", "SwiGLUMLP", "ForCausalLM"}
        assert res["head_rows"] == 256  # lm_head stayed split: 512 rows over 2 ranks
        assert res["megatron_mlp"], "the MLP did not take the local-shard (Megatron) path"


def test_cp2_llama_sums_to_one_process_over_the_global_token_count(two_ranks):
    ranks = two_ranks["cp-llama"]
    check_split_sequence(ranks, "CP=2 llama")
    assert len(ranks[0]["bound"]) == 10


def _reference_ce(res: dict, opts: dict) -> dict:
    """float64 cross-entropy of the saved inputs with `opts` (torch ops, written here)."""
    opts = dict(opts)
    x = res["hidden"].double().requires_grad_()
    w = res["weight"].double().requires_grad_()
    b = res["bias"].double().requires_grad_() if opts.pop("bias", False) else None
    target = res["target"]
    eps, lam = opts.get("label_smoothing", 0.0), opts.get("lse_square_scale", 0.0)
    cap, reduction = opts.get("softcap"), opts.get("reduction", "mean")
    z = x @ w.T + (0 if b is None else b)
    if cap:
        z = cap * torch.tanh(z / cap)
    keep = target != -100
    lse = torch.logsumexp(z, -1)
    zy = z.gather(1, torch.where(keep, target, 0)[:, None])[:, 0]
    rows = lse - (1 - eps) * zy - eps / z.shape[1] * z.sum(-1) + lam * lse**2
    rows = torch.where(keep, rows, 0.0)
    if reduction == "none":
        loss = rows
        rows.backward(res["up"].double())
    else:
        loss = rows.sum()
        if reduction == "mean":
            loss = loss / opts.get("num_items", keep.sum())
        loss.backward()
    return {"loss": loss, "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad}


def _reference_logprob(res: dict, opts: dict) -> dict:
    """float64 log-prob head of the saved inputs with TRL's transform (written here)."""
    opts = dict(opts)
    x = res["hidden"].double().requires_grad_()
    w = res["weight"].double().requires_grad_()
    b = res["bias"].double().requires_grad_() if opts.pop("bias", False) else None
    target = res["target"]
    y = (x @ w.T + (0 if b is None else b)) * opts.get("logit_scale", 1.0)
    cap = opts.get("softcap")
    z = (cap * torch.tanh(y / cap) if cap else y) / opts.get("temperature", 1.0)
    keep = target != -100
    log_z = torch.logsumexp(z, -1)
    logp = z - log_z[:, None]
    p = logp.exp()
    zy = z.gather(1, torch.where(keep, target, 0)[:, None])[:, 0]
    lp = torch.where(keep, zy - log_z, 0.0)
    ent = torch.where(keep, log_z - (p * z).sum(-1), 0.0)
    torch.autograd.backward([lp, ent], [res["up"].double(), res["up_ent"].double()])
    first_max = z.argmax(-1) == target
    return {
        "log_probs": lp, "entropy": ent,
        "log_sum_sq_probs": torch.where(keep, torch.log((p * p).sum(-1)), 0.0),
        "mean_logits": torch.where(keep, z.mean(-1), 0.0),
        "is_top1": keep & first_max,
        "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad,
    }  # fmt: skip


def check_vocab_parallel(ranks: list[dict]) -> None:
    from tests.distributed.scenarios import LOGPROB_CASES, VP_CASES

    world = len(ranks)
    for case, opts in VP_CASES.items():
        ref = _reference_ce(ranks[0], opts)
        for r, res in enumerate(ranks):
            got = res[case]
            # 101 rows over the ranks: ceil(101 / world) each, the last rank the rest
            per = -(-101 // world)
            assert got["local_rows"] == (per if r < world - 1 else 101 - per * (world - 1))
            assert got["dw_placements"] == "(Shard(dim=0),)"
            for key in ("loss", "dx", "dw", "db"):
                if ref[key] is None:
                    assert got[key] is None
                    continue
                err = rel_err(got[key], ref[key])
                assert err <= FP32, f"{case} rank {r} {key}: {err:.2e}"
    for case, opts in LOGPROB_CASES.items():
        ref = _reference_logprob(ranks[0], opts)
        for r, res in enumerate(ranks):
            got = res[case]
            assert torch.equal(got["is_top1"], ref["is_top1"]), (case, r)
            for key, want in ref.items():
                if key == "is_top1" or want is None:
                    assert want is not None or got[key] is None
                    continue
                err = rel_err(got[key], want)
                assert err <= FP32, f"{case} rank {r} {key}: {err:.2e}"
    for res in ranks:
        assert torch.isnan(res["differs"]["loss"])
        assert torch.isnan(res["differs"]["log_probs"]).all()


def test_vocab_parallel_loss_matches_float64_on_every_rank(two_ranks):
    check_vocab_parallel(two_ranks["vp"])


def test_ranks_holding_different_tokens_get_a_nan_loss(two_ranks):
    """The vocab-parallel heads need the same tokens on every rank; a data-parallel misuse
    (an FSDP2 shard read outside its hooks) is loud, not silently wrong."""
    for res in two_ranks["vp"]:
        assert torch.isnan(res["differs"]["loss"])
        assert torch.isnan(res["differs"]["log_probs"]).all()


def check_memory(ranks: list[dict], gathered: list[dict]) -> None:
    for res, bad in zip(ranks, gathered, strict=True):
        full = res["full_weight_bytes"]
        assert full == res["full_logits_bytes"]  # one bound covers both
        # this rank's d(weight) rows (full / ranks) and a 16-row logits tile, nothing whole
        assert res["largest"] <= full // len(ranks), res
        assert res["peak"] < 0.75 * full, res
        # passing the gathered weight (the old path) breaks the same bound
        assert bad["peak"] >= full, bad
        assert rel_err(res["loss"], bad["loss"]) <= FP32


def test_vocab_parallel_loss_never_holds_the_full_weight_or_logits(two_ranks):
    check_memory(two_ranks["memory"], two_ranks["memory-gather"])


def _ref_norm(x, w, dy, gemma: bool):
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * ((1 + w) if gemma else w)
    y.backward(dy.double())
    return y, x.grad, w.grad


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def check_dtensor_ops(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        for case in ("norm_rows", "norm_hidden"):
            for mode in ("llama", "gemma"):
                got = res[f"{case}_{mode}"]
                y, dx, dw = _ref_norm(res["x"], res["w"], res["dy"], mode == "gemma")
                for key, ref in (("y", y), ("dx", dx), ("dw", dw)):
                    assert rel_err(got[key], ref) <= FP32, (r, case, mode, key)
                n, h = res["x"].shape
                sizes = [numel for _name, numel in got["collectives"]]
                # O(tokens) or O(hidden) collectives only: never an activation-sized one
                assert max(sizes) <= max(n, h), got["collectives"]
                if case == "norm_hidden":
                    reduces = [s for name, s in got["collectives"] if "reduce" in name]
                    assert reduces == [n, n], got["collectives"]  # one per token, each way
                    assert got["placements"] == "(Shard(dim=1),)"
                else:
                    assert got["placements"] == "(Shard(dim=0),)"
        add = res["add_norm"]
        xs = (res["x"] + add["r"]).double().requires_grad_()
        w = res["w"].double().requires_grad_()
        y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        y.backward(res["dy"].double())
        for key, ref in (("y", y), ("s", xs), ("dx", xs.grad), ("dr", xs.grad), ("dw", w.grad)):
            assert rel_err(add[key], ref) <= FP32, (r, "add_norm", key)
        assert max(numel for _name, numel in add["collectives"]) <= res["x"].shape[1]
        rope = res["rope"]
        cos, sin = rope["cos"].unsqueeze(1).double(), rope["sin"].unsqueeze(1).double()
        q, k = rope["q"].double().requires_grad_(), rope["k"].double().requires_grad_()
        qo, ko = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        torch.autograd.backward([qo, ko], [rope["dq"].double(), rope["dk"].double()])
        for key, ref in (("qo", qo), ("ko", ko), ("gq", q.grad), ("gk", k.grad)):
            assert rel_err(rope[key], ref) <= FP32, (r, "rope", key)
        assert rope["placements"] == "(Shard(dim=1),)" and rope["collectives"] == []
        glu = res["silu_mul"]
        a, b = glu["a"].double().requires_grad_(), glu["b"].double().requires_grad_()
        c = F.silu(a) * b
        c.backward(glu["dc"].double())
        for key, ref in (("c", c), ("da", a.grad), ("db", b.grad)):
            assert rel_err(glu[key], ref) <= FP32, (r, "silu_mul", key)
        assert glu["collectives"] == []


def test_norms_rope_and_gated_product_compute_on_dtensor_shards(two_ranks):
    check_dtensor_ops(two_ranks["ops"])


# -- the matrix (KERNELS_SWEEP=1) ---------------------------------------------------------------

MATRIX_2 = [
    {"name": f"{kind}-{family}", "kind": kind, "family": family}
    for kind in ("tp", "cp", "fsdp2")
    for family in FAMILIES
]
MATRIX_4 = [{"name": f"tp-{family}", "kind": "tp", "family": family} for family in FAMILIES] + [
    {"name": "ops", "kind": "dtensor_ops"},
    {"name": "vp", "kind": "vocab_parallel"},
    {"name": "memory", "kind": "vocab_parallel_memory"},
    {"name": "memory-gather", "kind": "vocab_parallel_memory", "gather": True},
]
CHECKS = {"tp": check_same_batch, "cp": check_split_sequence, "fsdp2": check_split_batch}
EXPECTED_BOUND = {"llama": 10, "gemma": 10, "qwen3_moe": 14}


@sweep_only("TP 2, CP 2 and FSDP2 over Llama, Qwen3-MoE and Gemma")
def test_matrix_two_ranks(tmp_path):
    results = run_ranks(2, MATRIX_2, tmp_path)
    for scenario in MATRIX_2:
        ranks = results[scenario["name"]]
        CHECKS[scenario["kind"]](ranks, scenario["name"])
        assert len(ranks[0]["bound"]) == EXPECTED_BOUND[scenario["family"]], ranks[0]["bound"]


@sweep_only("TP 4 over Llama, Qwen3-MoE and Gemma; the vocab-parallel loss and ops on 4 ranks")
def test_matrix_four_ranks(tmp_path):
    results = run_ranks(4, MATRIX_4, tmp_path)
    for family in FAMILIES:
        ranks = results[f"tp-{family}"]
        check_same_batch(ranks, f"TP=4 {family}")
        assert ranks[0]["head_rows"] == 128
        assert len(ranks[0]["bound"]) == EXPECTED_BOUND[family]
    check_vocab_parallel(results["vp"])
    check_memory(results["memory"], results["memory-gather"])
    check_dtensor_ops(results["ops"])


@sweep_only("DeepSpeed ZeRO-3 over Llama, Qwen3-MoE and Gemma")
def test_zero3_two_ranks(tmp_path):
    pytest.importorskip("deepspeed", reason="ZeRO-3 needs deepspeed (pip install deepspeed)")
    scenarios = [{"name": f"zero3-{f}", "kind": "zero3", "family": f} for f in FAMILIES]
    results = run_ranks(2, scenarios, tmp_path, interpret=False)
    for scenario in scenarios:
        ranks = results[scenario["name"]]
        check_split_batch(ranks, scenario["name"])
        for res in ranks:
            assert res["head_shard_numel"] == 0  # lm_head.weight is an empty partition
            assert "ZeRO-3 partition" in res["outside_error"], res["outside_error"]
            assert rel_err(res["gathered_loss"], res["loss"]) <= FP32
        assert len(ranks[0]["bound"]) == EXPECTED_BOUND[scenario["family"]]
