"""No Triton jit function that another jit function calls declares a default argument.

Triton 3.6 (torch 2.11's) hands an omitted default of a called jit function on as the plain
Python value, and compiling the call fails ("'str' object has no attribute 'type'" for an
eviction policy defaulting to ""); Triton 3.9, which these CPU tests run, accepts it, and the
interpreter never compiles. Every RMSNorm forward failed that way on the H200 (sixteenth
session). Kernels launched from the host may keep defaults: the launcher fills them in.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "hub_kernels/kernels-lab/training/build/torch-universal"


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    def is_jit(dec: ast.expr) -> bool:
        target = dec.func if isinstance(dec, ast.Call) else dec
        return isinstance(target, ast.Attribute) and target.attr == "jit"

    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(is_jit(d) for d in node.decorator_list)
    }


def _called_with_defaults(path: Path) -> list[str]:
    jit = _jit_functions(ast.parse(path.read_text()))
    called = {
        call.func.id
        for fn in jit.values()
        for call in ast.walk(fn)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in jit
    }
    return [
        f"{path.name}:{jit[name].lineno} {name}"
        for name in sorted(called)
        if jit[name].args.defaults or any(d is not None for d in jit[name].args.kw_defaults)
    ]


def test_called_jit_functions_take_no_defaults():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 10
    offending = [hit for path in files for hit in _called_with_defaults(path)]
    assert not offending, f"pass these arguments at every call instead: {offending}"
