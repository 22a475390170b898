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

import copy
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

# Size attributes the causal sweep's shrink does not know (vision towers, projectors, Q-Formers)
# -> the tiny value.
_EXTRA_SHRINK = {
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
    "encoder_hidden_size": HIDDEN,  # a Q-Former's cross-attention reads the tower's width
    "projection_hidden_size": HIDDEN,
    "vision_hidden_size": HIDDEN,
    "word_embed_proj_dim": HIDDEN,  # OPT's embeddings (BLIP-2's text model)
    "d_kv": 16,  # T5-style attention: heads x d_kv is the model's width
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
    for key, value in _EXTRA_SHRINK.items():
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
    if isinstance(getattr(config, "mm_tokens_per_image", None), int):
        config.mm_tokens_per_image = (PATCHES_PER_SIDE // 2) ** 2  # pooled 2 x 2
    if isinstance(getattr(config, "output_multiplier", None), (int, float)):
        config.output_multiplier = 0.5  # Muse's logit scale defaults to 1: a scale would not show
    if isinstance(getattr(config, "dropout_rate", None), float):
        config.dropout_rate = 0.0  # T5-style configs' dropout: training must be deterministic
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and any("sliding" in str(k) for k in kinds):
        if getattr(config, "sliding_window", None) is None:
            config.sliding_window = 8  # sliding layers need a window; some defaults leave None
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
    if isinstance(getattr(config, "projector_patch_to_query_dict", None), dict):
        # patches per image -> the queries the projector pools them to
        config.projector_patch_to_query_dict = {PATCHES_PER_SIDE**2: 16}
        config.max_value_projector_patch_to_query_dict = 16
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


def image_feature_fns(model) -> list[Callable]:
    """The model's image-feature functions: its own, then its inner model's (whose signature
    may name what the outer one passes on in **kwargs)."""
    found = []
    for holder in (model, getattr(model, "model", None)):
        fn = getattr(holder, "get_image_features", None)
        if callable(fn):
            found.append(fn)
    return found


def vision_config(model):
    """The vision tower's config: ``vision_config`` (or a like name), else the first nested
    config, depth first, that has a patch size (the model's own where none has)."""
    config = model.config
    for name in ("vision_config", "visual_config", "vision_tower_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            return sub
    stack = list(reversed(_sub_configs(config)))
    while stack:
        sub = stack.pop()
        if hasattr(sub, "patch_size"):
            return sub
        stack += reversed(_sub_configs(sub))
    return config


def _first_int(config, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def pixel_layouts(
    model, n_images: int, gen: torch.Generator, fn: Callable | None = None, side: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Candidate pixel inputs for `n_images` images, in the layouts families' processors make,
    read from the image-feature function's parameters and the vision config: flattened patches
    with a grid where the function takes one ((t, h, w) for Qwen2-VL, (h, w) for others), else
    [images, channels, size, size], or with a tile axis [images, tiles, ...] (Idefics,
    any-resolution LLaVA); masks per pixel or per tile; sizes, merge sizes, second resolutions
    where the signature of `fn` (the model's first image-feature function by default) asks
    for them. Grids and patch sequences are `side` x `side` patches (default
    PATCHES_PER_SIDE); images made whole take the vision config's image size."""
    fn = fn or next(iter(image_feature_fns(model)), None)
    params = set(inspect.signature(fn).parameters) if fn is not None else set()
    vc = vision_config(model)
    channels = _first_int(vc, "in_channels", "num_channels", "in_chans") or 3
    patch = _first_int(vc, "patch_size") or 14
    dtype = next(model.parameters()).dtype
    side = side or PATCHES_PER_SIDE
    extras = _extra_inputs(model, params, n_images, dtype, gen, side)
    if params & {"image_grid_thw", "image_grid_hw"}:  # flattened patches and their grid
        rows = n_images * side * side
        temporal = _first_int(vc, "temporal_patch_size", "patch_temporal") or 1
        if "image_grid_thw" in params:
            grid = {"image_grid_thw": torch.tensor([[1, side, side]] * n_images)}
        else:
            grid = {"image_grid_hw": torch.tensor([[side, side]] * n_images)}
        shapes = [(rows, channels * t * patch * patch) for t in dict.fromkeys((temporal, 2, 1))]
        shapes.append((rows, channels, patch, patch))
        return [
            {"pixel_values": torch.randn(shape, generator=gen).to(dtype), **grid, **extras}
            for shape in shapes
        ]
    size = _first_int(vc, "image_size") or patch * side
    layouts = []
    for tiles in (None, 1, 2):
        lead = (n_images,) if tiles is None else (n_images, tiles)
        pixels = torch.randn(*lead, channels, size, size, generator=gen).to(dtype)
        masks = [(*lead, size, size)] + ([lead] if tiles is not None else [])
        for mask_shape in masks:
            inputs = {"pixel_values": pixels, **extras}
            if "image_sizes" in params:
                inputs["image_sizes"] = torch.tensor([[size, size]] * n_images)
            for mask in ("pixel_attention_mask", "pixel_mask"):
                if mask in params:
                    inputs[mask] = torch.ones(mask_shape, dtype=torch.bool)
            layouts.append(inputs)
    # patch sequences [images, patches, channels * patch * patch] (SigLIP 2's towers)
    rows = _patch_rows(n_images, channels, patch, gen, side)
    inputs = {"pixel_values": rows.to(dtype), **extras}
    for mask in ("pixel_attention_mask", "pixel_mask"):
        if mask in params:
            inputs[mask] = torch.ones(n_images, side * side, dtype=torch.bool)
    layouts.append(inputs)
    return layouts


def _patch_rows(
    n_images: int, channels: int, patch: int, gen: torch.Generator, side: int = PATCHES_PER_SIDE
) -> torch.Tensor:
    """[images, patches, channels * patch * patch]: each image as its sequence of patches."""
    return torch.randn(n_images, side * side, channels * patch * patch, generator=gen)


def _extra_inputs(model, params: set[str], n_images: int, dtype, gen, side: int) -> dict:
    """Inputs some image-feature functions take besides the pixels, from their names."""
    extras: dict[str, torch.Tensor] = {}
    if "spatial_shapes" in params:  # patches per image, (h, w)
        extras["spatial_shapes"] = torch.tensor([[side, side]] * n_images)
    if "image_merge_sizes" in params:
        merge = _first_int(vision_config(model), "spatial_merge_size", "merge_size") or 1
        extras["image_merge_sizes"] = torch.tensor([merge] * n_images)
    if "high_res_pixel_values" in params:  # a second tower at a higher resolution
        high = getattr(model.config, "high_res_vision_config", None)
        size = _first_int(high, "image_size") if high is not None else None
        channels = _first_int(high, "num_channels") or 3 if high is not None else 3
        size = size or 2 * side * (_first_int(high, "patch_size") or 16)
        extras["high_res_pixel_values"] = torch.randn(
            n_images, channels, size, size, generator=gen
        ).to(dtype)
    return extras


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


def make_images(model, n_images: int, gen: torch.Generator, side: int = 0) -> Images:
    """Pixel inputs and the image tokens each image needs. Each candidate layout is run through
    get_image_features once (no gradient, eval mode); the first the model takes wins, and its
    features say how many tokens an image is. A model without image tokens in its text (the
    image prefixed, or fed to an encoder) gets pixels and no tokens."""
    adapter = ADAPTERS.get(model.config.model_type)
    if adapter is not None and adapter.images is not None:
        return adapter.images(model, n_images, gen)
    fns = image_feature_fns(model)
    if image_token_id(model.config) is None or not fns:
        return Images(pixel_layouts(model, n_images, gen, side=side)[0], 0)
    width = model.config.get_text_config().hidden_size
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    errors = []
    try:
        for fn in fns:
            params = inspect.signature(fn).parameters
            for inputs in pixel_layouts(model, n_images, gen, fn, side):
                # the probe runs where the model is; the batch keeps the CPU copy
                probe = {k: _to(v, device) for k, v in inputs.items() if k in params}
                try:
                    with torch.no_grad():
                        out = fn(**probe)
                    rows = _feature_rows(out, width)
                except Exception as exc:  # noqa: BLE001 - not this layout: the next one
                    errors.append(exc)
                    continue
                if rows % n_images == 0 and rows:
                    return Images(inputs, rows // n_images)
                errors.append(ValueError(f"{rows} features do not split over {n_images} images"))
    finally:
        model.train(was)
    if len(errors) == 1:
        raise errors[0]
    raise ValueError(
        "no pixel layout fits: " + " | ".join(f"{type(e).__name__}: {_line(e)}" for e in errors)
    )


def _to(value, device: torch.device):
    """A tensor on `device`; anything else (a size list, None) as it is."""
    return value.to(device) if torch.is_tensor(value) else value


def _line(exc: BaseException) -> str:
    return next((x for x in str(exc).splitlines() if x.strip()), "")[:120]


def image_token_id(config) -> int | None:
    """The token that stands for an image feature in the text (a video model's video token);
    None where the text has none."""
    for holder in (config, config.get_text_config()):
        for name in ("image_token_id", "image_token_index", "video_token_index"):
            value = getattr(holder, name, None)
            if isinstance(value, int):
                return value
    return None


def vlm_batches(
    model, device, steps: int = 3, *, batch: int = BATCH, text: int = SEQ, side: int = 0
) -> list[dict]:
    """`steps` batches of `batch` samples, each: a few text tokens, the image token as many
    times as its image makes features, more text (`text` tokens in all); labels are the tokens
    with the image positions ignored (-100), as the families' collators make them. Text tokens
    are drawn below the special token ids at the top of the vocabulary."""
    gen = torch.Generator().manual_seed(1)
    image_id = image_token_id(model.config)
    forward = set(inspect.signature(type(model).forward).parameters)
    vocab = model.config.get_text_config().vocab_size
    # special ids live at the top of the vocabulary (pad, bos at the bottom are harmless)
    tops = [getattr(h, k) for h, k in _token_id_names(model.config)]
    low = min([vocab, *(t for t in tops if t >= vocab // 2)])
    batches = []
    for _ in range(steps):
        images = make_images(model, batch * IMAGES_PER_SAMPLE, gen, side)
        n = images.tokens_per_image * IMAGES_PER_SAMPLE
        head = 3
        words = torch.randint(0, low, (batch, text), generator=gen)
        placeholders = torch.full((batch, n), low if image_id is None else image_id)
        ids = torch.cat((words[:, :head], placeholders, words[:, head:]), dim=1)
        is_image = torch.zeros_like(ids, dtype=torch.bool)
        is_image[:, head : head + n] = True
        labels = ids.masked_fill(is_image, -100)
        inputs = {"input_ids": ids, "labels": labels, **images.inputs}
        if "mm_token_type_ids" in forward:  # the multimodal RoPE's positions read them
            inputs["mm_token_type_ids"] = is_image.long()
        adapter = ADAPTERS.get(model.config.model_type)
        if adapter is not None and adapter.batch is not None:
            adapter.batch(model, inputs)
        batches.append({k: v.to(device) for k, v in inputs.items()})
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


def _image_token(config) -> None:
    """A config whose image token defaults to None (the processor sets it): give it one, past
    the vocabulary, for _move_token_ids to place."""
    for name in ("image_token_index", "image_token_id", "video_token_index"):
        if hasattr(config, name) and getattr(config, name) is None:
            setattr(config, name, 10**6)


def _qformer_batch(model, batch: dict) -> None:
    # InstructBLIP's Q-Former reads the instruction too: its own tokens
    ids = batch["input_ids"]
    vocab = model.config.qformer_config.vocab_size
    batch["qformer_input_ids"] = (ids[:, :8] % vocab).clone()
    batch["qformer_attention_mask"] = torch.ones_like(batch["qformer_input_ids"])


def _query_images(model, n_images: int, gen: torch.Generator) -> Images:
    # a Q-Former pools each image to num_query_tokens features, the image tokens of the text
    return Images(pixel_layouts(model, n_images, gen)[0], model.config.num_query_tokens)


def _query_video(model, n_images: int, gen: torch.Generator) -> Images:
    # one frame per video: [videos, frames, channels, h, w]
    inputs = pixel_layouts(model, n_images, gen)[0]
    inputs["pixel_values"] = inputs["pixel_values"].unsqueeze(1)
    return Images(inputs, model.config.num_query_tokens)


def _gemma4_config(config) -> None:
    # the default config has no vision tower: the tiny model gets one (patches pooled 3 x 3)
    import transformers

    name = type(config).__name__.replace("Config", "VisionConfig")  # Gemma4(Unified)VisionConfig
    config.vision_config = getattr(transformers, name)()
    _shrink_all(config.vision_config, set())


def _gemma4_images(model, n_images: int, gen: torch.Generator) -> Images:
    vc = model.config.vision_config
    side = 2 * vc.pooling_kernel_size  # a 6 x 6 grid, pooled to 2 x 2 tokens
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack((xs.flatten(), ys.flatten()), -1).expand(n_images, -1, -1)
    pixels = torch.rand(n_images, side * side, 3 * vc.patch_size**2, generator=gen)
    inputs = {
        "pixel_values": pixels.to(next(model.parameters()).dtype),
        "image_position_ids": positions.contiguous(),
    }
    return Images(inputs, (side // vc.pooling_kernel_size) ** 2)


def _hunyuan_vl_config(config) -> None:
    # its axes are (1-D positions..., width, height, image index), listed by mrope_section
    config.text_config.rope_parameters["mrope_section"] = [2, 2, 2, 2]


def _muse_config(config) -> None:
    # the projector takes the merged patches: the tower's width times merge_size^2
    vc = config.vision_config
    config.out_hidden_size = vc.hidden_size * vc.merge_size**2


def _step3p7_config(config) -> None:
    config.get_text_config().sliding_window = 8  # its mask asks for a window


def _fuyu_images(model, n_images: int, gen: torch.Generator) -> Images:
    # Fuyu's processor cuts the image into patch rows, one embedding each
    c = model.config
    patches = _patch_rows(n_images, c.num_channels, c.patch_size, gen)
    return Images({"pixel_values": patches.to(next(model.parameters()).dtype)}, patches.shape[1])


def _pix2struct_images(model, n_images: int, gen: torch.Generator) -> Images:
    # flattened patches: (row, column) then the patch's pixels; the decoder reads the text
    vc = model.config.vision_config
    side = PATCHES_PER_SIDE
    rows, cols = torch.meshgrid(torch.arange(side) + 1, torch.arange(side) + 1, indexing="ij")
    pixels = torch.randn(n_images, side * side, vc.patch_embed_hidden_size, generator=gen)
    ids = torch.stack((rows.flatten(), cols.flatten()), -1).float().expand(n_images, -1, -1)
    patches = torch.cat((ids, pixels), -1).to(next(model.parameters()).dtype)
    mask = torch.ones(n_images, side * side)
    return Images({"flattened_patches": patches, "attention_mask": mask}, 0)


def _kosmos2_batch(model, batch: dict) -> None:
    # the image embeddings go where the mask says: latent_query_num tokens after the first
    ids = batch["input_ids"]
    n = model.config.latent_query_num
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 1 : 1 + n] = True
    batch["image_embeds_position_mask"] = mask


def _kosmos2_images(model, n_images: int, gen: torch.Generator) -> Images:
    inputs = pixel_layouts(model, n_images, gen)[0]
    # placeholder tokens for the latent queries (the text model ignores their ids)
    return Images(inputs, model.config.latent_query_num)


def _encoder_decoder_config(config) -> None:
    # the decoder starts from its own start token and pads with its pad token
    decoder = config.get_text_config()
    pad = getattr(decoder, "pad_token_id", None)
    pad = 0 if pad is None else pad
    start = next(
        (
            getattr(decoder, name)
            for name in ("decoder_start_token_id", "bos_token_id")
            if getattr(decoder, name, None) is not None
        ),
        pad,
    )
    config.pad_token_id, config.decoder_start_token_id = pad, start


def _udop_batch(model, batch: dict) -> None:
    # a layout model: one box per token (here all the page)
    ids = batch["input_ids"]
    batch["bbox"] = torch.zeros(*ids.shape, 4, dtype=torch.long)


def _idefics_images(model, n_images: int, gen: torch.Generator) -> Images:
    inputs = pixel_layouts(model, n_images, gen)[0]
    inputs["pixel_values"] = inputs["pixel_values"].unsqueeze(1)  # [batch, images, c, h, w]
    return Images(inputs, 0)  # the text attends to the image across (no tokens for it)


def _idefics_batch(model, batch: dict) -> None:
    ids = batch["input_ids"]
    batch["image_attention_mask"] = torch.ones(*ids.shape, 1, dtype=torch.long)


ADAPTERS: dict[str, Adapter] = {
    "vision-encoder-decoder": Adapter(_encoder_decoder_config),
    "udop": Adapter(_encoder_decoder_config, batch=_udop_batch),
    "idefics": Adapter(images=_idefics_images, batch=_idefics_batch),
    "mllama": Adapter(_mllama_config, _mllama_images, _mllama_batch),
    "llama4": Adapter(_llama4_config),
    "blip-2": Adapter(_image_token, _query_images),
    "instructblip": Adapter(_image_token, _query_images, _qformer_batch),
    "instructblipvideo": Adapter(_image_token, _query_video, _qformer_batch),
    "nemotron_h_omni": Adapter(_image_token),
    "gemma4": Adapter(_gemma4_config, _gemma4_images),
    "gemma4_unified": Adapter(_gemma4_config),  # its patches enter pooled: no input here yet
    "hunyuan_vl": Adapter(_hunyuan_vl_config),
    "muse_glimmer": Adapter(_muse_config),
    "muse_spark": Adapter(_muse_config),
    "step3p7": Adapter(_step3p7_config),
    "fuyu": Adapter(images=_fuyu_images),
    "pix2struct": Adapter(images=_pix2struct_images),
    "kosmos-2": Adapter(images=_kosmos2_images, batch=_kosmos2_batch),
}


# the loss layers: the head wherever it binds (Pix2Struct's decoder computes the loss)
LOSS_LAYERS = ("ForCausalLM", "MoEForCausalLM", "CausalLMHead")


def place(path: str, decoder: str, layer: str = "") -> str:
    """Where a report entry's module sits: "head" (the model itself, or the loss layer where
    a child computes the loss), "text" (under the decoder, the language model) or "vision"
    (the vision tower and the projector)."""
    if not path or layer in LOSS_LAYERS:
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
        where = place(e.path, decoder, e.layer_name if e.status == "bound" else "")
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


def _on_cpu(model):
    """The model itself on the CPU, else a CPU copy: the layout probe's wrong guesses index out
    of range, which on a GPU is a device-side assert that ends the process's CUDA context."""
    if next(model.parameters()).device.type == "cpu":
        return model
    return copy.deepcopy(model).to("cpu")


def run_vlm(model_type: str, *, device="cpu", dtype=torch.float32, repo=None, overrides=None):
    """registry.compare for the tiny VLM with image batches; ``details`` says what the batches
    held and where each layer bound (describe)."""
    return compare(
        model_type,
        lambda: build_vlm(model_type, overrides=overrides),
        lambda model, to: vlm_batches(_on_cpu(model), to),
        device=device,
        dtype=dtype,
        repo=repo,
        describe=describe,
    )


__all__ = ["build_vlm", "run_vlm", "tiny_vlm_config", "vlm_batches"]
