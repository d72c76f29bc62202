"""The backbone families and their checkpoints: the paper's four and seven in use now (Qwen2.5-VL, Qwen3-VL,
InternVL3, Gemma 3, Idefics3, SmolVLM, LLaVA-OneVision-1.5), one record each (Family, registered in FAMILIES: the one
place a family's name is looked up); a name's family, how each family's rows are made (Rows), and a checkpoint loaded
by name (a family's short name, a hub id or a folder), frozen, with its processor (images only: no video processor,
so no torchvision) and the line that says how it encodes images. Every name, the tiny twins and toy backbones
included, loads through lab/models/backbones.py:load_backbone."""
import glob
import inspect
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
import transformers
from packaging.version import Version

import data
from lab.models import image_layouts, published_configs, synthetic_images, tiny, vision_towers
from lab.models.image_only import image_only


@dataclass
class Backbone:
    """A loaded backbone: the model (frozen, eval mode), its processor, its family and the name it was loaded by."""
    model: torch.nn.Module
    processor: object
    family: str
    name: str
    images: str = ""  # how its processor encodes images, and where that setting comes from (image_setting)

    @property
    def record(self):
        """Its family's record (FAMILIES), for the wings below lab/models that read one (RICES's tower)."""
        return FAMILIES[self.family]


@dataclass(frozen=True)
class Rows:
    """How a family's rows are made beyond what its processor does, read by data.py off the processor
    (processor.row_format, set by `formatted`): what stands for an image in a piece and how it is expanded, the end
    of an answer, the positions, the per-token tensor the forward takes and which image tensors it takes."""
    placeholder: str = "<image>"     # a piece's image in its text; the processor's image_token in it is expanded
    expand: str = "image"            # "image": by the image layout's tokens for the processed image; "text": by the
    #                                  processor's own call on the piece's text (Idefics2: no replace_image_token)
    end: str | None = None           # the token that closes an answer (None: the tokenizer's eos)
    positions: str = "1-d"           # "1-d": cumsum - 1 over the real tokens; "model": none given, the model makes
    #                                  its own from input_ids, token types, image grids and the attention mask (M-RoPE)
    token_types: str | None = None   # the forward's per-token tensor, 1 on image tokens (create_mm_token_type_ids)
    inputs: tuple = ("pixel_values",)  # what of the image processor's output the forward takes, per image
    raw: bool = False                # pixels stopped before rescaling and normalisation (uint8), normalised on the
    #                                  device (data.normalised); else the image processor's own float32 pixels
    splitting: str | None = None     # the image processor's setting that --image-splitting switches (tiles, crops)

    def token_inputs(self, processor, input_ids, attention_mask):
        """A left-padded batch's per-token inputs beside its ids (data.collate): positions "1-d", position_ids =
        cumsum - 1 over the real tokens (0 on padding); "model", none (M-RoPE: the model makes them from the ids,
        token types, image grids and attention mask). And the forward's per-token tensor (token_types): 1 on image
        tokens, 0 on padding."""
        out = {}
        if self.positions == "1-d":
            out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        if self.token_types:
            out[self.token_types] = torch.tensor(processor.create_mm_token_type_ids(input_ids)) * attention_mask
        return out


