"""The decoder's input embedding in a compiled step (embedding.py): which decoders the loader's
probe lets the loss layers embed for, and when the op stands in for the module's call.

Compiled, the op keeps the embedding's backward opaque, so it runs torch's own kernel instead of
Inductor's fp32 decomposition; the whole-step equality with eager is in test_compile_models.py.
"""

from __future__ import annotations

import linecache
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

from loader.training.classify import _input_embedding
from tests.class_marks import restored
from tests.models.registry import causal_lm_class, tiny_config


@pytest.fixture(autouse=True)
def _model_classes_restored():
    with restored(("llama", "gemma2", "falcon_h1")):
        yield


@pytest.mark.parametrize(
    ("model_type", "kind"),
    [
        ("llama", "plain"),  # inputs_embeds = self.embed_tokens(input_ids)
        ("gemma2", "scaled"),  # Gemma2TextScaledWordEmbedding: rows * embed_scale
        # `self.embed_tokens(input_ids) * self.embedding_multiplier`: the decoder scales them
        # itself, so handing it embeddings would drop the multiplier
        ("falcon_h1", None),
    ],
)
def test_probe_names_the_embedding_only_where_the_decoder_does_nothing_else(model_type, kind):
    model = causal_lm_class(model_type)._from_config(tiny_config(model_type))
    assert _input_embedding(model.model) == kind


def _decoder(body: str) -> nn.Module:
    """A decoder whose forward has transformers' signature and checks, then `body`."""
    source = (
        "def forward(\n"
        "    self,\n"
        "    input_ids: torch.LongTensor | None = None,\n"
        "    inputs_embeds: torch.FloatTensor | None = None,\n"
        "):\n"
        "    if (input_ids is None) ^ (inputs_embeds is not None):\n"
        '        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")\n'
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    scope: dict = {"torch": torch}
    exec(compile(source, "<decoder>", "exec"), scope)  # inspect needs a source: linecache
    linecache.cache["<decoder>"] = (len(source), None, source.splitlines(True), "<decoder>")
    cls = type("Decoder", (nn.Module,), {"forward": scope["forward"]})
    decoder = cls()
    decoder.embed_tokens = nn.Embedding(8, 4)
    return decoder


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ("if inputs_embeds is None:\n    inputs_embeds = self.embed_tokens(input_ids)\n"
         "return inputs_embeds\n", "plain"),
        # the decoder reads input_ids again: embeddings alone would lose that
        ("if inputs_embeds is None:\n    inputs_embeds = self.embed_tokens(input_ids)\n"
         "return inputs_embeds + (input_ids == 0).unsqueeze(-1)\n", None),
        # a multiplier inside the block (Falcon-H1's kind, on two lines)
        ("if inputs_embeds is None:\n    inputs_embeds = self.embed_tokens(input_ids)\n"
         "    inputs_embeds = inputs_embeds * 2.0\nreturn inputs_embeds\n", None),
        # input_ids handed on to another call
        ("if inputs_embeds is None:\n    inputs_embeds = self.embed_tokens(input_ids)\n"
         "return self.merge(\n    input_ids,\n    inputs_embeds,\n)\n", None),
        # an alias
        ("ids = input_ids\nif inputs_embeds is None:\n    inputs_embeds = self.embed_tokens(ids)\n"
         "return inputs_embeds\n", None),
        # embedding without the inputs_embeds check
        ("inputs_embeds = self.embed_tokens(input_ids)\nreturn inputs_embeds\n", None),
    ],
)  # fmt: skip
def test_probe_refuses_a_decoder_that_does_more_with_input_ids(body, kind):
    assert _input_embedding(_decoder(body)) == kind


def test_probe_refuses_an_embedding_subclass_with_another_forward():
    class Doubled(nn.Embedding):
        def forward(self, input_ids):
            return super().forward(input_ids) * 2.0

    decoder = _decoder(
        "if inputs_embeds is None:\n    inputs_embeds = self.embed_tokens(input_ids)\n"
        "return inputs_embeds\n"
    )
    decoder.embed_tokens = Doubled(8, 4)
    assert _input_embedding(decoder) is None


def _graph_of(fn) -> str:
    codes: list[str] = []

    def backend(gm, inputs):
        codes.append(gm.code)
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)()
    out.sum().backward()
    torch._dynamo.reset()
    return codes[0]


def test_compiled_embedding_uses_the_op_unless_the_module_has_a_hook(kt):
    emb = sys.modules[kt.__name__ + ".embedding"]
    module = nn.Embedding(16, 8, padding_idx=3)
    ids = torch.randint(0, 16, (2, 5))
    ids[0, 0] = 3  # the padding row gets no gradient, as in eager
    ref = module(ids)
    (ref * torch.arange(8.0)).sum().backward()
    want = module.weight.grad.clone()
    module.weight.grad = None

    code = _graph_of(lambda: emb.token_embedding(module, ids, "plain") * torch.arange(8.0))
    assert ".embedding_fwd." in code
    torch.testing.assert_close(module.weight.grad, want)
    assert module.weight.grad[3].abs().sum() == 0

    class Wrapped(nn.Module):  # what PEFT puts in its place: not the class the probe saw
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    module.weight.grad = None
    code = _graph_of(lambda: emb.token_embedding(Wrapped(module), ids, "plain") * torch.arange(8.0))
    assert ".embedding_fwd." not in code
    torch.testing.assert_close(module.weight.grad, want)

    seen = []
    module.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    module.weight.grad = None
    code = _graph_of(lambda: emb.token_embedding(module, ids, "plain") * torch.arange(8.0))
    assert ".embedding_fwd." not in code and seen  # the hook ran: the module was called
    torch.testing.assert_close(module.weight.grad, want)
