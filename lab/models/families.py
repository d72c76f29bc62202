"""The paper's four backbone families and their checkpoints: a name's family, and a checkpoint loaded by name (a
family's short name, a hub id or a folder), frozen, with its processor and the line that says how it encodes images.
Every name, the tiny twins and toy backbones included, loads through lab/models/backbones.py:load_backbone."""
import glob
import json
import os
from collections import namedtuple
from dataclasses import dataclass

import torch
from transformers import (Idefics2ForConditionalGeneration, IdeficsForVisionText2Text, LlavaForConditionalGeneration,
                          LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor)

import data


@dataclass
class Backbone:
    """A loaded backbone: the model (frozen, eval mode), its processor, its family and the name it was loaded by."""
    model: torch.nn.Module
    processor: object
    family: str
    name: str
    images: str = ""  # how its processor encodes images, and where that setting comes from (image_setting)


Family = namedtuple("Family", ["hub_id", "model_cls"])  # the checkpoint the paper uses, the class that loads it


@dataclass(frozen=True)
class Rows:
    """How a family's rows are made beyond what its processor does, read by data.py off the processor
    (processor.row_format, set by `formatted`): what stands for an image in a piece and how it is expanded, the end
    of an answer, the positions, the per-token tensor the forward takes and how a batch's images are laid out."""
    placeholder: str = "<image>"     # a piece's image in its text; the processor's image_token in it is expanded
    expand: str = "image"            # "image": by replace_image_token of the processed image; "text": by the
    #                                  processor's own call on the piece's text (Idefics2, which has no replace_image_token)
    end: str | None = None           # the token that closes an answer (None: the tokenizer's eos)
    positions: str = "1-d"           # "1-d": cumsum - 1 over the real tokens; "model": none given, the model makes
    #                                  its own from input_ids, token types, image grids and the attention mask (M-RoPE)
    token_types: str | None = None   # the forward's per-token tensor, 1 on image tokens (create_mm_token_type_ids)
    images: str = "concat"           # "concat": every image tensor along dim 0; "canvas": a row's crops on one canvas
    #                                  [B, crops, 3, H, W] + pixel_attention_mask; "multi-image": LLaVA-OneVision's
    #                                  (data.onevision_piece); "cross-attention": Idefics' (its processor's tensors)
    inputs: tuple = ("pixel_values",)  # what of the image processor's output the forward takes, per image
    raw: bool = False                # pixels stopped before rescaling and normalisation (uint8), normalised on the
    #                                  device (data.normalised); else the image processor's own float32 pixels


ROWS = {  # each family's Rows
    "idefics2": Rows(expand="text", end="<end_of_utterance>", images="canvas", raw=True),
    "idefics": Rows(images="cross-attention"),
    "llava-interleave": Rows(raw=True),
    "llava-onevision": Rows(images="multi-image", raw=True),
}


def formatted(processor, family):
    """The processor with its family's Rows as processor.row_format (what data.py builds rows by)."""
    processor.row_format = ROWS[family]
    return processor
FAMILIES = {
    "idefics2": Family("HuggingFaceM4/idefics2-8b-base", Idefics2ForConditionalGeneration),
    "idefics": Family("HuggingFaceM4/idefics-9b", IdeficsForVisionText2Text),
    "llava-interleave": Family("llava-hf/llava-interleave-qwen-7b-hf", LlavaForConditionalGeneration),
    "llava-onevision": Family("llava-hf/llava-onevision-qwen2-7b-ov-hf", LlavaOnevisionForConditionalGeneration),
}
CONFIG_TYPES = {"idefics2": "idefics2", "idefics": "idefics", "llava": "llava-interleave",
                "llava_onevision": "llava-onevision"}


def load_checkpoint(name, device=None, dtype=None, image_splitting="checkpoint", check=None):
    """One of the paper's backbones by name: a family's short name (its hub id, FAMILIES), a hub id or a checkpoint
    folder; bf16 on CUDA (the default device when there is one), float32 on CPU, frozen, the weights read straight
    to the device. image_splitting: Idefics2's, as the processor has it ("checkpoint") or "on" / "off"
    (image_setting). check(path): run on the checkpoint's folder or hub id before anything loads
    (lab/models/backbones.py checks its config and eos ids there)."""
    family = family_of(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    path = FAMILIES[family].hub_id if name == family else name
    if check:
        check(path)
    processor, images = load_processor(path, family, image_splitting)
    model, info = FAMILIES[family].model_cls.from_pretrained(  # never a model folder's own code
        path, dtype=dtype, attn_implementation="sdpa", device_map={"": placed(device)}, output_loading_info=True,
        trust_remote_code=False)
    if info["missing_keys"]:  # transformers would initialise them at random
        missing, weights = sorted(info["missing_keys"]), glob.glob(os.path.join(glob.escape(path), "*.safetensors"))
        raise ValueError(f"--model: {weights[0] if len(weights) == 1 else path} lacks the tensor {missing[0]}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + "; restore its weights")
    return ready(model, processor, family, name, images)


def family_of(name):
    """The family of a backbone name: a short name, `tiny-<family>`, `toy-idefics2` or a toy backbone's file, or a hub
    id / local path of a family."""
    if name == "toy-idefics2" or is_toy_file(name):
        return "idefics2"
    short = name.removeprefix("tiny-")
    if short in FAMILIES:
        return short
    config_file = os.path.join(name, "config.json")
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError too; nested too deeply
            raise ValueError(f"--model: {config_file} is not valid JSON ({e}); restore the model folder's "
                             "config.json") from e
        if not isinstance(config, dict):
            raise ValueError(f"--model: {config_file} is not a JSON object; restore the model folder's config.json")
        model_type = config.get("model_type")
        if model_type in CONFIG_TYPES:
            return CONFIG_TYPES[model_type]
        raise ValueError(f"--model: {config_file} has model_type {model_type!r}, none of {sorted(CONFIG_TYPES)}")
    if os.path.isdir(name):
        raise ValueError(f"--model: the folder {name} has no config.json; give a checkpoint folder (config.json, "
                         "weights, tokenizer and processor files)")
    hub = {spec.hub_id: family for family, spec in FAMILIES.items()}
    if name in hub:
        return hub[name]
    if os.sep in name or name.startswith("."):
        raise ValueError(f"--model: there is no folder {name}, and it is none of the hub ids {sorted(hub)}; give a "
                         "checkpoint folder or one of those")
    raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(FAMILIES)}, "
                     f"{sorted('tiny-' + f for f in FAMILIES)}, toy-idefics2, a toy backbone's .safetensors file, or a "
                     "local path of one of those families")