@dataclass(frozen=True)
class Family:
    """One backbone family, the one place its name is looked up (FAMILIES): its checkpoint, its classes by name (read
    from transformers when the family is asked for, so a transformers without a newer family's classes still serves
    the others), its config.json model_type(s), its rows, its image layout, its default shots, its published config
    and its tiny twin. Adding a family is one record in FAMILIES (register), plus a layout class in
    lab/models/image_layouts.py if it brings a new layout (docs/real-models.md, "Adding a family")."""
    name: str                         # the short name (--model), `tiny-<name>` its twin
    hub_id: str                       # the checkpoint the short name loads
    model_class: str                  # transformers' class that loads it, by name (model_cls)
    processor_class: str              # its processor's class, by name (processor_cls; AutoProcessor finds the others)
    config_types: tuple               # the model_type(s) of its checkpoints' config.json (family_of a folder)
    rows: Rows                        # how its rows are made (processor.row_format)
    layout: str                       # its image layout, a key of image_layouts.LAYOUTS (processor.image_layout)
    published: Callable               # () -> its published checkpoint's config (lab/models/published_configs.py)
    twin: Callable                    # (seed) -> its tiny twin (model, processor) (lab/models/tiny.py)
    default_shots: int = 8            # the teacher's and n-shot ICL's ICDs a query (data.SHOTS, default_shots)
    shots_on_every_task: bool = False  # default_shots on MME and SEED too, not their 2 (data.SHOTS_ON_EVERY_TASK)
    image_only: bool = False          # its processor has a video processor: built without it (load_processor)
    required_settings: tuple = ()     # processor_config.json settings its processor cannot do without
    crops: int | None = None          # views an image is split into when splitting is on (Idefics2: 4 crops + whole)
    synthetic: Callable | None = None  # Table 6's synthetic images of it (lab/models/synthetic_images.py; None: none)
    tower: vision_towers.Tower | None = None  # its vision tower as RICES's encoder (None: --rices-encoder needed)
    needs: str | None = None          # the transformers version that first has its classes (their refusal says so)

    def model_cls(self):
        """Its model class, from transformers (missing_class's refusal where this transformers lacks it)."""
        return self.transformers_class(self.model_class)

    def processor_cls(self):
        """Its processor class, from transformers, images only where it has a video processor (image_only)."""
        cls = self.transformers_class(self.processor_class)
        return image_only(cls) if self.image_only else cls

    def transformers_class(self, name):
        """transformers' class `name`, or an ImportError naming this family and the version it needs (missing)."""
        if missing := self.missing():
            raise ImportError(missing)
        return getattr(transformers, name)

    def missing(self):
        """Why this transformers cannot serve the family (None if it can): older than `needs`, or without one of its
        classes. The twin, the published config and the checkpoint are refused with it, by name."""
        old = self.needs and Version(transformers.__version__) < Version(self.needs)
        absent = [c for c in (self.model_class, self.processor_class) if not hasattr(transformers, c)]
        if old or absent:
            return (f"{self.name} needs transformers >= {self.needs or 'a newer version'}" +
                    (f" (for {absent[0]})" if absent else "") + f"; this is {transformers.__version__}")
        return None

    def built_twin(self, seed=0):
        """Its tiny twin (model, processor), refused by name where this transformers cannot serve it (missing)."""
        if missing := self.missing():
            raise ImportError(missing)
        return self.twin(seed)


def register(family):
    """Add `family` to FAMILIES (and its default shots to data.SHOTS) after checking it: a new name, a layout
    image_layouts.LAYOUTS knows, config model_types no other family claims, default shots of at least 1. A ValueError
    names what is wrong."""
    registry = FAMILIES
    if family.name in registry:
        raise ValueError(f"family {family.name!r} is registered already; give the new record another name")
    if family.layout not in image_layouts.LAYOUTS:
        raise ValueError(f"family {family.name!r}: image layout {family.layout!r} is none of "
                         f"{sorted(image_layouts.LAYOUTS)}; add its class to lab/models/image_layouts.py:LAYOUTS")
    claimed = {t: f.name for f in registry.values() for t in f.config_types}
    if not family.config_types or any(t in claimed for t in family.config_types):
        taken = [f"{t} ({claimed[t]})" for t in family.config_types if t in claimed]
        raise ValueError(f"family {family.name!r}: config model_types {list(family.config_types)} must be at least one "
                         f"and none another family's" + (f"; taken: {', '.join(taken)}" if taken else ""))
    if not isinstance(family.default_shots, int) or isinstance(family.default_shots, bool) or family.default_shots < 1:
        raise ValueError(f"family {family.name!r}: default_shots is {family.default_shots!r}; give the ICDs a query "
                         "of its n-shot ICL and teacher (an integer of at least 1)")
    registry[family.name] = family
    data.SHOTS[family.name] = family.default_shots
    if family.shots_on_every_task:
        data.SHOTS_ON_EVERY_TASK.add(family.name)
    return family


