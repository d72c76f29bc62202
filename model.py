"""Backbones: the real checkpoints, their tiny offline twins, and the plug that puts an adapter into attention.

A backbone is a frozen Hugging Face vision-language model. The adapters of `adapters.py` act inside the
*text decoder's self-attention* only (not the vision tower, the perceiver, or Idefics' gated cross-attention).
They reach it through transformers' attention-function registry: we register one attention function,
`calibrated_attention`, under the name "icl" (with the stock SDPA mask builder, without which transformers would
silently pass no padding mask), switch the decoder's config to it, and hang one adapter on each self-attention
module. The function hands the module's (rotary-embedded) queries, keys and values to the module's adapter; every
other module falls through to the stock SDPA forward. No transformers forward is copied.

Tiny twins (`tiny-idefics2`, ...) are the real model and processor classes built from small configs with seeded
random weights and a byte-level BPE tokenizer trained locally, so every code path of the real model runs offline.
"""
import contextlib
import hashlib
import json
import os
from collections import namedtuple
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from transformers import (AttentionInterface, AutoConfig, Idefics2Config, Idefics2ForConditionalGeneration,
                          Idefics2Processor, Idefics2ImageProcessorPil, IdeficsConfig, IdeficsForVisionText2Text,
                          IdeficsImageProcessorPil, IdeficsProcessor, LlavaConfig, LlavaForConditionalGeneration,
                          LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil,
                          LlavaOnevisionProcessor, LlavaProcessor, PreTrainedTokenizerFast, SiglipImageProcessorPil)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import data
from data import atomic_write, weights_digest
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
    states = []
    own = lambda out: out[0] if isinstance(out, tuple) else out
    record = lambda layer, args, out: states.append(own(out) if keep is None else own(out)[keep.to(own(out).device)])
    with hooked(*(layer.register_forward_hook(record) for layer in model.get_decoder().layers)):
        return (forward or model)(**inputs), states


