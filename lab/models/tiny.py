"""Tiny offline twins: random weights of a few million parameters with the real processors' settings, one builder
per family (its record's `twin`, loaded as tiny-<family>; each reads its transformers classes when called), for the
tests and the offline runs. Their tokenizers are stand-ins (a small byte-level BPE trained here) holding each family's
special tokens; the real vocabularies are in tools/twins.py's checkpoint folders where a package ships them (Mistral's,
Qwen's)."""
import torch

from lab.models.image_only import image_only


TINY_CORPUS = ("Answer the question about the image in a few words. Describe the image in one sentence. "
               "Question: What colour is the shape? Short answer: red green blue yellow purple orange white black "
               "Question: How many shapes are there? Short answer: one two three four five 0 1 2 3 4 5 6 7 8 9 "
               "Question: Which shape is it? Short answer: circle square triangle star "
               "Question: Is the shape on the left or the right? Short answer: left right top bottom yes no "
               "Caption: a picture of a small big shape on a plain background with the of and in is are there.")


def tiny_tokenizer(special, extra, vocab_size=384, corpus=TINY_CORPUS, **named):
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic), with the family's special tokens:
    `special`, every special token, in id order after the 256 byte symbols' merges; the last `extra` of them are the
    additional special tokens; named: bos_token=..., etc."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus] * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    tok.add_special_tokens({"additional_special_tokens": special[-extra:]})
    return tok


TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=4096)

TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=28, patch_size=14)


def _seeded(model_cls, config, seed):
    torch.manual_seed(seed)
    return model_cls(config)


def _idefics_tokenizer(**corpus):
    return tiny_tokenizer(["<unk>", "<s>", "</s>", "<fake_token_around_image>", "<image>", "<end_of_utterance>"], 3,
                          unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>", **corpus)


def tiny_idefics2(seed=0):
    """Idefics2 (Mistral text model with grouped-query attention, perceiver resampler) at toy size."""
    from transformers import (Idefics2Config, Idefics2ForConditionalGeneration, Idefics2ImageProcessorPil,
                             Idefics2Processor)
    tok = _idefics_tokenizer()
    n_latents = 4
    processor = Idefics2Processor(Idefics2ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 28,
                                  "shortest_edge": 28}), tok, image_seq_len=n_latents)
    config = Idefics2Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), num_key_value_heads=2, **TINY_TEXT,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=TINY_VISION,
        perceiver_config=dict(hidden_size=64, resampler_n_latents=n_latents, resampler_depth=1, resampler_n_heads=2,
                              resampler_head_dim=16, num_key_value_heads=1),
        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    return _seeded(Idefics2ForConditionalGeneration, config, seed), processor


def tiny_idefics(seed=0):
    """Idefics (LLaMA text model with gated cross-attention to a perceiver over CLIP features) at toy size."""
    from transformers import IdeficsConfig, IdeficsForVisionText2Text, IdeficsImageProcessorPil, IdeficsProcessor
    tok = _idefics_tokenizer()
    processor = IdeficsProcessor(IdeficsImageProcessorPil(image_size=28), tok, image_size=28)
    config = IdeficsConfig(
        vocab_size=len(tok), additional_vocab_size=0, **TINY_TEXT, cross_layer_interval=1,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        use_resampler=True, vision_config=dict(embed_dim=32, image_size=28, patch_size=14, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2),
        perceiver_config=dict(use_resampler=True, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                              resampler_head_dim=16))
    return _seeded(IdeficsForVisionText2Text, config, seed), processor


def _qwen_tokenizer():
    return tiny_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"], 4,
                          eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _qwen_config(tok):
    """The config arguments both tiny LLaVA twins share: a Qwen2 text model, a SigLIP tower, full features."""
    return dict(text_config=dict(model_type="qwen2", vocab_size=len(tok), num_key_value_heads=2, **TINY_TEXT,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id),
                vision_config=dict(model_type="siglip_vision_model", **TINY_VISION),
                vision_feature_select_strategy="full", vision_feature_layer=-1,
                image_token_index=tok.convert_tokens_to_ids("<image>"))


