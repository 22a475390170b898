"""The step timeline of scripts/bench_train.py --profile, on a hand-made chrome trace."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_train import gpu_timeline  # noqa: E402


def _op(name, ts, dur, tid=1):
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(corr, ts, tid=1, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"cat": cat, "name": name, "ts": ts, "dur": 2, "tid": tid, "args": {"correlation": corr}}


def _kernel(corr, name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_idle_gaps_go_to_the_innermost_op_that_launched_the_awaited_kernel():
    events = [
        _op("aten::linear", 0, 100),
        _op("aten::mm", 10, 20),
        _launch(1, 15),
        _kernel(1, "nvjet_gemm", 20, 50),  # busy 20..70
        _op("MyFunctionBackward", 200, 90, tid=2),
        _launch(2, 280, tid=2, name="cuLaunchKernelEx", cat="cuda_driver"),
        _kernel(2, "_rms_norm_bwd_kernel", 300, 10),  # waited 70..300
        _launch(3, 285, tid=2, name="cuLaunchKernelEx", cat="cuda_driver"),  # the last launch
        _kernel(3, "triton_poi_fused", 312, 8),  # 2 us gap: under the threshold
        _op("cudaDeviceSynchronize", 400, 50),
    ]
    t = gpu_timeline({"traceEvents": events})
    assert t["gpu_span_ms"] == 0.3 and t["gpu_busy_ms"] == 0.07 and t["gpu_idle_ms"] == 0.23
    assert t["idle_before_op"] == [[0.23, 1, "MyFunctionBackward"]]
    assert t["gpu_ms_by_category"] == {"matmul": 0.05, "triton kernels": 0.02}
    assert t["top_kernels"][0] == [0.05, 1, "nvjet_gemm"]
    assert t["host_span_ms"] == 0.28  # first op to the last launch, not the final sync


def test_no_kernels_gives_nothing():
    assert gpu_timeline({"traceEvents": [_op("aten::add", 0, 5)]}) == {}