@contextlib.contextmanager
def hooked(*handles):
    """Keep the given forward (pre-)hooks registered for a while: each handle is removed on exit."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------- images in chunks: the same numbers, a bounded working set
#
# The vision tower and Idefics2's connector (modality projection, an MLP 1152 -> 14336 -> 4096, then the perceiver)
# encode each image on its own, but transformers runs them over every image of a batch at once, padding included:
# nine 640 x 640 images through the projection are three [9, 2025, 14336] tensors (1 GB each in float32). Run in
# chunks of images whose working set (image_work) fits --image-memory, they give the same numbers and hold a chunk's.

IMAGE_MEMORY = 1e9  # bytes, --image-memory's default: two 640 x 640 Idefics2 images a call in float32, four in bf16


def image_work(config, patches, itemsize):
    """Bytes one image of `patches` patches holds while it is encoded, the larger of its two stages: a vision layer
    (q, k, v, output and residual of width d_v, the MLP's two i_v-wide tensors) and, for Idefics2, the connector
    (three [patches, i] tensors of the projection's gated MLP, its input and output, the perceiver's context)."""
    vision, text = config.vision_config, config.get_text_config()
    d_v, i_v = getattr(vision, "hidden_size", None) or vision.embed_dim, vision.intermediate_size
    layer = patches * (6 * d_v + 2 * i_v)
    connector = patches * (3 * text.intermediate_size + d_v + 3 * text.hidden_size)
    return max(layer, connector if config.model_type == "idefics2" else 0) * itemsize


def image_modules(model):
    """The modules that encode a batch's images one image at a time, each over all of them in one call: the vision
    tower, and Idefics2's connector (LLaVA's projector works on one patch at a time and holds little)."""
    inner = model.model
    return [m for m in (getattr(inner, name, None) for name in ("vision_model", "vision_tower", "connector"))
            if m is not None]


def chunk_images(model, budget=IMAGE_MEMORY):
    """Make the image modules (image_modules) run over as many images a call as image_work says fit `budget` bytes
    (at least one), concatenating the results: the numbers of one call, since each image is encoded on its own."""
    for module in image_modules(model):
        module.icl_chunking = {"budget": budget, "config": model.config}
        if "forward" not in vars(module):  # once: the class's forward, called chunk by chunk
            module.forward = lambda *args, module=module, **kwargs: chunked(module, *args, **kwargs)
    return model


def chunked(module, *args, **kwargs):
    """module's own forward over its images (the first tensor argument's leading dimension) in chunks: every tensor
    argument of that leading size is sliced alike, and the outputs are concatenated (joined)."""
    forward, config = type(module).forward, module.icl_chunking["config"]
    first = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
    n, patch = first.shape[0], config.vision_config.patch_size
    patches = first.shape[1] if first.dim() == 3 else first.shape[-2] * first.shape[-1] // patch ** 2
    step = max(1, int(module.icl_chunking["budget"] // image_work(config, patches, first.element_size())))
    if n <= step:
        return forward(module, *args, **kwargs)
    part = lambda v, s: v[s:s + step] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
    return joined([forward(module, *(part(a, s) for a in args), **{k: part(v, s) for k, v in kwargs.items()})
                   for s in range(0, n, step)])


def joined(outs):
    """Chunks' outputs as one: tensors concatenated along the first dimension, field by field for a ModelOutput (its
    tuples element by element); None stays None."""
    first = outs[0]
    if first is None or torch.is_tensor(first):
        return first if first is None else cat_alike(outs)
    if isinstance(first, tuple) and not hasattr(first, "keys"):
        return tuple(joined([o[k] for o in outs]) for k in range(len(first)))
    return type(first)(**{k: joined([o[k] for o in outs]) for k in first.keys()})


def cat_alike(parts):
    """torch.cat along the first dimension, in the parts' own memory layout: a transposed layout (SigLIP's patch
    embedding leaves one) stays transposed, since the kernels of the layers after it, and so their rounding, follow
    the layout."""
    order = sorted(range(parts[0].dim()), key=lambda d: -parts[0].stride(d))
    if not order or order[0] != 0:
        return torch.cat(parts)
    return torch.cat([p.permute(order) for p in parts]).permute([order.index(d) for d in range(len(order))])


# -------------------------------------------------------------------------------------- saving and loading adapters

def fingerprint(backbone):
    """A short hash of the backbone's identity: its family and some of its weights (the first four parameters, the first
    and last decoder self-attention's: the layers the adapters act in) rounded to bf16, so the same checkpoint loaded in
    float32 or bf16, by name or by path, gives the same fingerprint, and tiny twins of different seeds differ."""
    own = lambda module: [p for n, p in module.named_parameters() if "icl_adapter" not in n and "lora_" not in n]
    attns = decoder_self_attentions(backbone.model)
    params = own(backbone.model)[:4] + own(attns[0]) + own(attns[-1])  # any attached adapter left out, LoRA's too
    h = hashlib.sha256(backbone.family.encode())
    for p in params:
        h.update(str(tuple(p.shape)).encode())
        h.update(p.detach().flatten()[:4096].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def adapter_shape(backbone):
    """The attention shape an adapter checkpoint records, which load_adapter requires to match."""
    return dict(zip(("layers", "heads", "head_dim"), attention_shape(backbone.model)))


def backbone_identity(backbone):
    """What ties an adapter checkpoint to its backbone, which load_adapter requires to match unless --force."""
    return {"family": backbone.family, "fingerprint": fingerprint(backbone)}


def save_adapter(path, backbone):
    """Save the adapter's parameters alone, with its settings (method, sizes, backbone, shape, family, fingerprint)."""
    settings = {**backbone.model.icl_settings, "backbone": backbone.name, **adapter_shape(backbone),
                **backbone_identity(backbone)}
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_modules(backbone.model).state_dict().items()}
    atomic_write(path, lambda f: f.write(save(tensors, metadata={"settings": json.dumps(settings)})))


ADAPTER_FIELDS = ("method", "backbone", "layers", "heads", "head_dim")  # what every adapter's settings hold


