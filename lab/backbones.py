"""Backbones by name: the tiny twins and toy backbones built here, real checkpoints through model.py; CPU threads,
the device a batch goes to and the autocast the backbone computes in."""

import torch

import model as M
from lab import chunks, tiny, toy_backbone


def load_backbone(name, device=None, dtype=None, seed=0, image_splitting="checkpoint", image_memory=chunks.IMAGE_MEMORY):
    """Load a backbone by name: real checkpoints in bf16 on CUDA (float32 on CPU), a tiny offline twin (random
    weights), `toy-idefics2` (the shipped reference, meta-trained to learn in context) or a toy backbone's file
    (train.py --build-toy). image_splitting: Idefics2's, as the processor has it ("checkpoint") or "on" / "off".
    image_memory: the bytes a call of the vision tower or connector may hold (chunk_images)."""
    family = M.family_of(name)
    if is_built(name):
        model, processor = tiny.TINY_BUILDERS[family](seed) if name.startswith("tiny-") else \
            toy_backbone.toy_idefics2(name if M.is_toy_file(name) else None)
        images = M.image_setting(processor, family, image_splitting, "built-in processor")
        model = model.to(device or "cpu", dtype or torch.float32)
    else:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        path = M.FAMILIES[family].hub_id if name == family else name
        M.check_config(M.read_config(path), path)  # the config, eos ids and processor before the weights: it fails faster
        M.check_eos(path)
        processor, images = M.load_processor(path, family, image_splitting)
        model = M.FAMILIES[family].model_cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                           device_map={"": M.placed(device)})  # no copy in host memory
    chunks.chunk_images(model, image_memory)
    M.context_limit(processor, model.config)  # the tokenizer knows the text model's context, which data.collate checks
    return M.Backbone(M.freeze(model), processor, family, name, images)


def choose_threads(name, threads=None):
    """Set torch's CPU threads: `threads` (--threads) if given, else one for a tiny or toy backbone (a few million
    parameters or fewer) on CPU, where a second thread only adds synchronisation (10x slower on a busy 2-core machine,
    README), else torch's default. Returns the count in force."""
    if threads or (is_built(name) and not torch.cuda.is_available()):
        torch.set_num_threads(threads or 1)
    return torch.get_num_threads()


def is_built(name):
    """Whether a backbone is built here rather than loaded: a tiny twin, toy-idefics2 or a toy backbone's file."""
    return name.startswith("tiny-") or name == "toy-idefics2" or M.is_toy_file(name)


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
