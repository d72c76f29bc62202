"""The backbone families and their checkpoints: the paper's four and seven in use now (Qwen2.5-VL, Qwen3-VL,
InternVL3, Gemma 3, Idefics3, SmolVLM, LLaVA-OneVision-1.5); a name's family, how each family's rows are made (Rows),
and a checkpoint loaded by name (a family's short name, a hub id or a folder), frozen, with its processor (images
only: no video processor, so no torchvision) and the line that says how it encodes images. Every name, the tiny twins
and toy backbones included, loads through lab/models/backbones.py:load_backbone."""
import glob
import inspect
import json
import os
from collections import namedtuple
from dataclasses import dataclass

import torch
from transformers import (Exaone4_5_Processor, Gemma3ForConditionalGeneration, Idefics2ForConditionalGeneration,
                          Idefics3ForConditionalGeneration, IdeficsForVisionText2Text, InternVLForConditionalGeneration,
                          InternVLProcessor, LlavaForConditionalGeneration, LlavaOnevision15ForConditionalGeneration,
                          LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor,
                          Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen3VLForConditionalGeneration,
                          Qwen3VLProcessor, SmolVLMForConditionalGeneration, SmolVLMProcessor)

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
    #                                  processor's own call on the piece's text (Idefics2: no replace_image_token)
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
    splitting: str | None = None     # the image processor's setting that --image-splitting switches (tiles, crops)


QWEN = dict(placeholder="<|vision_start|><|image_pad|><|vision_end|>", end="<|im_end|>",
            inputs=("pixel_values", "image_grid_thw"))  # flattened patches and each image's grid
ROWS = {  # each family's Rows
    "idefics2": Rows(expand="text", end="<end_of_utterance>", images="canvas", raw=True,
                     splitting="do_image_splitting"),
    "idefics": Rows(images="cross-attention"),
    "llava-interleave": Rows(raw=True),
    "llava-onevision": Rows(images="multi-image", raw=True),
    "qwen2.5-vl": Rows(**QWEN, positions="model", token_types="mm_token_type_ids"),  # M-RoPE, made by the model
    "qwen3-vl": Rows(**QWEN, positions="model", token_types="mm_token_type_ids"),    # interleaved M-RoPE
    "llava-onevision-1.5": Rows(**QWEN),  # Qwen's processor, a Qwen3 text model with 1-D positions
    "internvl3": Rows(placeholder="<IMG_CONTEXT>", end="<|im_end|>", splitting="crop_to_patches"),  # <img> tiles </img>
    "gemma3": Rows(placeholder="<start_of_image>", end="<end_of_turn>", token_types="token_type_ids",
                   splitting="do_pan_and_scan"),  # its image blocks attend both ways: token_type_ids
    "idefics3": Rows(end="<end_of_utterance>", images="canvas", splitting="do_image_splitting"),
    "smolvlm": Rows(end="<end_of_utterance>", images="canvas", splitting="do_image_splitting"),
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
    "qwen2.5-vl": Family("Qwen/Qwen2.5-VL-7B-Instruct", Qwen2_5_VLForConditionalGeneration),
    "qwen3-vl": Family("Qwen/Qwen3-VL-8B-Instruct", Qwen3VLForConditionalGeneration),
    "internvl3": Family("OpenGVLab/InternVL3-8B-hf", InternVLForConditionalGeneration),
    "gemma3": Family("google/gemma-3-4b-it", Gemma3ForConditionalGeneration),
    "idefics3": Family("HuggingFaceM4/Idefics3-8B-Llama3", Idefics3ForConditionalGeneration),
    "smolvlm": Family("HuggingFaceTB/SmolVLM-256M-Instruct", SmolVLMForConditionalGeneration),
    "llava-onevision-1.5": Family("Deep-VLM/LLaVA-OneVision-1.5-8B-Instruct-hf",
                                  LlavaOnevision15ForConditionalGeneration),
}
CONFIG_TYPES = {"idefics2": "idefics2", "idefics": "idefics", "llava": "llava-interleave",
                "llava_onevision": "llava-onevision", "qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl",
                "internvl": "internvl3", "gemma3": "gemma3", "idefics3": "idefics3", "smolvlm": "smolvlm",
                "llava_onevision1_5": "llava-onevision-1.5"}


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