def read_settings(path):
    """An adapter checkpoint's settings; anything else (a folder, a truncated file, train.py's last.pt): ValueError."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; pass the adapter file in it (train.py writes <out>/adapter.safetensors)")
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable adapter checkpoint (a truncated or other kind of file: {e})") from e
    if "settings" not in metadata:
        raise ValueError(f"{path} is not an adapter checkpoint of this project (no settings in its metadata)")
    try:
        settings = json.loads(metadata["settings"])
    except ValueError as e:
        raise ValueError(f"{path}: its settings (metadata) are not JSON ({e}); the file is damaged or not this "
                         "project's") from e
    missing = [k for k in ADAPTER_FIELDS if not isinstance(settings, dict) or k not in settings]
    if missing:
        raise ValueError(f"{path}: its settings lack {', '.join(missing)}; the file is damaged or not this project's")
    return settings


def load_adapter(path, backbone, method=None, force=False):
    """Attach the adapter saved at `path` to `backbone`. A checkpoint of another method (than `method`, when given) or
    attention shape fails; one of another family or weights fails unless force=True (then with a warning)."""
    saved = read_settings(path)
    if method is not None and saved["method"] != method:
        raise ValueError(f"{path} holds a {saved['method']!r} adapter, not a {method!r} one")
    shape = adapter_shape(backbone)
    differ = [f"{k} (saved {saved[k]}, here {v})" for k, v in shape.items() if saved[k] != v]
    if differ:
        raise ValueError(f"adapter {path} was trained on {saved['backbone']!r}, which differs from "
                         f"{backbone.name!r} in " + ", ".join(differ))
    here = backbone_identity(backbone)
    differ = [f"{k} (saved {saved.get(k)}, here {v})" for k, v in here.items() if saved.get(k) != v]
    if differ and not force:
        raise ValueError(f"adapter {path} was trained on another backbone than {backbone.name!r}: "
                         + ", ".join(differ) + "; pass --force to load it anyway")
    if differ:
        print(f"warning: --force: loading adapter {path} onto {backbone.name!r} although its " + ", ".join(differ))
    sizes = {k: v for k, v in saved.items() if k not in (*shape, *here, "method", "backbone")}
    try:
        attach(backbone.model, saved["method"], **sizes)
    except (ValueError, TypeError, RuntimeError) as e:  # an unknown method, sizes it does not take or cannot make
        raise ValueError(f"{path}: its settings (method {saved['method']!r}, sizes {sizes}) do not make an adapter "
                         f"({e})") from e
    load_tensors(path, backbone.model)
    return saved


def load_tensors(path, model):
    """Load an adapter file's tensors into the attached adapter; a missing, extra (renamed) or wrongly shaped tensor
    is a ValueError naming the file and the tensor (the adapter is detached again)."""
    tensors, expected = load_file(path), adapter_modules(model).state_dict()
    wrong = [f"{name} is missing" for name in sorted(expected.keys() - tensors.keys())] + \
        [f"{name} is not one of the adapter's" for name in sorted(tensors.keys() - expected.keys())] + \
        [f"{name} is {tuple(tensors[name].shape)}, not {tuple(t.shape)}" for name, t in sorted(expected.items())
         if name in tensors and tensors[name].shape != t.shape]
    if wrong:
        detach(model)
        raise ValueError(f"{path} does not hold the adapter its settings describe: " + "; ".join(wrong[:3]) +
                         (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    adapter_modules(model).load_state_dict(tensors)


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
        except ValueError as e:  # UnicodeDecodeError too
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


def freeze(model):
    """No backbone parameter trains; eval mode (no dropout)."""
    model.requires_grad_(False)
    return model.eval()


def load_backbone(name, device=None, dtype=None, seed=0, image_splitting="checkpoint", image_memory=IMAGE_MEMORY):
    """Load a backbone by name: real checkpoints in bf16 on CUDA (float32 on CPU), a tiny offline twin (random
    weights), `toy-idefics2` (the shipped reference, meta-trained to learn in context) or a toy backbone's file
    (train.py --build-toy). image_splitting: Idefics2's, as the processor has it ("checkpoint") or "on" / "off".
    image_memory: the bytes a call of the vision tower or connector may hold (chunk_images)."""
    family = family_of(name)
    if is_built(name):
        model, processor = TINY_BUILDERS[family](seed) if name.startswith("tiny-") else \
            toy_idefics2(name if is_toy_file(name) else None)
        images = image_setting(processor, family, image_splitting, "built-in processor")
        model = model.to(device or "cpu", dtype or torch.float32)
    else:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        path = FAMILIES[family].hub_id if name == family else name
        check_config(read_config(path), path)  # the config, eos ids and processor before the weights: it fails faster
        check_eos(path)
        processor, images = load_processor(path, family, image_splitting)
        model = FAMILIES[family].model_cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                           device_map={"": placed(device)})  # no copy in host memory
    chunk_images(model, image_memory)
    context_limit(processor, model.config)  # the tokenizer knows the text model's context, which data.collate checks
    return Backbone(freeze(model), processor, family, name, images)


def placed(device):
    """torch.device of `device`, "cuda" being this process's GPU (torchrun: its LOCAL_RANK's): where the weights are
    read to, straight from the checkpoint's files."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def read_config(path):
    """The transformers config of a checkpoint (a folder or hub id); one transformers refuses (a field of the wrong
    type, say) is a ValueError naming <path>/config.json."""
    try:
        return AutoConfig.from_pretrained(path)
    except OSError:  # no such checkpoint: transformers' message names it
        raise
    except Exception as e:  # TypeError, ValueError, huggingface_hub's StrictDataclassError
        why = " ".join(str(e).split())[:200]  # one line: transformers' message may hold several
        raise ValueError(f"{os.path.join(path, 'config.json')} is not a valid config ({why}); restore the checkpoint's "
                         "config.json") from e


