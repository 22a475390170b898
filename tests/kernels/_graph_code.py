"""A torch.compile backend for the compile tests: keeps the code of each graph Dynamo hands it
(one per compile or recompile), then runs aot_eager (Dynamo and AOTAutograd, no Inductor)."""

from __future__ import annotations

from torch._dynamo.backends.debugging import aot_eager


class Counting:
    """The backend; `graphs` holds each graph's code, in compile order."""

    def __init__(self) -> None:
        self.graphs: list[str] = []

    def __call__(self, gm, inputs):
        self.graphs.append(gm.code)
        return aot_eager(gm, inputs)
