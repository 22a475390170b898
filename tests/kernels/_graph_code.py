"""torch.compile backends for the compile tests, keeping the code of each graph they get:
`Counting` runs Dynamo's graphs with aot_eager (Dynamo and AOTAutograd, no Inductor);
`Rewriting` applies the kernels' post-grad pass to AOTAutograd's graphs first."""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import aot_eager
from torch._inductor import config as inductor_config

MARK = "kernels_training_rewriters"


class Counting:
    """The backend; `graphs` holds each graph's code, in compile order."""

    def __init__(self) -> None:
        self.graphs: list[str] = []

    def __call__(self, gm, inputs):
        self.graphs.append(gm.code)
        return aot_eager(gm, inputs)


class Rewriting:
    """A backend: AOTAutograd's forward and backward graphs, each rewritten by the pass in
    Inductor's slot (or left as they are with `rewrite=False`), then run as they are
    (Inductor's C++ build of the code around the ops takes minutes per graph on these CPUs);
    their code is kept."""

    def __init__(self, rewrite: bool = True) -> None:
        self.rewrite = rewrite
        self.codes: list[str] = []
        self.graphs: list[torch.fx.Graph] = []
        self.backend = aot_autograd(fw_compiler=self._compile, bw_compiler=self._compile)

    def _compile(self, gm, example_inputs):
        if self.rewrite:
            pass_ = inductor_config.post_grad_custom_post_pass
            assert getattr(pass_, MARK, None), "no traced op installed the kernels' pass"
            pass_(gm.graph)
            gm.recompile()
        self.codes.append(gm.code)
        self.graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    def count(self, op: str) -> int:
        return sum(code.count(f".{op}.default(") for code in self.codes)