def check_config(config, path):
    """Refuse a config whose text decoder cannot hold an adapter (fewer than one layer, head or dimension): a
    ValueError naming <path>/config.json and the field."""
    text = config.get_text_config()
    prefix = "" if text is config else "text_config."
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        value = getattr(text, field, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{os.path.join(path, 'config.json')}: {prefix}{field} is {value!r}; it must be an "
                             "integer of at least 1 (restore the checkpoint's config.json)")


def check_eos(path):
    """Refuse eos ids in the checkpoint's generation_config.json that are not token ids (an integer or a list of
    them, at least 0): generation would stop at none. A ValueError naming the file; no such file: nothing to check."""
    from transformers import GenerationConfig
    file = os.path.join(path, "generation_config.json")
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError) as e:  # none: the model config's eos, the tokenizer's and the family's end token
        if os.path.isfile(file):  # there but unreadable: it would be ignored silently
            raise ValueError(f"{file} cannot be read ({' '.join(str(e).split())[:200]}); restore the checkpoint's "
                             "file") from e
        return
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id is {eos!r}; it must be a token id (an integer) or a list of them")


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
        processor = AutoProcessor.from_pretrained(path, backend="pil")
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
    processor = ImageOnlyOnevisionProcessor(AutoImageProcessor.from_pretrained(path, backend="pil"),
                                            AutoTokenizer.from_pretrained(path), None,
                                            **{k: settings[k] for k in keys if k in settings})
    return processor, image_setting(processor, family, image_splitting)


IMAGE_SPLITTING = ("checkpoint", "on", "off")  # --image-splitting
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")  # a folder has one at least


def image_setting(processor, family, splitting="checkpoint", source="the checkpoint's processor config"):
    """Apply --image-splitting to Idefics2's processor (4 crops + the whole image, 5 x 64 tokens an image, instead of
    the whole image's 64) and return the line that says how images are encoded and where that comes from.
    Another family's processor does not split: any setting but "checkpoint" is then a ValueError."""
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


def context_limit(processor, config):
    """Cap the processor's tokenizer's model_max_length at the text model's positions (config's)."""
    positions = config.get_text_config().max_position_embeddings
    processor.tokenizer.model_max_length = min(processor.tokenizer.model_max_length, positions)


# ------------------------------------------------------------------------------------------------------- tiny twins

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


class ImageOnlyOnevisionProcessor(LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor without its video processor (which needs torchvision; images never use it)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor" or argument is not None:
            super().check_argument_for_proper_class(argument_name, argument)


def tiny_llava_onevision(seed=0):
    """LLaVA-OneVision (Qwen2 text model, SigLIP vision tower, any-resolution tiling) at toy size."""
    tok = _qwen_tokenizer()
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    processor = ImageOnlyOnevisionProcessor(
        LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints), tok, None,
        num_image_tokens=4, vision_feature_select_strategy="full")
    config = LlavaOnevisionConfig(**_qwen_config(tok), image_grid_pinpoints=pinpoints)
    return _seeded(LlavaOnevisionForConditionalGeneration, config, seed), processor


