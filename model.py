"""The plug: an adapter inside a frozen backbone's attention, h^(l) of each decoder layer, and loading a backbone.

A backbone is a frozen Hugging Face vision-language model. The adapters of `adapters.py` act inside the
*text decoder's self-attention* only (not the vision tower, the perceiver, or Idefics' gated cross-attention).
They reach it through transformers' attention-function registry: we register one attention function,
`calibrated_attention`, under the name "icl" (with the stock SDPA mask builder, without which transformers would
silently pass no padding mask), switch the decoder's config to it, and hang one adapter on each self-attention
module. The function hands the module's (rotary-embedded) queries, keys and values to the module's adapter; every
other module falls through to the stock SDPA forward. No transformers forward is copied.

load_checkpoint loads the paper's checkpoints by name (a family, a hub id or a checkpoint folder); every name,
the offline tiny twins and toy backbones included, loads through lab/models/backbones.py:load_backbone.
"""
import contextlib
import glob
import json
import os
from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import (AttentionInterface, Idefics2ForConditionalGeneration, IdeficsForVisionText2Text,
                          LlavaForConditionalGeneration, LlavaOnevisionForConditionalGeneration,
                          LlavaOnevisionProcessor)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import data
from adapters import LIVE, METHODS, lora_config

ATTN_NAME = "icl"  # the attention implementation name our adapters run under


@dataclass
class Backbone:
    """A loaded backbone: the model (frozen, eval mode), its processor, its family and the name it was loaded by."""
    model: torch.nn.Module
    processor: object
    family: str
    name: str
    images: str = ""  # how its processor encodes images, and where that setting comes from (image_setting)


# ---------------------------------------------------------- the plug: an adapter inside each decoder self-attention

def calibrated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for one layer (Eq 3-8): the module's adapter if it has one, else transformers' SDPA forward.

    query: [B, H, T, d_h]; key, value: [B, H_kv, S, d_h] (after rotary embedding and the KV cache);
    attention_mask: bool [B, 1, T, S] (True = attend) or None for plain causal. Returns ([B, T, H, d_h], None).
    Transformers calls it from each decoder self-attention's forward: ALL_ATTENTION_FUNCTIONS[_attn_implementation].
    """
    adapter = getattr(module, "icl_adapter", None)
    if adapter is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = adapter(query, key, value, attention_mask, scaling)  # grouped key/value heads stay grouped
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, calibrated_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def decoder_self_attentions(model):
    """The text decoder's self-attention modules, in layer order (the only places adapters go)."""
    return [layer.self_attn for layer in model.get_decoder().layers]


def attention_shape(model):
    """(layers, query heads, head size) of the text decoder's self-attention."""
    attns = decoder_self_attentions(model)
    cfg = attns[0].config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return len(attns), cfg.num_attention_heads, head_dim


def attach(model, method="hyper-icl", **sizes):
    """Attach a fresh `method` adapter (replacing any attached one) and route the backbone through it.

    sizes: the method's sizes (rank=..., and n=... for HiFICL; none for MimIC and LIVE). Returns adapter_modules(model).
    Attention-level methods: one adapter per decoder self-attention, reached through calibrated_attention. LIVE: one
    per decoder layer, a forward hook on its MLP. LoRA: peft's layers injected in place of adapters.LORA_TARGETS.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    if hasattr(model, "icl_settings"):
        detach(model)
    device = next(model.parameters()).device
    if method == "lora":
        from peft import inject_adapter_in_model
        inject_adapter_in_model(lora_config(**sizes), model)
        model.requires_grad_(False)
    elif method == "live":
        for layer in model.get_decoder().layers:
            layer.mlp.icl_adapter = LIVE(model.config.get_text_config().hidden_size, **sizes).to(device)
        hook_live(model)
    else:
        _, heads, head_dim = attention_shape(model)
        for attn in decoder_self_attentions(model):
            attn.icl_adapter = METHODS[method](heads, head_dim, **sizes).to(device)
        # transformers now calls calibrated_attention from each decoder self-attention (the registry's ATTN_NAME)
        decoder_self_attentions(model)[0].config._attn_implementation = ATTN_NAME
    model.icl_settings = {"method": method, **sizes}
    return adapter_modules(model).requires_grad_(True)


def detach(model):
    """Remove the adapter and restore the backbone exactly as it was (stock SDPA attention, original modules)."""
    method = model.icl_settings["method"]
    if method == "lora":
        for name, layer in lora_layers(model):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer.get_base_layer())
        if hasattr(model, "peft_config"):
            del model.peft_config
    elif method == "live":
        unhook_live(model)
        for layer in model.get_decoder().layers:
            del layer.mlp.icl_adapter
    else:
        attns = decoder_self_attentions(model)
        for attn in attns:
            del attn.icl_adapter
        attns[0].config._attn_implementation = "sdpa"
    del model.icl_settings


def adapter_modules(model):
    """The attached adapter: a Module holding exactly its trainable parameters (one entry per adapted module)."""
    method = model.icl_settings["method"]
    if method == "lora":
        return torch.nn.ModuleList(torch.nn.ModuleList([m.lora_A, m.lora_B]) for _, m in lora_layers(model))
    if method == "live":
        return torch.nn.ModuleList(layer.mlp.icl_adapter for layer in model.get_decoder().layers)
    return torch.nn.ModuleList(attn.icl_adapter for attn in decoder_self_attentions(model))


def hook_live(model):
    """Run each decoder MLP's output through its LIVE adapter (a forward hook, its handle kept on the MLP)."""
    for layer in model.get_decoder().layers:
        layer.mlp.icl_hook = layer.mlp.register_forward_hook(lambda mlp, args, out: mlp.icl_adapter(out))