class ImageOnly:
    """A processor without its video processor, which needs torchvision (not a requirement: images never use it)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor" or argument is not None:
            super().check_argument_for_proper_class(argument_name, argument)


class ImageOnlyOnevisionProcessor(ImageOnly, LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor, images only."""


class ImageOnlyQwen25VLProcessor(ImageOnly, Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor, images only."""


class ImageOnlyQwen3VLProcessor(ImageOnly, Qwen3VLProcessor):
    """Qwen3VLProcessor, images only."""


class ImageOnlyOnevision15Processor(ImageOnly, Exaone4_5_Processor):
    """LLaVA-OneVision-1.5's processor (transformers maps it to Exaone4_5_Processor: Qwen's), images only."""


class ImageOnlyInternVLProcessor(ImageOnly, InternVLProcessor):
    """InternVLProcessor, images only."""


class ImageOnlySmolVLMProcessor(ImageOnly, SmolVLMProcessor):
    """SmolVLMProcessor, images only, built without num2words, which its video prompts alone use (they spell the
    frame count): a stand-in that refuses to be called takes its place while the processor is built."""

    def __init__(self, image_processor, tokenizer, video_processor=None, image_seq_len=169, chat_template=None,
                 **kwargs):  # SmolVLMProcessor's signature, which transformers reads its sub-processors off
        from transformers.models.smolvlm import processing_smolvlm as module
        held, module.num2words = module.num2words, module.num2words or no_num2words
        try:
            super().__init__(image_processor, tokenizer, video_processor, image_seq_len, chat_template, **kwargs)
        finally:
            module.num2words = held


def no_num2words(*args, **kwargs):
    """What SmolVLM's video prompts would call: never reached with images only."""
    raise ImportError("SmolVLM's video prompts need num2words (pip install num2words); images do not")


IMAGE_ONLY = {  # the families whose processor has a video processor: built without it (load_processor)
    "llava-onevision": ImageOnlyOnevisionProcessor, "qwen2.5-vl": ImageOnlyQwen25VLProcessor,
    "qwen3-vl": ImageOnlyQwen3VLProcessor, "llava-onevision-1.5": ImageOnlyOnevision15Processor,
    "internvl3": ImageOnlyInternVLProcessor, "smolvlm": ImageOnlySmolVLMProcessor}
REQUIRED_SETTINGS = {"llava-onevision": ("num_image_tokens", "vision_feature_select_strategy")}  # processor_config.json