TINY_BUILDERS = {"idefics2": tiny_idefics2, "idefics": tiny_idefics, "llava-interleave": tiny_llava_interleave,
                 "llava-onevision": tiny_llava_onevision}


# ------------------------------------------------------------ toy-idefics2: a small backbone that learns in context
#
# The real Idefics2 class and processor at a size a CPU meta-trains in minutes (about 1 M parameters): images of
# 42 x 42 (one 14-px vision patch per grid cell), 9 perceiver latents per image, a tokenizer in which every answer is
# one token. train.py meta-trains it on episodes of the toy-icl world (train.build_toy). Every result of the project
# that needs it uses one reference copy, the same bytes everywhere: TOY_REFERENCE, checked against TOY_SHA256 on every
# load. A copy built on another machine differs in its last bits (another CPU sums in another order) and, since the
# in-context phase transition depends on them, possibly in whether it learns in context at all; so a build is only
# ever used when named (--model <its file>), never in place of the reference.

TOY_CORPUS = " ".join([data.PROMPTS["vqa"]["instruction"], data.ICL_QUESTION, *data.ICL_NAMED.values(),
                       "Question: Short answer:", *(a for v in data.ICL_ATTRIBUTES.values() for a in v)] * 8)
TOY_REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "data", "toy-idefics2.safetensors")
TOY_SHA256 = "94ddc506fac0b506d2c297e7d0e7c75396da7e2c8673c89586a28a74070d0463"  # weights_digest of TOY_REFERENCE


def toy_processor():
    """Idefics2's processor for 42 x 42 images and 9 latents, with a tokenizer that spells every answer as one token."""
    tok = _idefics_tokenizer(vocab_size=400, corpus=TOY_CORPUS)
    side = data.ICL_SIDE
    return Idefics2Processor(Idefics2ImageProcessorPil(do_image_splitting=False, size={"longest_edge": side,
                             "shortest_edge": side}), tok, image_seq_len=9)


def toy_model(processor, seed=0):
    """The untrained toy Idefics2: text 128 wide x 4 layers, vision 64 x 2, perceiver latents drawn N(0, 0.02), not
    Idefics2's ones, from which images differ by a fraction of a percent of an image token's size and training
    stalls at "knows the task, ignores the image"."""
    tok = processor.tokenizer
    config = Idefics2Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=data.ICL_SIDE, patch_size=data.ICL_CELL),
        perceiver_config=dict(hidden_size=128, resampler_n_latents=9, resampler_depth=1, resampler_n_heads=4,
                              resampler_head_dim=32, num_key_value_heads=2),
        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    model = _seeded(Idefics2ForConditionalGeneration, config, seed)
    with torch.no_grad():
        model.model.connector.perceiver_resampler.latents.normal_(0, 0.02)
    return model


