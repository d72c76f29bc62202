"""Backbones at the published size or grown from a tiny twin, with random weights and no download: parameter counts,
latency and memory at full size (published_model, from the family record's published config), and twins grown to a
chosen width (grown_twin, mid_model)."""
import os

import torch
from transformers import AutoConfig

from lab.models import families, tiny


def published_model(family, device="meta", dtype=torch.bfloat16, config=None):
    """A real-size backbone of `family` built from its published config (or `config`) with random weights (no
    download). On the meta device it holds no memory (parameter counts); on a GPU it runs at the real model's speed."""
    with torch.device(device):  # built in `dtype` directly: no float32 copy of 8B parameters on the way
        record = families.FAMILIES[family]
        model = record.model_cls()._from_config(config or record.published(), dtype=dtype)
    return families.freeze(model)


def grown_twin(family, seed=0, **text):
    """The tiny twin of `family` with its text decoder's config changed by `text` (hidden_size=..., ...), seeded random
    weights, float32; keys the family's text model lacks (num_key_value_heads for Idefics, head_dim where it is
    derived) are left out. The vision side stays toy-sized. Returns (model, processor)."""
    twin, processor = families.FAMILIES[family].built_twin(seed)
    config = twin.config  # the twin itself is not kept
    decoder = config.get_text_config()
    decoder.update({k: v for k, v in text.items() if hasattr(decoder, k)})
    if getattr(decoder, "layer_types", None):
        decoder.layer_types = decoder.layer_types[:1] * decoder.num_hidden_layers
    if hasattr(getattr(config, "perceiver_config", None), "hidden_size"):  # Idefics2's perceiver feeds the decoder
        config.perceiver_config.hidden_size = decoder.hidden_size
    return families.freeze(tiny._seeded(type(twin), config, seed)), processor


def mid_model(family, seed=0):
    """A mid-size backbone of `family` for CPU benchmarks, so latency is the decoder's: the twin grown to 8 layers x
    1024, 16 heads of 64, 4 key/value heads where the family groups them. Returns (model, processor)."""
    return grown_twin(family, seed, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64)


def random_backbone(name, size="published"):
    """--random-weights: a backbone of the family of `name` with random weights and no processor (synthetic prompts,
    lab/studies/efficiency.py:synthetic_prompt): the published size in bf16 on CUDA (published_model), or size "mid"
    (mid_model), float32, on the GPU if there is one."""
    family, mid = families.family_of(name), size == "mid"
    model = mid_model(family)[0].to("cuda" if torch.cuda.is_available() else "cpu") if mid else \
        published_model(family, device="cuda")
    return families.Backbone(model, None, family, f"{family} ({'mid size, ' if mid else ''}random weights)")


def meta_model(name):
    """--model `name` on the meta device (no memory, no weights) from its published config (a short name: a family's
    or one of families.SIZES') or its folder's config.json; None for any other name (built or a hub id)."""
    if os.path.isdir(name):
        return published_model(families.family_of(name), config=AutoConfig.from_pretrained(name,
                                                                                            trust_remote_code=False))
    if name in families.FAMILIES or name in families.SIZES:
        family = families.family_of(name)
        return published_model(family, config=families.published_of(name, family)())
    return None