def load_processor(path, family, image_splitting="checkpoint"):
    """The processor of the checkpoint at `path` (a hub id or a folder), its images resized by PIL on every machine,
    and the line that says how it encodes images (image_setting): (processor, line). A family with a video processor
    (IMAGE_ONLY) gets its processor class built from its tokenizer, image processor and processor_config.json (the
    settings its __init__ takes) without the video processor that AutoProcessor would build, which needs torchvision
    (not a requirement: images never use it)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)}); copy the checkpoint's "
                         "tokenizer files into it")
    code = {"trust_remote_code": False}  # never a model folder's own code
    if family not in IMAGE_ONLY:
        processor = formatted(AutoProcessor.from_pretrained(path, backend="pil", **code), family)
        return processor, image_setting(processor, family, image_splitting)
    cls, (config_file, settings) = IMAGE_ONLY[family], processor_config(path, family in REQUIRED_SETTINGS)
    missing = [k for k in REQUIRED_SETTINGS.get(family, ()) if k not in settings]
    if missing:
        raise ValueError(f"{config_file} lacks {', '.join(missing)} ({family}'s processor settings); restore the "
                         "checkpoint's processor_config.json")
    taken = set(inspect.signature(cls.__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                "video_processor", "chat_template", "kwargs"}
    own = {k: settings[k] for k in taken & set(settings)}
    images, tokenizer = AutoImageProcessor.from_pretrained(path, backend="pil", **code), \
        AutoTokenizer.from_pretrained(path, **code)
    try:
        processor = cls(images, tokenizer, None, **own)
    except (AttributeError, KeyError, TypeError) as e:  # a tokenizer without the family's named tokens, ...
        raise ValueError(f"{path}: its tokenizer and processor files do not make a {family} processor ({e}); restore "
                         "the checkpoint's tokenizer_config.json, preprocessor_config.json and "
                         "processor_config.json") from e
    return formatted(processor, family), image_setting(processor, family, image_splitting)


def processor_config(path, needed=False):
    """(file, settings) of the checkpoint's processor_config.json; none: {} (Qwen's checkpoints ship none), unless it
    is `needed` (then a ValueError naming it)."""
    from transformers.utils import cached_file
    config_file = os.path.join(path, "processor_config.json") if os.path.isdir(path) else \
        cached_file(path, "processor_config.json", _raise_exceptions_for_missing_entries=not needed)
    if (config_file is None or not os.path.exists(config_file)) and not needed:
        return config_file, {}
    try:
        with open(config_file) as f:
            settings = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file} cannot be read as JSON ({e})") from e
    if not isinstance(settings, dict):
        raise ValueError(f"{config_file} is not a JSON object; restore the checkpoint's processor_config.json")
    return config_file, settings


IMAGE_SPLITTING = ("checkpoint", "on", "off")  # --image-splitting
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")  # a folder has one at least


def image_setting(processor, family, splitting="checkpoint", source="the checkpoint's processor config"):
    """Apply --image-splitting to a family that splits or tiles its images (Rows.splitting: Idefics2's 4 crops + the
    whole image, 5 x 64 tokens an image instead of 64; Idefics3's and SmolVLM's crop grid + the whole image; InternVL's
    tiles + a thumbnail; Gemma 3's pan-and-scan crops) and return the line that says how images are encoded and where
    that comes from. A family that does neither: any setting but "checkpoint" is a ValueError, as is any other."""
    if splitting not in IMAGE_SPLITTING:  # "yes", True: never silently off
        raise ValueError(f"image splitting {splitting!r} is none of {', '.join(IMAGE_SPLITTING)}")
    setting = ROWS[family].splitting
    if setting is None:
        if splitting != "checkpoint":
            raise ValueError(f"--image-splitting {splitting}: only Idefics2 splits images (and Idefics3, SmolVLM, "
                             f"InternVL3 and Gemma 3 tile them), not {family}; drop the flag")
        if family == "llava-onevision":
            return f"images: multi-image mode, {data.onevision_tokens(processor)} tokens each (data.onevision_piece)"
        return ""
    images = processor.image_processor
    if splitting != "checkpoint":  # on the image processor (its settings) and in the processor's call
        source = f"--image-splitting {splitting}"
        setattr(images, setting, splitting == "on")
        processor.images_kwargs = {**getattr(processor, "images_kwargs", {}), setting: splitting == "on"}
    on = splitting_on(processor)
    if family == "idefics2":
        return (f"image splitting: {'on' if on else 'off'} ({source}): {5 if on else 1} crop(s) x "
                f"{processor.image_seq_len} tokens an image")
    return (f"image splitting: {'on' if on else 'off'} ({source}, {setting}): "
            + ("tiles or crops an image by its size (--plan counts its tokens)" if on else "one view an image"))


def splitting_on(processor):
    """Whether the processor splits or tiles images (its Rows.splitting setting, as its call passes it), None for a
    family that does neither."""
    setting = processor.row_format.splitting
    if setting is None:
        return None
    called = getattr(processor, "images_kwargs", {})
    return bool(called.get(setting, getattr(processor.image_processor, setting, False)))