def read_toy(path, sha256=None, shapes=None):
    """The weights of the toy backbone file at `path`, checked against the checksum in its metadata, `sha256` and the
    toy model's {name: shape} (when given); a ValueError naming the file if they differ or it cannot be read."""
    try:
        with safe_open(path, "pt") as f:
            expected = (f.metadata() or {}).get("sha256")
        tensors = load_file(path)
    except Exception as e:  # a missing, truncated or foreign file: safetensors raises its own error types
        raise ValueError(f"toy backbone {path} cannot be read ({e})") from e
    if expected is None:
        raise ValueError(f"{path} is not a toy backbone (no checksum in its metadata; an adapter is loaded with "
                         "evaluate.py --checkpoint, a toy backbone is written by `python train.py --build-toy`)")
    digest = weights_digest(tensors)
    if digest != expected or sha256 not in (None, digest):
        raise ValueError(f"toy backbone {path}: its weights do not match their checksum; restore the reference with "
                         "`git checkout tests/data` or build another with `python train.py --build-toy`")
    if shapes is None:
        return tensors
    if set(tensors) != set(shapes):  # a cache file (RICES features, teacher states, a task vector) has a checksum too
        missing = sorted(set(shapes) - set(tensors))
        names = ", ".join(sorted(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
        raise ValueError(f"{path} is not a toy backbone: it holds {len(tensors)} tensors ({names}), not the toy "
                         f"Idefics2's {len(shapes)}" + (f" ({missing[0]} is missing)" if missing else "") +
                         "; pass a file written by `python train.py --build-toy`")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{path} is not a toy backbone: {name} is {tuple(tensors[name].shape)}, the toy "
                             f"Idefics2's is {tuple(shape)}; pass a file written by `python train.py --build-toy`")
    return tensors


def toy_metadata(path):
    """What a toy backbone file records of its build: recipe (with the accepted seed), probe, learning curve."""
    with safe_open(path, "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items() if k != "sha256"}


def toy_idefics2(path=None):
    """The meta-trained toy Idefics2 and its processor: the reference (checked by TOY_SHA256) or the build at `path`."""
    processor = toy_processor()
    model = toy_model(processor)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model.load_state_dict(read_toy(path or TOY_REFERENCE, None if path else TOY_SHA256, shapes))
    return model.eval(), processor


def choose_threads(name, threads=None):
    """Set torch's CPU threads: `threads` (--threads) if given, else one for a tiny or toy backbone (a few million
    parameters or fewer) on CPU, where a second thread only adds synchronisation (10x slower on a busy 2-core machine,
    README), else torch's default. Returns the count in force."""
    if threads or (is_built(name) and not torch.cuda.is_available()):
        torch.set_num_threads(threads or 1)
    return torch.get_num_threads()


def is_built(name):
    """Whether a backbone is built here rather than loaded: a tiny twin, toy-idefics2 or a toy backbone's file."""
    return name.startswith("tiny-") or name == "toy-idefics2" or is_toy_file(name)


def is_toy_file(name):
    """Whether a backbone name is a toy backbone's file (a build of train.py --build-toy)."""
    return name.endswith(".safetensors")


# ------------------------------------------------------------------------------------ published sizes (no download)

LLAVA_384 = dict(  # both LLaVA models: the SigLIP-384 tower, its full features, the image token
    vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                       num_attention_heads=16, image_size=384, patch_size=14, vision_use_head=False),
    vision_feature_select_strategy="full", vision_feature_layer=-1, image_token_index=151646)
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
}


def published_model(family, device="meta", dtype=torch.bfloat16, config=None):
    """A real-size backbone of `family` built from its published config (or `config`) with random weights (no
    download). On the meta device it holds no memory (parameter counts); on a GPU it runs at the real model's speed."""
    with torch.device(device):  # built in `dtype` directly: no float32 copy of 8B parameters on the way
        model = FAMILIES[family].model_cls._from_config(config or PUBLISHED[family](), dtype=dtype)
    return freeze(model)


def grown_twin(family, seed=0, **text):
    """The tiny twin of `family` with its text decoder's config changed by `text` (hidden_size=..., ...), seeded random
    weights, float32; keys the family's text model lacks (num_key_value_heads for Idefics, head_dim where it is
    derived) are left out. The vision side stays toy-sized. Returns (model, processor)."""
    twin, processor = TINY_BUILDERS[family](seed)
    config = twin.config  # the twin itself is not kept
    decoder = config.get_text_config()
    decoder.update({k: v for k, v in text.items() if hasattr(decoder, k)})
    if getattr(decoder, "layer_types", None):
        decoder.layer_types = decoder.layer_types[:1] * decoder.num_hidden_layers
    if hasattr(getattr(config, "perceiver_config", None), "hidden_size"):  # Idefics2's perceiver feeds the decoder
        config.perceiver_config.hidden_size = decoder.hidden_size
    return freeze(_seeded(type(twin), config, seed)), processor


def mid_model(family, seed=0):
    """A mid-size backbone of `family` for CPU benchmarks, so latency is the decoder's: the twin grown to 8 layers x
    1024, 16 heads of 64, 4 key/value heads where the family groups them. Returns (model, processor)."""
    return grown_twin(family, seed, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64)
