"""transformers' KernelConfig path on a CUDA GPU, against a `kernels serve` mirror of hub_kernels/.

KernelConfig refuses "cpu" inside transformers, so this is where the user flow of the docs runs
end to end: from_pretrained(use_kernels=True, kernel_config=...), model.train(), forward,
backward, optimizer steps, with the kernel's forward counted and its Triton launches recorded
on the device (the Python wrapper runs whichever path it takes; the launches show Triton ran).
Run in its own pytest process (see conftest.py).
"""

from __future__ import annotations

import copy
import sys
import uuid
from collections import Counter
from pathlib import Path

import kernels
import pytest
import torch
from kernels.layers import (
    CUDAProperties,
    Device,
    KernelizeFallback,
    LocalLayerRepository,
    Mode,
    kernelize,
    last_report,
    mapping,
    register_kernel_mapping,
)
from kernels.layers.binding import bound_layer

from tests.gpu.launches import TritonLaunches
from tests.layers.helpers import NORMS, calls_of, kernel_files, tiny_qwen3, tokens, write_repo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

transformers = pytest.importorskip("transformers")
HUB_KERNELS = Path(__file__).resolve().parents[2] / "hub_kernels"
SPEC = "kernels-lab/training:RMSNorm"


@pytest.fixture(autouse=True)
def _fresh_mapping():
    token = mapping._MAPPING.set(())
    yield
    mapping._MAPPING.reset(token)


@pytest.fixture
def mirror(hub):
    """The local Hub serving the repos of hub_kernels/ (kernels-lab is a trusted publisher)."""
    built = hub.build(HUB_KERNELS)
    assert any(repo.repo_id == "kernels-lab/training" for repo in built)
    return {repo.repo_id: repo for repo in built}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    tiny_qwen3(seed=11).save_pretrained(path)
    return path


@pytest.fixture
def rms_norm_calls(mirror, monkeypatch) -> Counter:
    """Counts calls of the training kernel's rms_norm made by its RMSNorm layer."""
    kernel = kernels.get_kernel("kernels-lab/training", version=1)
    calls: Counter = Counter()
    original = kernel.layers.rms_norm

    def counting(*args, **kwargs):
        calls["rms_norm"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel.layers, "rms_norm", counting)
    return calls


def kernel_launches(kernel) -> TritonLaunches:
    """A recorder of every Triton kernel of the loaded kernel package (all its submodules)."""
    prefix = kernel.__name__ + "."
    modules = [m for name, m in sys.modules.items() if name.startswith(prefix)]
    return TritonLaunches(*modules, device=True)


def load(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="cuda", **kwargs)


def rms_entries(report):
    return [e for e in report.bound if e.layer_name == "RMSNorm"]


def test_kernel_config_kernel_stays_bound_through_training(mirror, saved, rms_norm_calls):
    from transformers import KernelConfig

    reference = load(saved)
    config = KernelConfig(kernel_mapping={"RMSNorm": SPEC})
    model = load(saved, use_kernels=True, kernel_config=config)
    report = last_report(model)
    assert report.device == "cuda" and report.mode == Mode.INFERENCE
    commit = mirror["kernels-lab/training"].commit
    assert [e.kernel for e in rms_entries(report)] == [
        f"kernels-lab/training@{commit}/torch-universal:RMSNorm"
    ] * NORMS

    x = tokens().cuda()
    with torch.no_grad():
        got, expected = model(x).logits, reference(x).logits
    assert rms_norm_calls["rms_norm"] == NORMS
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    model.train()  # transformers re-kernelizes for Mode.TRAINING with the INFERENCE-only config
    reference.train()
    report = last_report(model)
    assert report.mode == Mode.TRAINING and len(rms_entries(report)) == NORMS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    kernel = kernels.get_kernel("kernels-lab/training", version=1)
    for step in range(4):
        rms_norm_calls.clear()
        with kernel_launches(kernel) as launches:
            loss = model(x, labels=x).loss
            loss.backward()
        ref_loss = reference(x, labels=x).loss
        ref_loss.backward()
        assert rms_norm_calls["rms_norm"] == NORMS, f"step {step}"
        # One forward and one backward launch per norm; step 0 also tunes the backward's
        # launch shape (each candidate launched several times), later steps reuse it.
        counts = launches.counts()
        assert counts["_rms_norm_fwd_kernel"] == NORMS, counts
        if step > 0:
            assert counts["_rms_norm_bwd_kernel"] == NORMS, counts
        else:
            assert counts["_rms_norm_bwd_kernel"] >= NORMS, counts
        launches.assert_device_matches()
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        torch.testing.assert_close(
            model.model.norm.weight.grad, reference.model.norm.weight.grad, rtol=1e-3, atol=1e-4
        )
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()