def tiny_llava_interleave(seed=0):
    """LLaVA-Interleave (Qwen text model, SigLIP vision tower, one token per patch) at toy size."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, SiglipImageProcessorPil
    tok = _qwen_tokenizer()
    processor = LlavaProcessor(SiglipImageProcessorPil(size={"height": 28, "width": 28}), tok, patch_size=14,
                               vision_feature_select_strategy="full")
    return _seeded(LlavaForConditionalGeneration, LlavaConfig(**_qwen_config(tok)), seed), processor


def tiny_llava_onevision(seed=0):
    """LLaVA-OneVision (Qwen2 text model, SigLIP vision tower, any-resolution tiling) at toy size."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                             LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor)
    tok = _qwen_tokenizer()
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    processor = image_only(LlavaOnevisionProcessor)(
        LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints), tok, None,
        num_image_tokens=4, vision_feature_select_strategy="full")
    config = LlavaOnevisionConfig(**_qwen_config(tok), image_grid_pinpoints=pinpoints)
    return _seeded(LlavaOnevisionForConditionalGeneration, config, seed), processor


QWEN_VL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                   "<|video_pad|>"]  # Qwen2-VL's, in the order of their published ids (151643, 151644, 151645, ...)


def _qwen_vl_tokenizer(extra=(), **named):
    """A stand-in for Qwen's tokenizer with its vision tokens (and `extra`); eos <|im_end|>."""
    special = QWEN_VL_SPECIAL + list(extra)
    return tiny_tokenizer(special, len(special) - 1, eos_token="<|im_end|>", pad_token="<|endoftext|>", **named)


def _qwen_vl_ids(tok):
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def _text(tok, **more):
    """A tiny text config over `tok`: its vocabulary and special ids, grouped key/value heads, head_dim 16."""
    return dict(vocab_size=len(tok), num_key_value_heads=2, head_dim=16, **TINY_TEXT, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **more)


def _qwen_images(patch, temporal=2):
    """Qwen's dynamic-resolution image processor at toy size: images resized to multiples of 2 patches, 4 to 16
    merged tokens (the benchmarks' 64 x 64 images: 4)."""
    from transformers import Qwen2VLImageProcessorPil
    unit = (2 * patch) ** 2
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 4 * unit, "longest_edge": 16 * unit}, patch_size=patch,
                                    merge_size=2, temporal_patch_size=temporal)


MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # 8 = head_dim / 2 frequencies
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2)


def tiny_qwen2_5_vl(seed=0):
    """Qwen2.5-VL (Qwen2 text model with M-RoPE, a windowed ViT over dynamic-resolution patches) at toy size."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    tok = _qwen_vl_tokenizer()
    processor = image_only(Qwen2_5_VLProcessor)(_qwen_images(14), tok, None)
    config = Qwen2_5_VLConfig(text_config=_text(tok, rope_parameters=MROPE),
                              vision_config=dict(QWEN_VISION, patch_size=14, temporal_patch_size=2, window_size=56,
                                                 fullatt_block_indexes=[0]), **_qwen_vl_ids(tok))
    return _seeded(Qwen2_5_VLForConditionalGeneration, config, seed), processor


def tiny_qwen3_vl(seed=0):
    """Qwen3-VL (Qwen3 text model with interleaved M-RoPE, DeepStack: the vision layer's features added to the first
    decoder layer's image tokens) at toy size."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    tok = _qwen_vl_tokenizer()
    processor = image_only(Qwen3VLProcessor)(_qwen_images(16), tok, None)
    config = Qwen3VLConfig(text_config=_text(tok, rope_parameters={**MROPE, "mrope_interleaved": True}),
                           vision_config=dict(QWEN_VISION, patch_size=16, temporal_patch_size=2,
                                              num_position_embeddings=16, deepstack_visual_indexes=[0]),
                           **_qwen_vl_ids(tok))
    return _seeded(Qwen3VLForConditionalGeneration, config, seed), processor


def tiny_llava_onevision_1_5(seed=0):
    """LLaVA-OneVision-1.5 (Qwen3 text model, 1-D positions; a RICE ViT over Qwen's patches, no temporal patch)."""
    from transformers import Exaone4_5_Processor, LlavaOnevision15Config, LlavaOnevision15ForConditionalGeneration
    tok = _qwen_vl_tokenizer()
    processor = image_only(Exaone4_5_Processor)(_qwen_images(14, temporal=1), tok, None)
    config = LlavaOnevision15Config(text_config=_text(tok, model_type="qwen3"),
                                    vision_config=dict(QWEN_VISION, patch_size=14), **_qwen_vl_ids(tok))
    return _seeded(LlavaOnevision15ForConditionalGeneration, config, seed), processor


INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}  # InternVL3-hf's tokenizer names them so


