"""The work of a forward without running it, from the model's sizes (flop_model: the meta device is enough): its
FLOPs and the bytes it moves (roofline.py turns them into time).

FLOPs: a forward over T tokens costs 2 x (decoder parameters) x T for the linear layers, 4 x layers x heads x head
size x T^2 for attention (as torch's FLOP counter counts SDPA, unmasked), 2 x width x vocabulary at each position
whose logits are computed, and per image what its towers compute (image_flops): 2 x (vision tower and connector
parameters) x patches + 4 x vision layers x width x patches^2 (patches: its crops' or tiles', or Qwen's grid; a
connector after a merge of patches, Qwen's merger or a pixel shuffle, at the merged tokens: merge_share; a perceiver
resampler at its latents; Qwen2.5-VL's windowed vision layers counted as full attention, an upper bound); a training
step's student is a forward and a backward of about the same cost (the frozen backbone's weights get no gradient);
generating a token is a forward of one token over the cache. Bytes (moved): the weights a forward runs read once, the
KV cache read and written, the activations written and read once. Checked against torch.utils.flop_counter on the
tiny twins (tests/lab/studies/test_table_plan.py) and on the published vision towers and connectors
(tests/lab/studies/test_roofline.py)."""
import math

import model as M

VISION_PARTS = ("vision", "visual", "connector", "projector", "resampler")  # the image side's modules, by name
MERGED = ("merger", "connector", "projector")  # what runs after a merge of patches into image tokens, by name


def merge_share(config):
    """The image tokens a vision patch becomes where the model merges patches before its connector (Qwen's 2 x 2
    merger: 1/4; InternVL's pixel shuffle, downsample_ratio 0.5: 1/4; Idefics3's, scale_factor 2: 1/4); else 1."""
    merge = getattr(config.vision_config, "spatial_merge_size", None)
    if merge:
        return 1 / merge ** 2
    if getattr(config, "downsample_ratio", None):
        return config.downsample_ratio ** 2
    return 1 / config.scale_factor ** 2 if getattr(config, "scale_factor", None) else 1


def flop_model(model):
    """What forward_flops needs of a model (meta device is enough): decoder-layer parameters, attention sizes, the LM
    head's width x vocabulary, the image side's parameters (the children of model.model named by VISION_PARTS; those
    of its modules named by MERGED apart, with the share of a patch they see, merge_share) and its layers, width and
    patches (the config's image size)."""
    text, vision = model.config.get_text_config(), model.config.vision_config
    layers, heads, head_dim = M.attention_shape(model)
    count = lambda named: sum(p.numel() for n, child in named for p in child.parameters())
    image = [(n, c) for n, c in model.model.named_children() if any(part in n for part in VISION_PARTS)]
    share = merge_share(model.config)
    merged = [] if share == 1 else [(n, m) for n, m in model.model.named_modules() if n.split(".")[0] in dict(image)
                                    and any(part in n.split(".")[-1] for part in MERGED)]
    merged = [(n, m) for n, m in merged if not any(n.startswith(o + ".") for o, _ in merged)]  # outermost only
    resampler = [(n, m) for n, m in model.model.named_modules() if n.split(".")[-1] == "perceiver_resampler"]
    keys = [(n, m) for _, r in resampler for n, m in r.named_modules() if n.split(".")[-1] in ("k_proj", "v_proj")]
    perceiver = getattr(model.config, "perceiver_config", None)
    vision_layers = getattr(vision, "num_hidden_layers", None) or getattr(vision, "depth", 0)
    vision_width = getattr(vision, "hidden_size", None) or getattr(vision, "embed_dim", 0)
    return {"decoder": count((n, c) for n, c in model.get_decoder().named_children()
                             if n in ("layers", "gated_cross_attn_layers")),
            "layers": layers, "heads": heads, "attention": layers * heads * head_dim,
            "head": text.hidden_size * text.vocab_size, "vision": count(image) - count(merged) - count(resampler),
            "merged": count(merged), "merge_share": share, "parameters_image": count(image),
            "resampler_keys": count(keys), "resampler": count(resampler) - count(keys),
            "latents": perceiver.resampler_n_latents if resampler else 0,
            "resampler_attention": perceiver.resampler_depth * perceiver.resampler_n_heads *
            perceiver.resampler_head_dim if resampler else 0,
            "vision_attention": vision_layers * vision_width, "vision_layers": vision_layers,
            "vision_width": vision_width,
            "image_layers": vision_layers + (perceiver.resampler_depth if resampler else 0),
            "kv": layers * (getattr(text, "num_key_value_heads", None) or heads) * head_dim,
            "activation": layers * (3 * text.intermediate_size + 5 * text.hidden_size),
            "patches": math.prod(size // patch for size, patch in zip(sides(getattr(vision, "image_size", 0)),
                                                                        sides(vision.patch_size)))}


def sides(size):
    """(height, width) of a config's size: one number (both sides) or a pair (InternVL's [448, 448])."""
    return tuple(size) if isinstance(size, (list, tuple)) else (size, size)


def forward_flops(f, tokens, images, logits=1, patches=None):
    """FLOPs of one forward over `tokens` tokens holding `images` images of `patches` patches each (None: the
    config's image size), computing logits at `logits` positions (the time model in the module's docstring)."""
    return 2 * f["decoder"] * tokens + 4 * f["attention"] * tokens ** 2 + 2 * f["head"] * logits + \
        images * image_flops(f, patches or f["patches"])


def image_flops(f, patches):
    """FLOPs of one image of `patches` vision patches, as its towers compute them: the vision tower and a connector
    at every patch, a connector after a merge of patches at the merged tokens (merge_share), a perceiver resampler
    at its latents (its keys and values over the patches and the latents, its queries and MLP over the latents)."""
    tower = 2 * (f["vision"] + f["merged"] * f["merge_share"]) * patches + 4 * f["vision_attention"] * patches ** 2
    context = patches + f["latents"]
    return tower + 2 * f["resampler_keys"] * context + 2 * f["resampler"] * f["latents"] + \
        4 * f["resampler_attention"] * f["latents"] * context


def step_flops(f, past):
    """FLOPs of one generated token: a one-token forward over a cache of `past` tokens."""
    return 2 * f["decoder"] + 4 * f["attention"] * past + 2 * f["head"]


def generate_flops(f, prompt, images, new, patches=None):
    """FLOPs of answering one prompt: its forward, then `new` tokens, each a one-token forward over the cache."""
    return forward_flops(f, prompt, images, 1, patches) + sum(step_flops(f, prompt + k) for k in range(new))


def moved(f, batch, tokens, images, patches, past=0, b=2):
    """Bytes a forward of `batch` rows of `tokens` new tokens (`images` images of `patches` patches each, a cache of
    `past` tokens before them) moves, in `b`-byte values: the weights it runs read once (the image side's only with
    images), the KV cache read and written, each decoder layer's activations B T (3 i + 5 d) and each vision layer's
    12 d_v a patch written and read once."""
    weights = f["decoder"] + f["head"] + (f["parameters_image"] if images else 0)
    rows = 2 * f["kv"] * (past + tokens) + f["activation"] * tokens + images * patches * 12 * f["vision_attention"]
    return b * (weights + batch * rows)
