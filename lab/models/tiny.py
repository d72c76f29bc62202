"""Tiny offline twins: random weights of a few million parameters with the real processors' settings, one builder
per family (tiny-<family>), for the tests and the offline runs."""
import torch
from transformers import (Idefics2Config, Idefics2ForConditionalGeneration, Idefics2Processor,
                          Idefics2ImageProcessorPil, IdeficsConfig, IdeficsForVisionText2Text, IdeficsImageProcessorPil,
                          IdeficsProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaOnevisionConfig,
                          LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil, LlavaProcessor,
                          PreTrainedTokenizerFast, SiglipImageProcessorPil)

from lab.models import families


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
    tok = _qwen_tokenizer()
    processor = LlavaProcessor(SiglipImageProcessorPil(size={"height": 28, "width": 28}), tok, patch_size=14,
                               vision_feature_select_strategy="full")
    return _seeded(LlavaForConditionalGeneration, LlavaConfig(**_qwen_config(tok)), seed), processor


def tiny_llava_onevision(seed=0):
    """LLaVA-OneVision (Qwen2 text model, SigLIP vision tower, any-resolution tiling) at toy size."""
    tok = _qwen_tokenizer()
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    processor = families.ImageOnlyOnevisionProcessor(
        LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints), tok, None,
        num_image_tokens=4, vision_feature_select_strategy="full")
    config = LlavaOnevisionConfig(**_qwen_config(tok), image_grid_pinpoints=pinpoints)
    return _seeded(LlavaOnevisionForConditionalGeneration, config, seed), processor


TINY_BUILDERS = {"idefics2": tiny_idefics2, "idefics": tiny_idefics, "llava-interleave": tiny_llava_interleave,
                 "llava-onevision": tiny_llava_onevision}