def is_toy_file(name):
    """Whether a backbone name is a toy backbone's file (a build of train.py --build-toy)."""
    return name.endswith(".safetensors")


def freeze(model):
    """No backbone parameter trains; eval mode (no dropout)."""
    return model.requires_grad_(False).eval()


def placed(device):
    """torch.device of `device`, "cuda" being this process's GPU (torchrun: its LOCAL_RANK's): where the weights are
    read to, straight from the checkpoint's files."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def ready(model, processor, family, name, images):
    """The Backbone of a loaded model: frozen, its tokenizer capped at the text model's context (context_limit)."""
    context_limit(processor, model.config)
    return Backbone(freeze(model), processor, family, name, images)


def context_limit(processor, config):
    """Cap the processor's tokenizer's model_max_length at the text model's positions (config's)."""
    positions = config.get_text_config().max_position_embeddings
    processor.tokenizer.model_max_length = min(processor.tokenizer.model_max_length, positions)


class ImageOnlyOnevisionProcessor(LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor without its video processor (which needs torchvision; images never use it)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor" or argument is not None:
            super().check_argument_for_proper_class(argument_name, argument)


def load_processor(path, family, image_splitting="checkpoint"):
    """The processor of the checkpoint at `path` (a hub id or a folder), its images resized by PIL on every machine,
    and the line that says how it encodes images (image_setting): (processor, line). LLaVA-OneVision's is built from
    its tokenizer, image processor and processor_config.json without the video processor that AutoProcessor would
    build, which needs torchvision (not a requirement: images never use it)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import cached_file
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)}); copy the checkpoint's "
                         "tokenizer files into it")
    if family != "llava-onevision":
        processor = formatted(AutoProcessor.from_pretrained(path, backend="pil", trust_remote_code=False), family)
        return processor, image_setting(processor, family, image_splitting)
    config_file = os.path.join(path, "processor_config.json") if os.path.isdir(path) else \
        cached_file(path, "processor_config.json")
    try:
        with open(config_file) as f:
            settings = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file} cannot be read as JSON ({e})") from e
    keys = ("num_image_tokens", "vision_feature_select_strategy", "image_token", "video_token", "vision_aspect_ratio")
    missing = [k for k in keys[:2] if k not in settings]
    if missing:
        raise ValueError(f"{config_file} lacks {', '.join(missing)} (LLaVA-OneVision's processor settings); restore "
                         "the checkpoint's processor_config.json")
    code = {"trust_remote_code": False}  # never a model folder's own code
    processor = ImageOnlyOnevisionProcessor(AutoImageProcessor.from_pretrained(path, backend="pil", **code),
                                            AutoTokenizer.from_pretrained(path, **code), None,
                                            **{k: settings[k] for k in keys if k in settings})
    return formatted(processor, family), image_setting(processor, family, image_splitting)


IMAGE_SPLITTING = ("checkpoint", "on", "off")  # --image-splitting
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")  # a folder has one at least


def image_setting(processor, family, splitting="checkpoint", source="the checkpoint's processor config"):
    """Apply --image-splitting to Idefics2's processor (4 crops + the whole image, 5 x 64 tokens an image, instead of
    the whole image's 64) and return the line that says how images are encoded and where that comes from.
    Another family's processor does not split: any setting but "checkpoint" is then a ValueError, as is any other."""
    if splitting not in IMAGE_SPLITTING:  # "yes", True: never silently off
        raise ValueError(f"image splitting {splitting!r} is none of {', '.join(IMAGE_SPLITTING)}")
    if family != "idefics2":
        if splitting != "checkpoint":
            raise ValueError(f"--image-splitting {splitting}: only Idefics2 splits images, not {family}; drop the flag")
        if family == "llava-onevision":
            return f"images: multi-image mode, {data.onevision_tokens(processor)} tokens each (data.onevision_piece)"
        return ""
    images = processor.image_processor
    if splitting != "checkpoint":
        images.do_image_splitting, source = splitting == "on", f"--image-splitting {splitting}"
    crops = 5 if images.do_image_splitting else 1
    return (f"image splitting: {'on' if images.do_image_splitting else 'off'} ({source}): {crops} crop(s) x "
            f"{processor.image_seq_len} tokens an image")
