"""Tiny random image-text-to-text models for every model type transformers registers
(``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``), and training batches with images in them.

Used by tests/models/test_vlm_sweep.py and scripts/sweep_vlm.py; the 3-step comparison itself is
registry.compare (the causal sweep's). A tiny model is the type's default config with every
nested config shrunk: the text model as the causal sweep shrinks it (hidden 64, 2 layers, vocab
256), the vision tower to hidden 64, 2 layers, 4 heads and 8 x 8 patches per image, and every
special token id moved into the tiny vocabulary.

The batches are what the family's processor would hand the model, derived from the model
itself, not from a table of families: the pixels take the shape the vision tower's
``get_image_features`` signature and config ask for (flattened patches with a (t, h, w) grid for
the Qwen2-VL family, [images, channels, size, size] otherwise); that function, run once on them,
says how many features each image makes, and the text holds the image token that many times.
Inputs the forward takes besides (``mm_token_type_ids`` for the multimodal RoPE's positions,
``image_sizes``, pixel masks) are filled from the same facts. Where structure cannot tell, a
small per-family adapter (ADAPTERS) says what the processor would.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .registry import HIDDEN, SEQ, VOCAB, _shrink, compare

# Special token ids live at the top of the tiny vocabulary; text tokens are drawn below.
SPECIAL_BASE = VOCAB - 48
PATCHES_PER_SIDE = 8  # each image: 8 x 8 patches of the family's own patch size
IMAGES_PER_SAMPLE = 1
BATCH = 2

# Vision-tower size attributes (names the text shrink does not know) -> the tiny value.
_VISION_SHRINK = {
    "depth": 2,
    "num_heads": 4,
    "attention_heads": 4,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "mlp_dim": 128,
    "out_hidden_size": HIDDEN,
    "text_hidden_size": HIDDEN,
    "projector_hidden_size": HIDDEN,
    "num_global_layers": 1,
    "num_query_tokens": 8,
    "projection_dim": HIDDEN,  # the projector's output: the text model's width
}
# Attributes holding layer indices into the vision tower (moved into the tiny depth).
_LAYER_LISTS = ("indexes", "indices", "_layers_idx", "vision_feature_layer", "feature_layers")


@dataclass
class Images:
    """How a tiny model's images are made: pixel inputs for one batch and the number of
    features (image tokens) each image becomes."""

    inputs: dict[str, torch.Tensor]
    tokens_per_image: int


def mapping() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _sub_configs(config) -> list:
    from transformers import PretrainedConfig

    return [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]


def _shrink_vision(config) -> None:
    for key, value in _VISION_SHRINK.items():
        current = getattr(config, key, None)
        if isinstance(current, int) and not isinstance(current, bool):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001, S110 - a derived attribute: leave it
                pass
    patch = getattr(config, "patch_size", None)
    size = getattr(config, "image_size", None)
    if isinstance(patch, int) and isinstance(size, int):
        config.image_size = patch * PATCHES_PER_SIDE
    elif isinstance(patch, (list, tuple)) and isinstance(size, (list, tuple)):
        config.image_size = type(size)(p * PATCHES_PER_SIDE for p in patch)
    elif isinstance(patch, int) and isinstance(size, (list, tuple)):
        config.image_size = type(size)(patch * PATCHES_PER_SIDE for _ in size)
    _move_layer_indices(config, _first_int(config, "num_hidden_layers", "depth", "num_layers"))


def _move_layer_indices(config, depth: int | None) -> None:
    """Lists of layer indices (which layers feed a merger, run global attention, ...) moved
    into a tower `depth` layers deep, their length kept (a projector may be sized by it)."""
    if depth is None:
        return
    for key, value in list(vars(config).items()):
        if not key.endswith(_LAYER_LISTS):
            continue
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            setattr(config, key, type(value)(_into(v, depth) for v in value))
        elif isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, _into(value, depth))


def _into(index: int, depth: int) -> int:
    """A layer index of the full model moved into a model `depth` layers deep (negative ones
    count from the end, over depth + 1 hidden states)."""
    if index < 0:
        return max(index, -(depth + 1))
    return min(index, depth - 1)


def _shrink_all(config, seen: set[int]) -> None:
    if id(config) in seen:
        return
    seen.add(id(config))
    _shrink(config)
    _shrink_vision(config)
    for sub in _sub_configs(config):
        _shrink_all(sub, seen)


def _scaled_sections(sections: list[int], target: int) -> list[int]:
    """Multimodal RoPE sections (t, h, w) over `target` frequencies, in the full model's
    proportions (the sections must add up to the rotary frequencies)."""
    total = sum(sections)
    scaled = [max(1, round(s * target / total)) for s in sections]
    scaled[0] += target - sum(scaled)
    return scaled


def _fit_mrope(model) -> bool:
    """Give every rotary embedding whose mrope sections (read from its config, or its
    modeling code's default) do not cover its frequencies sections that do, in its config;
    True when one changed (the model is then built again)."""
    changed = False
    for module in model.modules():
        sections, inv_freq = (
            getattr(module, "mrope_section", None),
            getattr(module, "inv_freq", None),
        )
        config = getattr(module, "config", None)
        if not isinstance(sections, list) or inv_freq is None or config is None:
            continue
        if sum(sections) != inv_freq.numel():
            config.rope_parameters["mrope_section"] = _scaled_sections(sections, inv_freq.numel())
            changed = True
    return changed


def _fit_top(config) -> None:
    """Top-level attributes that follow the vision tower's shape: layer indices into it, the
    tokens an image is pooled to, the any-resolution tiles (one tile of the tiny image)."""
    vc = next(
        (getattr(config, n) for n in ("vision_config", "visual_config") if hasattr(config, n)),
        None,
    )
    if vc is None:
        return
    _move_layer_indices(config, _first_int(vc, "num_hidden_layers", "depth", "num_layers"))
    if isinstance(getattr(config, "mm_tokens_per_image", None), int):
        config.mm_tokens_per_image = (PATCHES_PER_SIDE // 2) ** 2
    size = _first_int(vc, "image_size")
    if size and isinstance(getattr(config, "image_grid_pinpoints", None), list):
        config.image_grid_pinpoints = [[size, size]]


def _token_id_names(config) -> list[tuple[object, str]]:
    """(config, attribute) of every special token id, in every nested config."""
    found, stack, seen = [], [config], set()
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        for key, value in vars(c).items():
            if key.endswith(("token_id", "token_index")) and isinstance(value, int):
                found.append((c, key))
        stack += _sub_configs(c)
    return found


def _move_token_ids(config) -> None:
    """Every special token id at or past the tiny vocabulary moved to its own id at the top of
    it; one id in several configs (the top config's image_token_id and its text config's) maps
    to one new id."""
    moved: dict[int, int] = {}
    for holder, key in sorted(_token_id_names(config), key=lambda x: x[1]):
        value = getattr(holder, key)
        if value < SPECIAL_BASE:
            continue
        if value not in moved:
            moved[value] = SPECIAL_BASE + len(moved)
            if moved[value] >= VOCAB:
                raise ValueError(f"more special token ids than the tiny vocabulary holds: {key}")
        try:
            setattr(holder, key, moved[value])
        except Exception:  # noqa: BLE001, S110 - a derived property: its source is moved too
            pass


def tiny_vlm_config(model_type: str):
    """The model type's default config, every nested config shrunk, token ids in the vocab."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink_all(config, set())
    _fit_top(config)
    adapter = ADAPTERS.get(model_type)
    if adapter is not None and adapter.config is not None:
        adapter.config(config)
    _move_token_ids(config)
    return config


def vlm_class(model_type: str):
    import transformers

    return getattr(transformers, mapping()[model_type])


def build_vlm(model_type: str, seed: int = 0, overrides: dict | None = None):
    config = tiny_vlm_config(model_type)
    for key, value in (overrides or {}).items():
        *path, name = key.split(".")
        holder = config
        for part in path:
            holder = getattr(holder, part)
        setattr(holder, name, value)
    torch.manual_seed(seed)
    model = vlm_class(model_type)._from_config(config, attn_implementation="eager")
    if _fit_mrope(model):
        torch.manual_seed(seed)
        model = vlm_class(model_type)._from_config(config, attn_implementation="eager")
    return model


# -- images --------------------------------------------------------------------------------------


def image_feature_fn(model) -> Callable | None:
    """The model's image-feature function (on the model or its inner model)."""
    for holder in (model, getattr(model, "model", None)):
        fn = getattr(holder, "get_image_features", None)
        if callable(fn):
            return fn
    return None


def vision_config(model):
    """The vision tower's config: the nested config that has a patch size (the model's own
    where none has)."""
    config = model.config
    for name in ("vision_config", "visual_config", "vision_tower_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            return sub
    return next((c for c in _sub_configs(config) if hasattr(c, "patch_size")), config)


def _first_int(config, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def pixel_layouts(model, n_images: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Candidate pixel inputs for `n_images` images, in the layouts families' processors make,
    read from the image-feature function's parameters and the vision config: flattened patches
    with a (t, h, w) grid where the function takes a grid (Qwen2-VL), else [images, channels,
    size, size], or with a tile axis [images, tiles, ...] (Idefics, any-resolution LLaVA)."""
    fn = image_feature_fn(model)
    params = set(inspect.signature(fn).parameters) if fn is not None else set()
    vc = vision_config(model)
    channels = _first_int(vc, "in_channels", "num_channels", "in_chans") or 3
    patch = _first_int(vc, "patch_size") or 14
    dtype = next(model.parameters()).dtype
    side = PATCHES_PER_SIDE
    if "image_grid_thw" in params:  # Qwen2-VL-style: flattened patches and a (t, h, w) grid
        grid = torch.tensor([[1, side, side]] * n_images)
        rows = n_images * side * side
        temporal = _first_int(vc, "temporal_patch_size")
        shapes = [
            (rows, channels * t * patch * patch) for t in dict.fromkeys((temporal or 1, 2, 1))
        ]
        shapes.append((rows, channels, patch, patch))
        return [
            {"pixel_values": torch.randn(shape, generator=gen).to(dtype), "image_grid_thw": grid}
            for shape in shapes
        ]
    size = _first_int(vc, "image_size") or patch * side
    layouts = []
    for tiles in (None, 1, 2):
        lead = (n_images,) if tiles is None else (n_images, tiles)
        inputs = {"pixel_values": torch.randn(*lead, channels, size, size, generator=gen).to(dtype)}
        if "image_sizes" in params:
            inputs["image_sizes"] = torch.tensor([[size, size]] * n_images)
        for mask in ("pixel_attention_mask", "pixel_mask"):
            if mask in params:
                inputs[mask] = torch.ones(*lead, size, size, dtype=torch.bool)
        layouts.append(inputs)
    return layouts


def _feature_rows(out, width: int) -> int:
    """How many feature vectors (image tokens) a get_image_features result holds: the rows of
    its features (the pooled output where it has one), each `width` wide (the text model's:
    a tower left wider than the tiny text model would be counted wrong)."""
    from transformers.utils import ModelOutput

    if isinstance(out, ModelOutput):
        pooled = getattr(out, "pooler_output", None)
        out = pooled if pooled is not None else out[0]
    if torch.is_tensor(out):
        if out.shape[-1] != width:
            raise ValueError(f"image features {out.shape[-1]} wide, the text model {width}")
        return out.shape[:-1].numel()
    if isinstance(out, (list, tuple)):
        return sum(_feature_rows(o, width) for o in out)
    raise TypeError(f"get_image_features returned {type(out).__name__}")


def make_images(model, n_images: int, gen: torch.Generator) -> Images:
    """Pixel inputs and the image tokens each image needs. Each candidate layout is run through
    get_image_features once (no gradient, eval mode); the first the model takes wins, and its
    features say how many tokens an image is. A model without image tokens in its text (the
    image prefixed, or fed to an encoder) gets pixels and no tokens."""
    adapter = ADAPTERS.get(model.config.model_type)
    if adapter is not None and adapter.images is not None:
        return adapter.images(model, n_images, gen)
    layouts = pixel_layouts(model, n_images, gen)
    fn = image_feature_fn(model)
    if image_token_id(model.config) is None or fn is None:
        return Images(layouts[0], 0)
    params = inspect.signature(fn).parameters
    width = model.config.get_text_config().hidden_size
    was = model.training
    model.eval()
    errors = []
    try:
        for inputs in layouts:
            try:
                with torch.no_grad():
                    out = fn(**{k: v for k, v in inputs.items() if k in params})
                rows = _feature_rows(out, width)
            except Exception as exc:  # noqa: BLE001 - not this layout: the next one
                errors.append(exc)
                continue
            if rows % n_images == 0 and rows:
                return Images(inputs, rows // n_images)
            errors.append(ValueError(f"{rows} image features do not split over {n_images} images"))
    finally:
        model.train(was)
    raise errors[0]


def image_token_id(config) -> int | None:
    """The token that stands for an image feature in the text; None where the text has none."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    text = config.get_text_config()
    for name in ("image_token_id", "image_token_index"):
        value = getattr(text, name, None)
        if isinstance(value, int):
            return value
    return None


def vlm_batches(model, device, steps: int = 3) -> list[dict]:
    """`steps` batches of BATCH samples, each: a few text tokens, the image token as many times
    as its image makes features, more text; labels are the tokens with the image positions
    ignored (-100), as the families' collators make them."""
    gen = torch.Generator().manual_seed(1)
    image_id = image_token_id(model.config)
    forward = set(inspect.signature(type(model).forward).parameters)
    batches = []
    for _ in range(steps):
        images = make_images(model, BATCH * IMAGES_PER_SAMPLE, gen)
        n = images.tokens_per_image * IMAGES_PER_SAMPLE
        head, tail = 3, SEQ - 3
        text = torch.randint(0, SPECIAL_BASE, (BATCH, head + tail), generator=gen)
        placeholders = torch.full((BATCH, n), SPECIAL_BASE if image_id is None else image_id)
        ids = torch.cat((text[:, :head], placeholders, text[:, head:]), dim=1)
        is_image = torch.zeros_like(ids, dtype=torch.bool)
        is_image[:, head : head + n] = True
        labels = ids.masked_fill(is_image, -100)
        batch = {"input_ids": ids, "labels": labels, **images.inputs}
        if "mm_token_type_ids" in forward:  # the multimodal RoPE's positions read them
            batch["mm_token_type_ids"] = is_image.long()
        adapter = ADAPTERS.get(model.config.model_type)
        if adapter is not None and adapter.batch is not None:
            adapter.batch(model, batch)
        batch = {k: v.to(device) for k, v in batch.items()}
        batches.append(batch)
    return batches


@dataclass(frozen=True)
class Adapter:
    """What structure cannot tell about a family: a config fix after the shrink, its own image
    inputs, and inputs that follow the text (given the batch, added to it)."""

    config: Callable | None = None
    images: Callable[..., Images] | None = None
    batch: Callable[[object, dict], None] | None = None


def _mllama_config(config) -> None:
    # one tile per image; the vision output stacks the last layer and the listed ones
    vc, text = config.vision_config, config.text_config
    vc.max_num_tiles = 1
    vc.supported_aspect_ratios = [[1, 1]]
    vc.vision_output_dim = vc.hidden_size * (len(vc.intermediate_layers_indices) + 1)
    text.cross_attention_layers = [1]


def _mllama_images(model, n_images: int, gen: torch.Generator) -> Images:
    vc = model.config.vision_config
    dtype = next(model.parameters()).dtype
    size = vc.image_size
    pixels = torch.randn(n_images, 1, 1, vc.num_channels, size, size, generator=gen).to(dtype)
    inputs = {
        "pixel_values": pixels,  # [batch, images, tiles, channels, h, w]
        "aspect_ratio_ids": torch.ones(n_images, 1, dtype=torch.long),  # [1, 1]: one tile
        "aspect_ratio_mask": torch.ones(n_images, 1, 1, dtype=torch.long),
    }
    return Images(inputs, 1)  # one <|image|> token; the text attends to the tiles across


def _mllama_batch(model, batch: dict) -> None:
    # every token from the image token on attends to its image's tile (the processor's mask)
    ids = batch["input_ids"]
    after = (ids == image_token_id(model.config)).long().cumsum(-1) > 0
    batch["cross_attention_mask"] = after.long()[:, :, None, None]


def _llama4_config(config) -> None:
    # the pixel shuffle (ratio 0.5) makes 4 x hidden channels, the projector MLP's input
    vc = config.vision_config
    vc.intermediate_size = int(vc.hidden_size / vc.pixel_shuffle_ratio**2)
    vc.projector_input_dim = vc.projector_output_dim = vc.vision_output_dim = HIDDEN


ADAPTERS: dict[str, Adapter] = {
    "mllama": Adapter(_mllama_config, _mllama_images, _mllama_batch),
    "llama4": Adapter(_llama4_config),
}


def place(path: str, decoder: str) -> str:
    """Where a report entry's module sits: "head" (the model itself), "text" (under the
    decoder, the language model) or "vision" (the vision tower and the projector)."""
    if not path:
        return "head"
    if decoder and (path == decoder or path.startswith(decoder + ".")):
        return "text"
    return "vision"


def describe(model, report, batches) -> dict:
    """The VLM sweep's details: the inputs, the image tokens per sample, and per place (text,
    vision, head) the layers bound and the reasons of what was not."""
    decoder = ""
    getter = getattr(model, "get_decoder", None)
    if callable(getter):
        try:
            found = getter()
        except (AttributeError, NotImplementedError, TypeError):
            found = None
        decoder = next((n for n, m in model.named_modules() if m is found and n), "")
    bound: dict[str, set[str]] = {"text": set(), "vision": set(), "head": set()}
    unbound: dict[str, set[str]] = {"text": set(), "vision": set(), "head": set()}
    for e in report:
        where = place(e.path, decoder)
        if e.status == "bound":
            bound[where].add(e.layer_name)
        else:
            unbound[where].add(f"{e.layer_name}: {e.reason}")
    first = batches[0]
    image = image_token_id(model.config)
    tokens = int((first["input_ids"][0] == image).sum()) if image is not None else 0
    return {
        "inputs": sorted(k for k in first if k not in ("input_ids", "labels")),
        "image_tokens": tokens,
        **{f"{k}_bound": sorted(v) for k, v in bound.items()},
        **{f"{k}_unbound": sorted(v) for k, v in unbound.items()},
    }


def run_vlm(model_type: str, *, device="cpu", dtype=torch.float32, repo=None, overrides=None):
    """registry.compare for the tiny VLM with image batches; ``details`` says what the batches
    held and where each layer bound (describe)."""
    return compare(
        model_type,
        lambda: build_vlm(model_type, overrides=overrides),
        vlm_batches,
        device=device,
        dtype=dtype,
        repo=repo,
        describe=describe,
    )


__all__ = ["build_vlm", "run_vlm", "tiny_vlm_config", "vlm_batches"]