def tiny_internvl3(seed=0):
    """InternVL3 (Qwen2 text model, InternViT over 28 x 28 tiles, pixel shuffle to one token a tile; up to 4 tiles and
    a thumbnail) at toy size."""
    from transformers import (GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration,
                             InternVLProcessor)
    tok = _qwen_vl_tokenizer(INTERNVL_TOKENS.values(), extra_special_tokens=INTERNVL_TOKENS)
    images = GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=False, min_patches=1,
                                      max_patches=4)
    processor = image_only(InternVLProcessor)(images, tok, None, image_seq_length=1)
    config = InternVLConfig(vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, image_size=[28, 28], patch_size=[14, 14]),
                            text_config=_text(tok, model_type="qwen2"), image_token_id=tok.context_image_token_id,
                            downsample_ratio=0.5)
    return _seeded(InternVLForConditionalGeneration, config, seed), processor


GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def tiny_gemma3(seed=0):
    """Gemma 3 (sliding-window and global layers, SigLIP at 28 x 28 pooled to 4 tokens, bidirectional attention inside
    an image: token_type_ids) at toy size."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor
    tok = tiny_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                          *GEMMA_TOKENS.values()], 5, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                         unk_token="<unk>", extra_special_tokens=GEMMA_TOKENS)
    processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tok, image_seq_length=4)
    text = _text(tok, sliding_window=8, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text,  # query_pre_attn_scalar = head_dim, as Gemma-3-4B's (256)
                          vision_config=dict(TINY_VISION), mm_tokens_per_image=4, boi_token_index=tok.boi_token_id,
                          eoi_token_index=tok.eoi_token_id, image_token_index=tok.image_token_id)
    return _seeded(Gemma3ForConditionalGeneration, config, seed), processor


IDEFICS3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<pad>", "<fake_token_around_image>", "<image>",
                    "<end_of_utterance>", "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7)
                                                             for j in range(1, 7)]


def _idefics3_like(config_cls, model_cls, images_cls, processor_cls, seed):
    """Idefics3 or SmolVLM (a LLaMA text model, SigLIP at 56 x 56 with pixel shuffle to 4 tokens a crop, images split
    into a grid of crops + the whole image) at toy size."""
    from transformers import SmolVLMProcessor
    tok = tiny_tokenizer(IDEFICS3_SPECIAL, len(IDEFICS3_SPECIAL) - 3, vocab_size=448, bos_token="<|begin_of_text|>",
                         eos_token="<|end_of_text|>", pad_token="<pad>")
    images = images_cls(size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True)
    processor = processor_cls(images, tok, *([None] if processor_cls is image_only(SmolVLMProcessor) else []),
                              image_seq_len=4)
    config = config_cls(text_config=_text(tok, model_type="llama"), vision_config=dict(TINY_VISION, image_size=56),
                        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    return _seeded(model_cls, config, seed), processor


def tiny_idefics3(seed=0):
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                             Idefics3Processor)
    return _idefics3_like(Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                          Idefics3Processor, seed)


def tiny_smolvlm(seed=0):
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil, SmolVLMProcessor
    return _idefics3_like(SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil,
                          image_only(SmolVLMProcessor), seed)
