"""Flags train.py and evaluate.py share, and the checks of numeric flags and folders."""
import math
import os

import torch

from lab.models import chunks, families
from lab.run import feed


MAX_INT = 2**63 - 1    # every count flag: what a 64-bit integer (torch's sizes, seeds, steps) holds


MAX_SEED = 2**32 - 1   # --seed: torch's generators take 64 bits, and epoch_order seeds with seed x 100,003 + epoch


MAX_THREADS = max(1024, os.cpu_count() or 1)


MAX_WORKERS = 4 * (os.cpu_count() or 1)  # --workers: processes past this only cost memory (2**62 asked for all of it)


FLOAT32 = torch.finfo(torch.float32)  # the rates and weights scale float32 tensors (the adapter's, AdamW's)


# {name: (must be > 0, else >= 0; power)}: each scales float32 tensors (the adapter's, AdamW's, the losses), so
# value^power must be finite in float32 and, if not 0, not below its smallest normal number (T^2 scales LIVE's KL)
FLOAT_FLAGS = {"lr": (True, 1), "weight_decay": (False, 1), "clip": (True, 1), "kappa": (True, 1), "lam": (False, 1),
               "temperature": (True, 2)}


def check_floats(p, args):
    """A parser error naming the flag for each of FLOAT_FLAGS that is not finite, out of its sign, or whose power
    leaves float32's range: inf for --lr would stop the run at step 1 after loading everything."""
    for name, (positive, power) in FLOAT_FLAGS.items():
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        most, least, why = FLOAT32.max ** (1 / power), FLOAT32.tiny ** (1 / power), \
            " (T^2 scales the KL)" if power == 2 else ""
        if not math.isfinite(value) or abs(value) > most:
            p.error(f"{flag} must be a finite number of float32's range, at most {most:.4g}{why} (got {value})")
        if not (value > 0 if positive else value >= 0):
            p.error(f"{flag} must be {'>' if positive else '>='} 0 (got {value})")
        if 0 < value < least:
            p.error(f"{flag} must be at least {least:.4g}" + (", whose square is" if power == 2 else ",") +
                    f" float32's smallest normal number{why} (got {value})")


MAX_IMAGE_MEMORY = MAX_INT / 1e9  # --image-memory, GB: its bytes must be a 64-bit count (1e300 GB is inf bytes)


def check_image_memory(p, args):
    """A parser error naming --image-memory unless it is a finite number of GB > 0 whose bytes a 64-bit integer
    holds (the chunks of chunks.chunk_images are counted in bytes: 1e300 GB made them NaN after the model loaded)."""
    if not 0 < args.image_memory <= MAX_IMAGE_MEMORY:
        p.error(f"--image-memory must be a finite number of GB > 0, at most {MAX_IMAGE_MEMORY:.4g} (got "
                f"{args.image_memory})")


def check_at_least(p, args, bounds):
    """A parser error for each flag of {name: least or (least, most)} given outside [least, most] (most: MAX_INT
    unless given; a list flag: any of its values), naming the flag."""
    for name, bound in bounds.items():
        (least, most), value = bound if isinstance(bound, tuple) else (bound, MAX_INT), getattr(args, name)
        values = [v for v in (value if isinstance(value, list) else [value]) if v is not None]
        if any(v < least for v in values):
            p.error(f"--{name.replace('_', '-')} must be at least {least} (got {value})")
        if any(v > most for v in values):
            p.error(f"--{name.replace('_', '-')} must be at most {most:,} (got {value})")


def check_folders(p, folders):
    """A parser error for each of {flag: path} that names an existing file where a folder must be (or made)."""
    for flag, path in folders.items():
        if path and os.path.exists(path) and not os.path.isdir(path):
            p.error(f"{flag} {path} is a file; it must be a folder")


def add_worker_flag(p):
    """--workers: the processes that prepare batches (train.py, evaluate.py)."""
    p.add_argument("--workers", type=int, default=feed.default_workers(), help="DataLoader worker processes that "
                   "prepare batches (images, tokens, cached teacher states) while the model runs (default with a "
                   "GPU: this machine's cores less one, shared among torchrun's processes, at most 8; without one: 0, "
                   "the model's threads using the cores; 0: in the main process, one batch at a time; the results "
                   "are the same)")


def add_icd_flags(p):
    """--icds, --rices-encoder, --rices-cache: how demonstrations are chosen (train.py's teacher, evaluate.py)."""
    p.add_argument("--icds", default="random", choices=["random", "rices"], help="how a query's demonstrations are "
                   "chosen from the training split: at random, or by RICES (the most similar images by cosine "
                   "similarity of a frozen image encoder's pooled features, most similar right before the query)")
    p.add_argument("--rices-encoder", help="RICES's image encoder: a CLIP checkpoint's hub id or path, loaded with "
                   "transformers (default: the backbone's own vision tower, mean-pooled; works offline)")
    p.add_argument("--rices-cache", default=os.path.expanduser("~/.cache/hyper-icl/rices"),
                   help="folder of cached RICES image features, one file per encoder and item list")


def add_plan_flags(p):
    """--plan, --processor, --image-splitting (the image setting that changes a run's cost most) and --image-memory
    (train, evaluate)."""
    here = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--plan", nargs="?", const=here, choices=["cuda", "cpu"], help="print the run's plan and exit, "
                   "loading no weights: tokens per student and teacher row, the images a batch holds, the teacher "
                   "cache on disk, estimated peak memory of training and evaluation; cuda: bf16 on a GPU "
                   "(torch.cuda.max_memory_allocated); cpu: float32, peak resident memory; without a value the run's "
                   f"own device (here: {here})")
    p.add_argument("--image-memory", type=float, default=chunks.IMAGE_MEMORY / 1e9, help="GB the vision tower and "
                   "Idefics2's connector may hold at once: they encode a batch's images in chunks of as many as fit "
                   "(chunks.image_work; at least one), the same numbers as one call; the plan counts one chunk")
    p.add_argument("--processor", help="--plan: a local folder with the checkpoint's tokenizer and preprocessor "
                   "files, for a short --model name whose processor is not in the local Hugging Face cache")
    p.add_argument("--image-splitting", default="checkpoint", choices=families.IMAGE_SPLITTING,
                   help="Idefics2: split each "
                   "image into 4 crops + the whole image (5 x 64 tokens instead of 64: 4x the teacher cache) as the "
                   "checkpoint's preprocessor_config.json says (idefics2-8b-base most likely off, idefics2-8b on), "
                   "or on / off")
