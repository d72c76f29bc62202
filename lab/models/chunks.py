"""Images in chunks (--image-memory): the vision tower and Idefics2's connector run over a batch's images in
chunks of as many as fit a memory budget, giving the same numbers as one call."""
import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


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
    perceiver = hasattr(getattr(config, "perceiver_config", None), "hidden_size")  # Idefics2's, which feeds the decoder
    return max(layer, connector if perceiver else 0) * itemsize


def image_modules(model):
    """The modules that encode a batch's images one image at a time, each over all of them in one call: the vision
    tower, and Idefics2's connector (LLaVA's projector works on one patch at a time and holds little)."""
    modules = (getattr(model.model, name, None) for name in ("vision_model", "vision_tower", "connector"))
    return [m for m in modules if m is not None]


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
    n, patch = first.shape[0], side(config.vision_config.patch_size)
    patches = first.shape[1] if first.dim() == 3 else first.shape[-2] * first.shape[-1] // patch ** 2
    step = max(1, int(module.icl_chunking["budget"] // image_work(config, patches, first.element_size())))
    starts, calls = range(0, n, step), in_step(module, math.ceil(n / step))
    if calls == 1:
        return forward(module, *args, **kwargs)
    part = lambda v, s: v[s:s + step] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
    outs = [forward(module, *(part(a, s) for a in args), **{k: part(v, s) for k, v in kwargs.items()})
            for s in [*starts, *[starts[-1]] * (calls - len(starts))]]  # stand-ins last: their outputs dropped
    return joined(outs[:len(starts)]) if len(starts) > 1 else outs[0]


def in_step(module, calls):
    """How many calls of `module` to make for this process's `calls` chunks: the most of any process where the module
    is sharded over torchrun's processes (lab/run/shard.py: each call gathers its parameters from all of them, so all
    make as many, one with fewer repeating its last chunk), else `calls`."""
    if not (dist.is_initialized() and any(isinstance(m, FSDPModule) for m in module.modules())):
        return calls
    most = torch.tensor([calls], device=next(module.parameters()).device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def side(size):
    """A patch's or image's side: the number itself, or the first of [height, width] (InternVL's vision config)."""
    return size[0] if isinstance(size, (list, tuple)) else size


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
