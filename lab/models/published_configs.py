"""The published checkpoints' configs, written out, one function a family (its record's `published`,
lab/models/families.py): parameter counts, latency and memory at full size with random weights and no download
(published.published_model). Each class is read from transformers when its config is asked for."""
import transformers


LLAVA_384 = dict(  # both LLaVA models: the SigLIP-384 tower, its full features, the image token
    vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                       num_attention_heads=16, image_size=384, patch_size=14, vision_use_head=False),
    vision_feature_select_strategy="full", vision_feature_layer=-1, image_token_index=151646)

QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)


def idefics2():
    """The published idefics2 checkpoint's config.json, written out."""
    return transformers.Idefics2Config(
        text_config=dict(model_type="mistral", vocab_size=32003, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=980, patch_size=14),
        perceiver_config=dict(hidden_size=4096, resampler_n_latents=64, resampler_depth=3, resampler_n_heads=16,
                              resampler_head_dim=96, num_key_value_heads=4),
        image_token_id=32001, tie_word_embeddings=False)


def idefics():
    """The published idefics checkpoint's config.json, written out."""
    return transformers.IdeficsConfig(
        vocab_size=32000, additional_vocab_size=2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, cross_layer_interval=4, use_resampler=True,
        vision_config=dict(embed_dim=1280, image_size=224, patch_size=14, intermediate_size=5120,
                           num_hidden_layers=32, num_attention_heads=16),
        perceiver_config=dict(use_resampler=True, resampler_n_latents=64, resampler_depth=6, resampler_n_heads=16,
                              resampler_head_dim=96))


def llava_interleave():
    """The published llava-interleave checkpoint's config.json, written out."""
    return transformers.LlavaConfig(
        text_config=dict(model_type="qwen2", vocab_size=152000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32), **LLAVA_384)


def llava_onevision():
    """The published llava-onevision checkpoint's config.json, written out."""
    return transformers.LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", vocab_size=152128, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4), **LLAVA_384)


def qwen2_5_vl():
    """The published qwen2.5-vl checkpoint's config.json, written out."""
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2), **QWEN_IDS,
        tie_word_embeddings=False)


def qwen3_vl():
    """The published qwen3-vl checkpoint's config.json, written out."""
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]), **QWEN_IDS, tie_word_embeddings=False)


def llava_onevision_1_5():
    """The published llava-onevision-1.5 checkpoint's config.json, written out."""
    return transformers.LlavaOnevision15Config(
        text_config=dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=32768),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=4096,
                           patch_size=14, spatial_merge_size=2), **QWEN_IDS, tie_word_embeddings=False)


def internvl3():
    """The published internvl3 checkpoint's config.json, written out."""
    return transformers.InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=151674, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=32768),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                           image_size=[448, 448], patch_size=[14, 14], layer_scale_init_value=0.1),
        image_token_id=151667, downsample_ratio=0.5, tie_word_embeddings=False)


def gemma3():
    """The published gemma3 checkpoint's config.json, written out."""
    return transformers.Gemma3Config(
        text_config=dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=1024, max_position_embeddings=131072,
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144)


def idefics3():
    """The published idefics3 checkpoint's config.json, written out."""
    return transformers.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=128259, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=364, patch_size=14), scale_factor=2, image_token_id=128257,
        tie_word_embeddings=False)


def smolvlm():
    """The published smolvlm checkpoint's config.json, written out."""
    return transformers.SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16), scale_factor=4, image_token_id=49190,
        tie_word_embeddings=True)


# ----------------------------------------------------- the larger checkpoints of a family (families.SIZES), by size

def resized(base, text, vision=None):
    """The config of `base` (one of the functions above) with its text model's fields `text` and its vision tower's
    fields `vision` replaced: a larger checkpoint of the same architecture."""
    config = base()
    decoder = config.get_text_config()
    decoder.update(text)
    if getattr(decoder, "layer_types", None):  # derived from the layer count at first: one a layer again
        decoder.layer_types = decoder.layer_types[:1] * decoder.num_hidden_layers
    config.vision_config.update(vision or {})
    return config


QWEN2_5_32B = dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                   num_attention_heads=40, num_key_value_heads=8)  # Qwen2.5-32B's text model
QWEN2_5_72B = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8)  # Qwen2.5-72B's text model
INTERNVIT_6B = dict(hidden_size=3200, intermediate_size=12800, num_hidden_layers=45, num_attention_heads=25,
                    use_qk_norm=True, attention_bias=False, norm_type="rms_norm")  # InternViT-6B-448px-V2.5


def qwen2_5_vl_32b():
    """Qwen/Qwen2.5-VL-32B-Instruct's config.json: Qwen2.5-32B's text model, the 7B's vision tower with its MLP
    of 3456 (hub config.json)."""
    return resized(qwen2_5_vl, QWEN2_5_32B, dict(intermediate_size=3456, out_hidden_size=5120))


def qwen2_5_vl_72b():
    """Qwen/Qwen2.5-VL-72B-Instruct's config.json: Qwen2.5-72B's text model, the vision tower of the 32B (hub
    config.json)."""
    return resized(qwen2_5_vl, QWEN2_5_72B, dict(intermediate_size=3456, out_hidden_size=8192))


def qwen3_vl_32b():
    """Qwen/Qwen3-VL-32B-Instruct's config.json: 64 layers of 5120, 64 heads of 128, 8 key/value heads, the 8B's
    vision tower (hub config.json)."""
    return resized(qwen3_vl, dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                  num_attention_heads=64, num_key_value_heads=8), dict(out_hidden_size=5120))


def internvl3_38b():
    """OpenGVLab/InternVL3-38B-hf's config.json: InternViT-6B and Qwen2.5-32B (vocabulary 151674) (hub config.json;
    InternViT-6B-448px's config.json)."""
    return resized(internvl3, {**QWEN2_5_32B, "vocab_size": 151674}, INTERNVIT_6B)


def internvl3_78b():
    """OpenGVLab/InternVL3-78B-hf's config.json: InternViT-6B and Qwen2.5-72B (vocabulary 151674) (hub config.json;
    InternViT-6B-448px's config.json)."""
    return resized(internvl3, {**QWEN2_5_72B, "vocab_size": 151674}, INTERNVIT_6B)
