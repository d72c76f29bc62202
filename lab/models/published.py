"""The published checkpoints' configs written out: parameter counts, latency and memory at full size with random
weights and no download (published_model), and twins grown to a chosen width."""
import torch
from transformers import (Gemma3Config, Idefics2Config, Idefics3Config, IdeficsConfig, InternVLConfig, LlavaConfig,
                          LlavaOnevision15Config, LlavaOnevisionConfig, Qwen2_5_VLConfig, Qwen3VLConfig, SmolVLMConfig)

from lab.models import families, tiny


LLAVA_384 = dict(  # both LLaVA models: the SigLIP-384 tower, its full features, the image token
    vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                       num_attention_heads=16, image_size=384, patch_size=14, vision_use_head=False),
    vision_feature_select_strategy="full", vision_feature_layer=-1, image_token_index=151646)

QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)

PUBLISHED = {  # the real checkpoints' configs, written out, for parameter counts and latency (weights don't matter)
    "idefics2": lambda: Idefics2Config(
        text_config=dict(model_type="mistral", vocab_size=32003, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=980, patch_size=14),
        perceiver_config=dict(hidden_size=4096, resampler_n_latents=64, resampler_depth=3, resampler_n_heads=16,
                              resampler_head_dim=96, num_key_value_heads=4),
        image_token_id=32001, tie_word_embeddings=False),
    "idefics": lambda: IdeficsConfig(
        vocab_size=32000, additional_vocab_size=2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, cross_layer_interval=4, use_resampler=True,
        vision_config=dict(embed_dim=1280, image_size=224, patch_size=14, intermediate_size=5120,
                           num_hidden_layers=32, num_attention_heads=16),
        perceiver_config=dict(use_resampler=True, resampler_n_latents=64, resampler_depth=6, resampler_n_heads=16,
                              resampler_head_dim=96)),
    "llava-interleave": lambda: LlavaConfig(
        text_config=dict(model_type="qwen2", vocab_size=152000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32), **LLAVA_384),
    "llava-onevision": lambda: LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", vocab_size=152128, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4), **LLAVA_384),
    # the families in use now (their checkpoints' config.json, written out; families.FAMILIES names the checkpoints)
    "qwen2.5-vl": lambda: Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2), **QWEN_IDS,
        tie_word_embeddings=False),
    "qwen3-vl": lambda: Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]), **QWEN_IDS, tie_word_embeddings=False),
    "llava-onevision-1.5": lambda: LlavaOnevision15Config(
        text_config=dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=32768),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=4096,
                           patch_size=14, spatial_merge_size=2), **QWEN_IDS, tie_word_embeddings=False),
    "internvl3": lambda: InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=151674, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=32768),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                           image_size=[448, 448], patch_size=[14, 14], layer_scale_init_value=0.1),
        image_token_id=151667, downsample_ratio=0.5, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3Config(
        text_config=dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=1024, max_position_embeddings=131072,
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144),
    "idefics3": lambda: Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=128259, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=364, patch_size=14), scale_factor=2, image_token_id=128257,
        tie_word_embeddings=False),
    "smolvlm": lambda: SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16), scale_factor=4, image_token_id=49190,
        tie_word_embeddings=True),
}


def published_model(family, device="meta", dtype=torch.bfloat16, config=None):
    """A real-size backbone of `family` built from its published config (or `config`) with random weights (no
    download). On the meta device it holds no memory (parameter counts); on a GPU it runs at the real model's speed."""
    with torch.device(device):  # built in `dtype` directly: no float32 copy of 8B parameters on the way
        model = families.FAMILIES[family].model_cls._from_config(config or PUBLISHED[family](), dtype=dtype)
    return families.freeze(model)


def grown_twin(family, seed=0, **text):
    """The tiny twin of `family` with its text decoder's config changed by `text` (hidden_size=..., ...), seeded random
    weights, float32; keys the family's text model lacks (num_key_value_heads for Idefics, head_dim where it is
    derived) are left out. The vision side stays toy-sized. Returns (model, processor)."""
    twin, processor = tiny.TINY_BUILDERS[family](seed)
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
    lab/studies/table6.py:synthetic_prompt): the published size in bf16 on CUDA (published_model), or size "mid"
    (mid_model), float32, on the GPU if there is one."""
    family, mid = families.family_of(name), size == "mid"
    model = mid_model(family)[0].to("cuda" if torch.cuda.is_available() else "cpu") if mid else \
        published_model(family, device="cuda")
    return families.Backbone(model, None, family, f"{family} ({'mid size, ' if mid else ''}random weights)")