QWEN = dict(placeholder="<|vision_start|><|image_pad|><|vision_end|>", end="<|im_end|>",
            inputs=("pixel_values", "image_grid_thw"))  # flattened patches and each image's grid
CANVAS = dict(end="<end_of_utterance>", splitting="do_image_splitting")  # Idefics3's and SmolVLM's rows
FAMILIES = {}
for _family in (  # the paper's four (their default shots as the paper runs them), then the seven in use now
        Family("idefics2", "HuggingFaceM4/idefics2-8b-base", "Idefics2ForConditionalGeneration", "Idefics2Processor",
               ("idefics2",), Rows(expand="text", end="<end_of_utterance>", raw=True, splitting="do_image_splitting"),
               "canvas", published_configs.idefics2, tiny.tiny_idefics2, crops=5, tower=vision_towers.PaddedTower(),
               synthetic=synthetic_images.idefics2),
        Family("idefics", "HuggingFaceM4/idefics-9b", "IdeficsForVisionText2Text", "IdeficsProcessor", ("idefics",),
               Rows(), "cross-attention", published_configs.idefics, tiny.tiny_idefics, default_shots=32,
               tower=vision_towers.Tower("vision_model"), synthetic=synthetic_images.idefics,
               shots_on_every_task=True),  # the paper's 2-shot MME and SEED: Idefics2-8B-base's (Table 2's text)
        Family("llava-interleave", "llava-hf/llava-interleave-qwen-7b-hf", "LlavaForConditionalGeneration",
               "LlavaProcessor", ("llava",), Rows(raw=True), "concat", published_configs.llava_interleave,
               tiny.tiny_llava_interleave, tower=vision_towers.Tower(),
               synthetic=synthetic_images.llava_interleave),
        Family("llava-onevision", "llava-hf/llava-onevision-qwen2-7b-ov-hf", "LlavaOnevisionForConditionalGeneration",
               "LlavaOnevisionProcessor", ("llava_onevision",), Rows(raw=True), "multi-image",
               published_configs.llava_onevision, tiny.tiny_llava_onevision, image_only=True,
               required_settings=("num_image_tokens", "vision_feature_select_strategy"),
               tower=vision_towers.Tower(first_view=True), synthetic=synthetic_images.llava_onevision),
        Family("qwen2.5-vl", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2_5_VLForConditionalGeneration",
               "Qwen2_5_VLProcessor", ("qwen2_5_vl",), Rows(**QWEN, positions="model", token_types="mm_token_type_ids"),
               "concat", published_configs.qwen2_5_vl, tiny.tiny_qwen2_5_vl, image_only=True),  # M-RoPE, the model's
        Family("qwen3-vl", "Qwen/Qwen3-VL-8B-Instruct", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor",
               ("qwen3_vl",), Rows(**QWEN, positions="model", token_types="mm_token_type_ids"), "concat",
               published_configs.qwen3_vl, tiny.tiny_qwen3_vl, image_only=True),  # interleaved M-RoPE
        Family("internvl3", "OpenGVLab/InternVL3-8B-hf", "InternVLForConditionalGeneration", "InternVLProcessor",
               ("internvl",), Rows(placeholder="<IMG_CONTEXT>", end="<|im_end|>", splitting="crop_to_patches"),
               "concat", published_configs.internvl3, tiny.tiny_internvl3, image_only=True),  # <img> tiles </img>
        Family("gemma3", "google/gemma-3-4b-it", "Gemma3ForConditionalGeneration", "Gemma3Processor", ("gemma3",),
               Rows(placeholder="<start_of_image>", end="<end_of_turn>", token_types="token_type_ids",
                    splitting="do_pan_and_scan"),  # its image blocks attend both ways: token_type_ids
               "concat", published_configs.gemma3, tiny.tiny_gemma3),
        Family("idefics3", "HuggingFaceM4/Idefics3-8B-Llama3", "Idefics3ForConditionalGeneration", "Idefics3Processor",
               ("idefics3",), Rows(**CANVAS), "canvas", published_configs.idefics3, tiny.tiny_idefics3,
               needs="5.23"),  # before: its processor's replace_image_token raises KeyError 'rows'
        Family("smolvlm", "HuggingFaceTB/SmolVLM-256M-Instruct", "SmolVLMForConditionalGeneration", "SmolVLMProcessor",
               ("smolvlm",), Rows(**CANVAS), "canvas", published_configs.smolvlm, tiny.tiny_smolvlm, image_only=True,
               needs="5.23"),
        Family("llava-onevision-1.5", "Deep-VLM/LLaVA-OneVision-1.5-8B-Instruct-hf",
               "LlavaOnevision15ForConditionalGeneration", "Exaone4_5_Processor",  # transformers maps it to Qwen's
               ("llava_onevision1_5",), Rows(**QWEN), "concat",  # Qwen's processor, a Qwen3 text model, 1-D positions
               published_configs.llava_onevision_1_5, tiny.tiny_llava_onevision_1_5, image_only=True, needs="5.25")):
    register(_family)