def unhook_live(model):
    """Remove the LIVE hooks (the adapters stay attached)."""
    for layer in model.get_decoder().layers:
        layer.mlp.icl_hook.remove()
        del layer.mlp.icl_hook


def lora_layers(model):
    """The (name, module) pairs of peft's LoRA layers in the model, in module order."""
    from peft.tuners.lora import LoraLayer
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def attention_as(model, implementation):
    """Run the text decoder's attention through another registered implementation for a while: "sdpa", the backbone
    as it was, adapters bypassed; "eager", which also returns attention probabilities."""
    cfg = decoder_self_attentions(model)[0].config
    before, cfg._attn_implementation = cfg._attn_implementation, implementation
    try:
        yield model
    finally:
        cfg._attn_implementation = before


@contextlib.contextmanager
def without_adapter(model):
    """The backbone as it was, the adapter of any method bypassed (the teacher's forward): a context manager."""
    method = getattr(model, "icl_settings", {}).get("method")
    with contextlib.ExitStack() as undo:
        if method == "lora":
            for _, m in lora_layers(model):
                m.enable_adapters(False)
                undo.callback(m.enable_adapters, True)
        elif method == "live":
            unhook_live(model)
            undo.callback(hook_live, model)
        else:
            undo.enter_context(attention_as(model, "sdpa"))
        yield model


# ------------------------------------------------------------------ h^(l) of Eq 12-16: each decoder layer's own output

LAYER_OUTPUTS_VERSION = 2  # what layer_outputs returns; 1 was hidden_states[1:], the last entry after the final norm


def layer_outputs(model, forward=None, keep=None, **inputs):
    """model(**inputs) and h^(1), ..., h^(L), the output of each decoder layer (Eq 16 aligns these), read by forward
    hooks on the decoder layers: (output, L x [B, T, d]). Unlike `output_hidden_states`, whose last entry is the L-th
    output after the model's final norm, every h^(l) here is the layer's own output. forward: what runs the model
    (a wrapper of it, such as DistributedDataParallel; default the model itself). keep: a bool mask [B, T]; then each
    hook keeps only those positions as its layer produces them, L x [kept positions, d] in row order (h[keep]), and
    no layer's whole output outlives the next layer."""
    layers = model.get_decoder().layers
    keep = None if keep is None else keep.to(next(layers[0].parameters()).device)  # once, where the layers run
    states = []

    def record(layer, args, out):
        h = out[0] if isinstance(out, tuple) else out  # [B, T, d]
        states.append(h if keep is None else h[keep])
    with hooked(*(layer.register_forward_hook(record) for layer in layers)):
        return (forward or model)(**inputs), states


@contextlib.contextmanager
def hooked(*handles):
    """Keep the given forward (pre-)hooks registered for a while: each handle is removed on exit."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ------------------------------------------------------------------------------------------------ loading backbones

Family = namedtuple("Family", ["hub_id", "model_cls"])  # the checkpoint the paper uses, the class that loads it
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
    context_limit(processor, model.config)  # the tokenizer knows the text model's context, which data.collate checks
    return Backbone(freeze(model), processor, family, name, images)


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
    model.requires_grad_(False)
    return model.eval()


def placed(device):
    """torch.device of `device`, "cuda" being this process's GPU (torchrun: its LOCAL_RANK's): where the weights are
    read to, straight from the checkpoint's files."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


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
        processor = AutoProcessor.from_pretrained(path, backend="pil", trust_remote_code=False)
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
    return processor, image_setting(processor, family, image_splitting)


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


# ------------------------------------------------------- L_sup: the student's logits at its target tokens

def target_logits(model, batch, **kwargs):
    """model's logits [B, K, V] at `batch`'s data.answer_window and the labels [B, K] they line up with."""
    keep = batch.get("window") or data.answer_window(batch["labels"])  # "window": counted on the host (finished)
    return model(**data.model_inputs(batch), logits_to_keep=keep, use_cache=False, **kwargs).logits, \
        batch["labels"][:, -keep:]


def supervised_loss(logits, labels):
    """L_sup: next-token cross-entropy on the target tokens (labels -100 elsewhere)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def answer_positions(labels):
    """Bool [B, W]: the positions whose logits predict an answer token (labels -100 elsewhere; next-token shift)."""
    return F.pad(labels[:, 1:] != -100, (0, 1))