def test_kernel_config_reuse(mirror, saved, rms_norm_calls):
    """transformers rewrites KernelConfig.kernel_mapping in place while loading, so the same
    object cannot be passed twice (a crash inside transformers, before any call into this
    package). A deep copy taken before the first use can."""
    from transformers import KernelConfig

    config = KernelConfig(kernel_mapping={"RMSNorm": SPEC})
    spare = copy.deepcopy(config)
    first = load(saved, use_kernels=True, kernel_config=config)
    assert len(rms_entries(last_report(first))) == NORMS
    with pytest.raises(AttributeError, match="partition"):
        load(saved, use_kernels=True, kernel_config=config)
    second = load(saved, use_kernels=True, kernel_config=spare)
    assert len(rms_entries(last_report(second))) == NORMS


def test_capability_ranges_follow_the_gpu_the_model_is_on(tmp_path):
    path = write_repo(tmp_path / "k", kernel_files(salt=uuid.uuid4().hex))
    major, minor = torch.cuda.get_device_capability()
    here = major * 10 + minor
    model = tiny_qwen3().cuda()
    repo = LocalLayerRepository(path, layer_name="RMSNorm")
    register_kernel_mapping(
        {"RMSNorm": {Device("cuda", CUDAProperties(here + 1, here + 10)): repo}}
    )
    kernelize(model, mode=Mode.INFERENCE)
    entry = last_report(model)["model.norm"]
    assert (
        entry.fallback == KernelizeFallback.NO_COMPATIBLE_PROPERTIES and str(here) in entry.reason
    )
    register_kernel_mapping({"RMSNorm": {Device("cuda", CUDAProperties(here, here)): repo}})
    kernelize(model, mode=Mode.INFERENCE)
    assert last_report(model)["model.norm"].status == "bound"
    with torch.no_grad():
        model(tokens().cuda())
    assert calls_of(bound_layer(model.model.norm))["RMSNorm"] == NORMS


def test_trainer_keeps_the_training_kernels_through_train(mirror, saved, tmp_path, monkeypatch):
    """transformers.Trainer on the GPU, with the whole training mapping loaded via KernelConfig:
    every layer stays bound through Trainer.train() (which calls model.train() itself), each
    kernel runs in every step, and the loss follows a model without kernels."""
    from transformers import KernelConfig, Trainer, TrainingArguments
    from transformers.models.qwen3 import modeling_qwen3

    kernels.replace_kernel_forward_from_hub(modeling_qwen3.Qwen3MLP, "SwiGLUMLP")
    kernels.replace_kernel_forward_from_hub(modeling_qwen3.Qwen3ForCausalLM, "ForCausalLM")
    repo = "kernels-lab/training"
    config = KernelConfig(
        kernel_mapping={
            "RMSNorm": f"{repo}:MemoryEfficientRMSNorm",
            "rotary_pos_emb": f"{repo}:rotary_pos_emb",
            "SwiGLUMLP": f"{repo}:SwiGLUMLP",
            "ForCausalLM": f"{repo}:ForCausalLM",
        }
    )
    model = load(saved, use_kernels=True, kernel_config=config)
    reference = load(saved)
    kernel = kernels.get_kernel(repo, version=1)
    calls: Counter = Counter()
    for name in ("rms_norm", "apply_rotary_pos_emb", "gated_mlp"):
        original = getattr(kernel.layers, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel.layers, name, counting)
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, 1000, (32,))} for _ in range(16)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    results = {}
    for name, m in (("kernels", model), ("reference", reference)):
        args = TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=4,
            report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0,
            learning_rate=1e-3,
        )  # fmt: skip
        trainer = Trainer(model=m, args=args, train_dataset=data)
        with kernel_launches(kernel) as launches:
            trainer.train()
        results[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if name == "kernels":  # every layer's Triton kernels ran on the GPU, forward and backward
            for triton_kernel in (
                "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_rope_kernel", "_glu_fwd_kernel",
                "_glu_bwd_kernel", "_ce_lean_kernel",
            ):  # fmt: skip
                launches.assert_launched(triton_kernel)
            launches.assert_device_matches()
        else:
            assert not launches.launches  # the reference ran no kernel of ours
    report = last_report(model)
    assert report.mode & Mode.TRAINING
    bound = Counter(e.layer_name for e in report.bound)
    assert bound == {"RMSNorm": NORMS, "rotary_pos_emb": 2, "SwiGLUMLP": 2, "ForCausalLM": 1}
    # 4 steps: every norm, rotary and MLP call went through the kernels
    assert calls["rms_norm"] == 4 * NORMS
    assert calls["apply_rotary_pos_emb"] == 4 * 2 and calls["gated_mlp"] == 4 * 2
    assert len(results["kernels"]) == 4
    torch.testing.assert_close(
        torch.tensor(results["kernels"]), torch.tensor(results["reference"]), rtol=1e-4, atol=1e-4
    )