SIZES = {  # a family's larger published checkpoints by short name: (family, hub id, published config). Their tiny
    #        twin is the family's (tiny-<family>): only the sizes differ, which published_configs.resized states
    "qwen2.5-vl-32b": ("qwen2.5-vl", "Qwen/Qwen2.5-VL-32B-Instruct", published_configs.qwen2_5_vl_32b),
    "qwen2.5-vl-72b": ("qwen2.5-vl", "Qwen/Qwen2.5-VL-72B-Instruct", published_configs.qwen2_5_vl_72b),
    "qwen3-vl-32b": ("qwen3-vl", "Qwen/Qwen3-VL-32B-Instruct", published_configs.qwen3_vl_32b),
    "internvl3-38b": ("internvl3", "OpenGVLab/InternVL3-38B-hf", published_configs.internvl3_38b),
    "internvl3-78b": ("internvl3", "OpenGVLab/InternVL3-78B-hf", published_configs.internvl3_78b)}


def hub_id(name):
    """The hub id a short name loads (a family's or one of its SIZES'); any other name is itself a hub id or path."""
    return FAMILIES[name].hub_id if name in FAMILIES else SIZES[name][1] if name in SIZES else name


def published_of(name, family):
    """What makes the published config of --model `name` of `family` (published_configs): one of SIZES' own, else
    the family's."""
    return SIZES[name][2] if name in SIZES else FAMILIES[family].published


def available():
    """The families this transformers serves (Family.missing), by name, sorted: what the tests loop over."""
    return sorted(name for name, family in FAMILIES.items() if family.missing() is None)


def formatted(processor, family):
    """The processor with its family's Rows as processor.row_format and its image layout as processor.image_layout
    (what data.py builds rows and lays images out by)."""
    record = FAMILIES[family]
    processor.row_format, processor.image_layout = record.rows, image_layouts.LAYOUTS[record.layout]
    return processor


