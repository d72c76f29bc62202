"""Backbones by name: the tiny twins and toy backbones built here, the paper's checkpoints through
families.load_checkpoint after checking their files; CPU threads, the device a batch goes to and the autocast the
backbone computes in."""
import os

from safetensors import SafetensorError, safe_open
import torch
from transformers import AutoConfig, GenerationConfig

import data
from lab.models import chunks, families, toy_backbone


def stop_ids(backbone):
    """The ids that end an answer: the checkpoint's generation_config eos ids (one or a list), the tokenizer's eos
    and the family's end token (data.end_token), sorted."""
    tok, listed = backbone.processor.tokenizer, backbone.model.generation_config.eos_token_id
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    end = tok.convert_tokens_to_ids(data.end_token(backbone.processor, backbone.family))
    return sorted({*listed, tok.eos_token_id, end} - {None})


def load_backbone(name, device=None, dtype=None, seed=0, image_splitting="checkpoint",
                  image_memory=chunks.IMAGE_MEMORY, shards=None):
    """Load a backbone by name: a tiny offline twin (random weights), `toy-idefics2` (the shipped reference,
    meta-trained to learn in context), a toy backbone's file (train.py --build-toy), or one of the paper's checkpoints
    (families.load_checkpoint: bf16 on CUDA, float32 on CPU), whose config and eos ids are checked first (it fails
    faster than the weights load). image_splitting: Idefics2's, as the processor has it ("checkpoint") or "on" / "off".
    image_memory: the bytes a call of the vision tower or connector may hold (chunk_images). shards: --shard's
    processes, over which a checkpoint is sharded as it loads (families.load_checkpoint; a built one: ignored)."""
    family = families.family_of(name)  # an unknown name is refused before anything loads
    if is_built(name):
        model, processor = families.FAMILIES[family].built_twin(seed) if name.startswith("tiny-") else \
            toy_backbone.toy_idefics2(name if families.is_toy_file(name) else None)
        images = families.image_setting(families.formatted(processor, family), family, image_splitting,
                                        "built-in processor")
        backbone = families.ready(model.to(device or "cpu", dtype or torch.float32), processor, family, name, images)
    else:
        try:
            backbone = families.load_checkpoint(name, device, dtype, image_splitting, check=check_files, shards=shards)
        except SafetensorError as e:  # a hub cache's damaged file (a folder's is named by check_weights first)
            raise ValueError(f"--model {name}: a weights file is truncated or damaged ({str(e)[:120]})") from None
    chunks.chunk_images(backbone.model, image_memory)
    return backbone


def check_files(path):
    """The checkpoint's config, eos ids and weight files, checked before its processor and weights load (check_config,
    check_eos, check_weights)."""
    check_config(read_config(path), path)
    check_eos(path)
    check_weights(path)


def check_weights(path):
    """Refuse a folder's safetensors weight file that is truncated or damaged (its header does not cover the file):
    a ValueError naming the file, before transformers fails on it naming none. A hub id: nothing to check here."""
    if not os.path.isdir(path):
        return
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        try:
            with safe_open(os.path.join(path, name), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"--model: {os.path.join(path, name)} is truncated or damaged ({str(e)[:120]}); restore "
                             "the checkpoint's weights") from None


def read_config(path):
    """The transformers config of a checkpoint (a folder or hub id); one transformers refuses (a field of the wrong
    type, say) is a ValueError naming <path>/config.json."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)  # never run a folder's code
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


def choose_threads(name, threads=None):
    """Set torch's CPU threads: `threads` (--threads) if given, else one for a tiny or toy backbone (a few million
    parameters or fewer) on CPU, where a second thread only adds synchronisation (docs/efficiency.md, "Threads on a
    CPU"), else torch's default. Returns the count in force."""
    if threads or (is_built(name) and not torch.cuda.is_available()):
        torch.set_num_threads(threads or 1)
    return torch.get_num_threads()


def is_built(name):
    """Whether a backbone is built here rather than loaded: a tiny twin, toy-idefics2 or a toy backbone's file."""
    return name.startswith("tiny-") or name == "toy-idefics2" or families.is_toy_file(name)


def to_device(batch, device):
    """A batch (labels and alignment mask included) on `device`."""
    return {k: v.to(device) for k, v in batch.items()}


def autocast_dtype(device):
    """The dtype the backbone computes in during training: bf16 on CUDA, float32 on CPU."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def autocast(device):
    """bf16 autocast on CUDA; plain float32 on CPU."""
    cuda = str(device).startswith("cuda")
    return torch.autocast("cuda" if cuda else "cpu", torch.bfloat16, enabled=cuda)