def load_checkpoint(name, device=None, dtype=None, image_splitting="checkpoint", check=None, shards=None):
    """One of the paper's backbones by name: a family's short name (its hub id, FAMILIES), a hub id or a checkpoint
    folder; bf16 on CUDA (the default device when there is one), float32 on CPU, frozen, the weights read straight
    to the device. image_splitting: Idefics2's, as the processor has it ("checkpoint") or "on" / "off"
    (image_setting). check(path): run on the checkpoint's folder or hub id before anything loads
    (lab/models/backbones.py checks its config and eos ids there). shards: under torchrun --shard, the processes the
    weights are sharded over as they load (FSDP2; lab/run/shard.py), each reading only its shard."""
    family = family_of(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    path = hub_id(name)
    if check:
        check(path)
    processor, images = load_processor(path, family, image_splitting)
    split = {"distributed_config": transformers.DistributedConfig(fsdp_size=shards)} if shards and hasattr(
        transformers, "DistributedConfig") else {}  # each process reads its shard (older: whole, then lab/run/shard.py)
    model, info = FAMILIES[family].model_cls().from_pretrained(  # never a model folder's own code
        path, dtype=dtype, attn_implementation="sdpa", device_map={"": placed(device)}, output_loading_info=True,
        trust_remote_code=False, **split)
    if info["missing_keys"]:  # transformers would initialise them at random
        missing, weights = sorted(info["missing_keys"]), glob.glob(os.path.join(glob.escape(path), "*.safetensors"))
        raise ValueError(f"--model: {weights[0] if len(weights) == 1 else path} lacks the tensor {missing[0]}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + "; restore its weights")
    return ready(model, processor, family, name, images)


def record_of(name):
    """The record of a backbone name's family (family_of)."""
    return FAMILIES[family_of(name)]


def family_of(name):
    """The family of a backbone name: a short name, `tiny-<family>`, `toy-idefics2` or a toy backbone's file, or a hub
    id / local path of a family."""
    if name == "toy-idefics2" or is_toy_file(name):
        return "idefics2"
    short = name.removeprefix("tiny-")
    if short in FAMILIES:
        return short
    if name in SIZES:
        return SIZES[name][0]
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
        model_type, types = config.get("model_type"), {t: f.name for f in FAMILIES.values() for t in f.config_types}
        if model_type in types:
            return types[model_type]
        raise ValueError(f"--model: {config_file} has model_type {model_type!r}, none of {sorted(types)}")
    if os.path.isdir(name):
        raise ValueError(f"--model: the folder {name} has no config.json; give a checkpoint folder (config.json, "
                         "weights, tokenizer and processor files)")
    hub = {spec.hub_id: family for family, spec in FAMILIES.items()} | {h: f for f, h, _ in SIZES.values()}
    if name in hub:
        return hub[name]
    if os.sep in name or name.startswith("."):
        raise ValueError(f"--model: there is no folder {name}, and it is none of the hub ids {sorted(hub)}; give a "
                         "checkpoint folder or one of those")
    raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(FAMILIES)}, {sorted(SIZES)}, "
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


def load_processor(path, family, image_splitting="checkpoint"):
    """The processor of the checkpoint at `path` (a hub id or a folder), its images resized by PIL on every machine,
    and the line that says how it encodes images (image_setting): (processor, line). A family with a video processor
    (Family.image_only) gets its processor class built from its tokenizer, image processor and processor_config.json
    (the settings its __init__ takes) without the video processor that AutoProcessor would build, which needs
    torchvision (not a requirement: images never use it; lab/models/image_only.py)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)}); copy the checkpoint's "
                         "tokenizer files into it")
    code, record = {"trust_remote_code": False}, FAMILIES[family]  # never a model folder's own code
    if not record.image_only:
        processor = formatted(AutoProcessor.from_pretrained(path, backend="pil", **code), family)
        return processor, image_setting(processor, family, image_splitting)
    cls, (config_file, settings) = record.processor_cls(), processor_config(path, bool(record.required_settings))
    missing = [k for k in record.required_settings if k not in settings]
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
    record = FAMILIES[family]
    setting = record.rows.splitting
    if setting is None:
        if splitting != "checkpoint":
            raise ValueError(f"--image-splitting {splitting}: only Idefics2 splits images (and Idefics3, SmolVLM, "
                             f"InternVL3 and Gemma 3 tile them), not {family}; drop the flag")
        return image_layouts.LAYOUTS[record.layout].describe(processor)
    images = processor.image_processor
    if splitting != "checkpoint":  # on the image processor (its settings) and in the processor's call
        source = f"--image-splitting {splitting}"
        setattr(images, setting, splitting == "on")
        processor.images_kwargs = {**getattr(processor, "images_kwargs", {}), setting: splitting == "on"}
    on = splitting_on(processor)
    if record.crops:
        return (f"image splitting: {'on' if on else 'off'} ({source}): {record.crops if on else 1} crop(s) x "
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
