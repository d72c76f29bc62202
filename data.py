"""Data: what the teacher and the student read, the demonstrations, and the benchmarks in their official formats.

Items. Each question (VQA, MME, SEED-Bench) or image (captions) is one `Item`: VQA `answers` are the ten human
answers and the target VQAv2's `multiple_choice_answer` (OK-VQA: the most frequent answer); captions have no
question, all references as answers and the first as target; MME the answer Yes or No, SEED-Bench the four options
and the answer's letter, `category` the subtask / dimension.

Prompts (PROMPTS): an instruction line, then each in-context demonstration (ICD) as
`<image>Question: {q} Short answer: {a}<end>` and a newline, then the query as `<image>Question: {q} Short answer:`.
`<end>`, which closes every answer and is part of the training label, is Idefics2's `<end_of_utterance>`, Idefics'
eos `</s>` (a base model pretrained on web documents, not dialogues) and the LLaVA models' eos (plain interleaved
text, no chat turns). All four processors expand the same `<image>` placeholder.

Batches (Section 3). A row is [start, instruction, ICD_1 .. ICD_m, query + target]: the teacher's has m ICDs, the
student's none. Each piece is tokenised once, with its image, by the family's own processor, and rows are
concatenations of those ids, so the query's ids are identical in teacher and student; rows are left-padded, so the
query + target (T tokens) are the last T positions of both (`query_target`). LLaVA-OneVision encodes every image in its
multi-image mode (`onevision_piece`), so the query image gets the same tokens with and without ICDs.

Then the readers: the layout of --data-root, the splits of MME and SEED-Bench and what every reader checks are in
docs/real-models.md ("Data layout"); a bad file or entry is an error naming it. Last, the generated toy-icl datasets
and the project's file writes (atomic, with checked caches).
"""
import contextlib
import hashlib
import io
import json
import math
import os
import random
import re
import secrets
import shutil
import socket
import time
from collections import Counter
from dataclasses import dataclass

import numpy
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm
from transformers.models.idefics.processing_idefics import (image_attention_mask_for_packed_input_ids,
                                                            incremental_to_binary_attention_mask)
# -------------------------------------------------------------------------------------------------- items and tasks

@dataclass(frozen=True)
class Item:
    """One query: a question about an image (VQA) or an image to caption (question None)."""
    id: int                  # VQA question_id; COCO cocoid; Flickr30k Karpathy imgid
    image_path: str
    question: str | None
    answers: tuple[str, ...]  # the ten human answers (VQA) or all reference captions
    target: str              # the training target (see the module docstring)
    category: str = ""       # MME subtask / SEED-Bench dimension


@dataclass(frozen=True)
class Task:
    kind: str            # "vqa" or "caption"
    max_new_tokens: int  # generation length at evaluation
    shots: int | None = None  # ICDs per query where the paper fixes them for the task, else DEFAULT_SHOTS


TASKS = {
    "vqav2": Task("vqa", 5), "ok-vqa": Task("vqa", 5), "coco": Task("caption", 20), "flickr30k": Task("caption", 20),
    "mme": Task("yes-no", 5, shots=2), "seed": Task("choice", 5, shots=2),  # the paper's 2-shot ICL (Table 2)
    "seed2": Task("choice", 5, shots=2),  # SEED-Bench-2's single image
    "toy-icl-colour": Task("vqa", 3), "toy-icl-background": Task("vqa", 3),
}
SPLITS = ("train", "val")
DEFAULT_SHOTS = {"idefics2": 8, "idefics": 32, "llava-interleave": 8, "llava-onevision": 8}  # ICDs per query (paper)


def default_shots(task, family):
    """ICDs per query: the task's own number (MME, SEED: 2, as the paper runs them) or the backbone's (paper)."""
    return TASKS[task].shots if TASKS[task].shots is not None else DEFAULT_SHOTS[family]


# ---------------------------------------------------------------------------------------------------------- prompts

PROMPTS = {  # task kind -> the instruction line, the query (an ICD without its answer), the answer
    "vqa": dict(instruction="Answer each question about its image with a short answer.\n",
                query="<image>Question: {question} Short answer:", answer=" {answer}"),
    "caption": dict(instruction="Describe each image in one sentence.\n", query="<image>Caption:", answer=" {answer}"),
    "yes-no": dict(instruction="Answer each question about its image with yes or no.\n",  # MME
                   query="<image>Question: {question} Answer:", answer=" {answer}"),
    "choice": dict(instruction="Answer each question about its image with the letter of the correct option.\n",
                   query="<image>Question: {question}{options}\nAnswer:", answer=" {answer}"),  # SEED, letter
    # SEED's likelihood protocol: the official prompt (SEED-Bench's model/instruct_blip_interface.py,
    # "Question: {question}\nAnswer:"), no instruction line and no options; an answer is an option's text
    # (evaluate.option_logliks).
    "choice-likelihood": dict(instruction="", query="<image>Question: {question}\nAnswer:", answer=" {answer}"),
}
SEPARATOR = "\n"  # after each ICD


def end_token(processor, family):
    """The token that closes an answer: Idefics2's <end_of_utterance>, else the tokenizer's eos."""
    return "<end_of_utterance>" if family == "idefics2" else processor.tokenizer.eos_token


def prompt_text(kind, item):
    """The query text of an item, its image placeholder first (for "choice", the options after the question, one line
    each: "\nA. {choice_a}\nB. {choice_b}...")."""
    options = "".join(f"\n{letter}. {option}" for letter, option in zip(SEED_LETTERS, item.answers))
    return PROMPTS[kind]["query"].format(question=item.question, options=options if kind == "choice" else "")


def answer_text(processor, family, kind, answer):
    """The answer text that follows a query: the answer, then the family's end token."""
    return PROMPTS[kind]["answer"].format(answer=answer) + end_token(processor, family)


# ------------------------------------------------------- batches: what the teacher and the student read (Section 3)

def query_pieces(processor, family, kind, queries):
    """Each query + target tokenised once (encode_query), to be shared by its teacher row and its student row."""
    return [encode_query(processor, family, kind, q) for q in queries]


def teacher_batch(processor, family, kind, pieces, icds):
    r"""The teacher batch [ICDs; query + target] (run without the adapter): icds[i] (from `demonstrations`), then
    pieces[i] (query_pieces). The query's ids are those of its student row, token for token:

        teacher row    <s> instruction  <image>Q: q1 A: a1<end>\n  ...  <image>Q: q8 A: a8<end>\n  <image>Q: q A: a<end>
        student row    <pad> <pad> <pad> <pad> <pad> <pad> <pad> <pad> <pad> <s> instruction  <image>Q: q A: a<end>
        query_target                                                                          ^^^^^^^^^^^^^^^^^^^^^

    Rows are left-padded, so the query + target (answer and end token) are the last positions of every row, and
    `query_target` marks them: the tokens Eq 16 compares, the student's h^(l) against the teacher's."""
    rows = [join(encode_prefix(processor, family, kind, d), p) for d, p in zip(icds, pieces)]
    return collate(rows, processor, family)


def student_batch(processor, family, kind, pieces):
    """The student batch [query + target]: the teacher batch without ICDs."""
    return teacher_batch(processor, family, kind, pieces, [[] for _ in pieces])


def prompt_batch(processor, family, kind, queries, icds=None):
    """Prompts for generation, left-padded, without targets: zero-shot / adapter (icds None) or n-shot ICL."""
    icds = icds or [[] for _ in queries]
    return collate([encode(processor, family, kind, d, q, with_target=False) for d, q in zip(icds, queries)],
                   processor, family)


def encode_piece(processor, family, text, image, pixels=None):
    """Token ids and images of one piece of a row (text starting with `<image>`), by the family's processor:
    {"input_ids": list[int], "images": {name: one entry an image}}. `pixels` (image_pixels of the image) are reused
    where the caller has them, so an image shared by two pieces is processed once. Idefics: its processor's
    pixel_values [1, 3, H, W] (float); the other families: image_pixels, uint8, which model_inputs normalises."""
    if family == "idefics":  # list format; the processor always starts with BOS, which the row adds itself
        out = processor(text=[image, text.removeprefix("<image>")], return_tensors="pt")
        return {"input_ids": out["input_ids"][0, 1:].tolist(), "images": {"pixel_values": out["pixel_values"][0]}}
    pixels = pixels or image_pixels(processor, family, image)
    return {"input_ids": piece_ids(processor, family, text, pixels), "images": pixels}


def piece_ids(processor, family, text, pixels):
    """The ids of a piece's text, each `<image>` expanded into the tokens its processor gives the image."""
    if family == "idefics2":  # its processor expands <image> from the text alone (image_seq_len, x 5 with splitting)
        return processor(text=text, add_special_tokens=False)["input_ids"][0]
    one = processor.image_token * onevision_tokens(processor) if family == "llava-onevision" else \
        processor.replace_image_token(pixels, 0)  # LLaVA-Interleave: a token a patch of the resized image
    return processor.tokenizer(text.replace(processor.image_token, one), add_special_tokens=False)["input_ids"]


def image_pixels(processor, family, image):
    """One image through the family's image processor, stopped before rescaling and normalisation (model_inputs does
    those on the device): {"pixel_values": [uint8 [3, h, w] a crop]}; Idefics2: one crop, or 4 crops + the whole
    image with image splitting, each its own size; LLaVA-Interleave: [3, 384, 384]; LLaVA-OneVision: its base view
    (onevision_piece)."""
    if family == "llava-onevision":
        return onevision_piece(processor.image_processor, image)
    split = {"do_pad": False} if family == "idefics2" else {}  # Idefics2: no padding (collate pads the batch once)
    out = processor.image_processor([[image]] if split else [image], do_rescale=False, do_normalize=False, **split)
    return {"pixel_values": [chw(c) for c in (out["pixel_values"][0] if split else out["pixel_values"])]}


def chw(array):
    """A processor's [3, h, w] uint8 array (a view of PIL's h x w x 3 pixels) as a contiguous tensor, transposed by
    numpy on one thread: copying the strided view into a canvas costs 3-6x more on a busy machine (torch splits it
    over its threads)."""
    return torch.from_numpy(numpy.ascontiguousarray(array))


def onevision_tokens(processor):
    """The tokens of one LLaVA-OneVision image in multi-image mode: its base view and a newline (less CLS under the
    "default" feature strategy)."""
    return processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")


def onevision_piece(process, image):
    """A LLaVA-OneVision image encoded as one of several images, the model's multi-image mode. The model tiles an
    image at any resolution (anyres: 2,929 tokens for 640 x 480) only when its prompt holds one image; an image among
    several is its base 384 x 384 view, num_image_tokens + 1 (newline) = 730 tokens. A teacher row holds several
    images, so its query image is in that mode; the student's lone query image must be too, or the query's tokens
    would differ between the rows (Eq 16 compares them token by token). So every image is encoded this way, in
    training and evaluation alike (`image_inputs` tells the model): padded to a square of the mean colour and resized,
    as the image processor does for an image among several, once (not as a prompt of two images, one kept).
    Returns image_pixels' dict, with the image's "image_sizes" [1, 2]."""
    pixels = process.process_image(image, do_convert_rgb=True)
    square = process.pad_to_square(pixels, tuple(int(x * 255) for x in process.image_mean))
    view = process.resize(square, process.size, resample=process.resample)
    return {"pixel_values": [chw(view)], "image_sizes": torch.tensor([pixels.shape[-2:]])}


def encode_query(processor, family, kind, query, with_target=True):
    """The query piece, built once and shared by the query's teacher and student rows: ids, images, labels (-100 on
    the prompt, the ids themselves on the answer + end token; the model shifts them). The answer's ids (of
    query.target) are read off the tokenisation of the whole piece: the tokens the model would generate after the
    prompt. The image is processed once, for both tokenisations (Idefics excepted: its processor takes both)."""
    image, prompt = load_image(query), prompt_text(kind, query)
    piece = encode_piece(processor, family, prompt, image)
    ids = piece["input_ids"]
    if with_target:
        piece = encode_piece(processor, family, prompt + answer_text(processor, family, kind, query.target), image,
                             None if family == "idefics" else piece["images"])
        if piece["input_ids"][:len(ids)] != ids:
            raise ValueError(f"item {query.id}: the prompt's tokens are not a prefix of the prompt + answer's")
    return {**piece, "labels": [-100] * len(ids) + piece["input_ids"][len(ids):], "id": query.id}


def encode_prefix(processor, family, kind, icds):
    """The row before the query: BOS (if the tokenizer has one), the instruction line, then each ICD."""
    tok = processor.tokenizer
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + \
        tok(PROMPTS[kind]["instruction"], add_special_tokens=False)["input_ids"]
    pieces = [encode_piece(processor, family, prompt_text(kind, d) + answer_text(processor, family, kind, d.target)
                           + SEPARATOR, load_image(d)) for d in icds]
    return {"input_ids": ids + [i for p in pieces for i in p["input_ids"]], "images": [p["images"] for p in pieces]}


def join(prefix, query):
    """One row: the prefix, then the query piece. Labels only on the answer; query_len = the query's tokens."""
    return {"input_ids": prefix["input_ids"] + query["input_ids"],
            "labels": [-100] * len(prefix["input_ids"]) + query["labels"],
            "images": prefix["images"] + [query["images"]], "query_len": len(query["input_ids"]), "id": query["id"]}


def encode(processor, family, kind, icds, query, with_target=True):
    """One row [BOS, instruction, ICDs, query (+ target)] as lists: input_ids, labels, images, query_len."""
    return join(encode_prefix(processor, family, kind, icds), encode_query(processor, family, kind, query, with_target))


def pad_stack(tensors):
    """Stack tensors of equal rank, zero-padding every dimension at its end to the largest size."""
    shape = [max(sizes) for sizes in zip(*(t.shape for t in tensors))]
    out = tensors[0].new_zeros(len(tensors), *shape)
    for o, t in zip(out, tensors):
        o[tuple(slice(0, n) for n in t.shape)] = t
    return out


def image_inputs(rows, processor, family, input_ids):
    """The image tensors of a batch, in the form the family's forward takes (images in row order); the pixels of
    image_pixels stay uint8, with "pixel_norm" (pixel_norm) for model_inputs to normalise them on the device."""
    per_row = [[x for p in r["images"] for x in p["pixel_values"]] for r in rows]
    if family == "idefics":  # [B, images, 3, H, W], and which image each token cross-attends to
        pixel_values = pad_stack([pad_stack(v) for v in per_row])
        latest, _ = image_attention_mask_for_packed_input_ids(input_ids, processor.tokenizer, "pt")
        mask = incremental_to_binary_attention_mask(latest, "pt", num_classes=pixel_values.shape[1])
        return {"pixel_values": pixel_values, "image_attention_mask": mask}
    norm = {"pixel_norm": pixel_norm(processor.image_processor)}
    if family == "idefics2":  # [B, crops, 3, H, W] uint8 and its mask; padding crops are all zero once normalised
        return {**crop_canvas(per_row), **norm}
    out = {"pixel_values": torch.stack([x for v in per_row for x in v]), **norm}  # LLaVA: [all images, 3, H, W]
    if family == "llava-onevision":  # it tiles exactly the images of one-image samples; none here (onevision_piece),
        out["pixel_values"] = out["pixel_values"][:, None]  # [images, 1 view, 3, H, W]
        out["image_sizes"] = torch.cat([p["image_sizes"] for r in rows for p in r["images"]])
        out["batch_num_images"] = torch.tensor([max(len(out["image_sizes"]), 2)])  # so: one sample of several
    return out


def crop_canvas(per_row):
    """Idefics2's crops of each row, uint8 [3, h, w] of any size, laid top-left on one zero uint8 canvas [B, crops,
    3, H, W] (the batch's largest), with pixel_attention_mask bool [B, crops, H, W] on the real pixels."""
    n, (h, w) = max(map(len, per_row)), (max(x.shape[k] for v in per_row for x in v) for k in (1, 2))
    pixels = torch.zeros(len(per_row), n, 3, h, w, dtype=torch.uint8)
    mask = torch.zeros(len(per_row), n, h, w, dtype=torch.bool)
    for b, crops in enumerate(per_row):
        for k, x in enumerate(crops):
            pixels[b, k, :, :x.shape[1], :x.shape[2]] = x
            mask[b, k, :x.shape[1], :x.shape[2]] = True
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def pixel_norm(process):
    """[3, 3] float32, per channel (divisor, mean, std): an image processor's rescaling and normalisation, as
    (x / divisor - mean) / std in float32. With transformers' rescale by 1/255 (in float64, then rounded to float32),
    x / 255 in float32 is the same number for every uint8 x, so the normalised pixels are the processor's to the bit
    (tests/test_data.py)."""
    divisor = 1 / process.rescale_factor if process.do_rescale else 1.0
    mean, std = (process.image_mean, process.image_std) if process.do_normalize else (0.0, 1.0)
    return torch.stack([torch.tensor(v, dtype=torch.float32).expand(3) for v in (divisor, mean, std)], 1)


def normalised(batch):
    """The batch with uint8 pixel_values normalised (pixel_norm), float32, zero outside pixel_attention_mask (Idefics2's
    padding, as its processor pads); a batch without pixel_norm as it is. Wherever the batch lives: on the device."""
    if "pixel_norm" not in batch:
        return batch
    pixels, (divisor, mean, std) = batch["pixel_values"], batch["pixel_norm"].T[..., None, None]
    out = pixels.float().div_(divisor).sub_(mean).div_(std)  # [..., 3, H, W], channel by channel
    if "pixel_attention_mask" in batch:
        out.masked_fill_(~batch["pixel_attention_mask"][..., None, :, :], 0)
    return {**{k: v for k, v in batch.items() if k != "pixel_norm"}, "pixel_values": out}


def left_pad(seq, width, fill):
    """seq preceded by `fill` up to `width`."""
    return [fill] * (width - len(seq)) + list(seq)


def collate(rows, processor, family):
    """Left-pad rows into a batch: input_ids, attention_mask, position_ids (real tokens only: 0 on padding), labels
    (-100 except on the answer + end token), query_target (each row's last query_len positions: the query + target,
    which teacher and student share) and the images. A row longer than the model's context (the tokenizer's
    model_max_length) is an error naming its item."""
    for r in rows:
        if len(r["input_ids"]) > processor.tokenizer.model_max_length:
            raise ValueError(f"item {r['id']}: its prompt has {len(r['input_ids'])} tokens, more than the model's "
                             f"{processor.tokenizer.model_max_length} positions; shorten its question (or use fewer "
                             "demonstrations)")
    width, pad = max(len(r["input_ids"]) for r in rows), processor.tokenizer.pad_token_id
    input_ids = torch.tensor([left_pad(r["input_ids"], width, pad) for r in rows])
    attention_mask = torch.tensor([left_pad([1] * len(r["input_ids"]), width, 0) for r in rows])
    query_target = torch.tensor([left_pad([True] * r["query_len"], width, False) for r in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "labels": torch.tensor([left_pad(r["labels"], width, -100) for r in rows]), "query_target": query_target,
            **image_inputs(rows, processor, family, input_ids)}


def answer_window(labels):
    """K: the last K positions of each left-padded row hold its target tokens and the position before each, so a
    forward with logits_to_keep=K runs the LM head there only, not over every position x the whole vocabulary
    (152k for the Qwen models: gigabytes a row). Logits then line up with labels[:, -K:]."""
    return int((labels != -100).sum(1).max()) + 1


def model_inputs(batch, device=None):
    """A batch as the backbone's forward keyword arguments (all but "labels" and "query_target"), on `device` (copied
    without waiting: the batch is pinned on CUDA), its pixels normalised there (normalised)."""
    return normalised({k: v.to(device, non_blocking=True) for k, v in batch.items()
                       if k not in ("labels", "query_target", "window")})


class Prepared(torch.utils.data.Dataset):
    """build(specs[k]) as the k-th item (prepared)."""

    def __init__(self, build, specs, on_host):
        self.build, self.specs, self.on_host = build, specs, on_host

    def __len__(self):
        return len(self.specs)

    def __getitem__(self, k):
        try:
            out = self.build(self.specs[k])
        except Exception as e:  # handed back whole: torch would re-raise it with the worker's traceback in its text
            return Failed(e)
        return on_host(out) if self.on_host else out


@dataclass
class Failed:
    """What a DataLoader worker hands back for an item it could not build: the error, raised again by prepared."""
    error: Exception


def on_host(obj):
    """obj with every batch in it (a dict holding pixel_norm, at any depth of dicts) normalised: for a CPU run, whose
    device is the host, so that the workers do that work too."""
    return normalised({k: on_host(v) for k, v in obj.items()}) if isinstance(obj, dict) else obj


def prepared(build, specs, workers, device="cpu"):
    """build(spec) for each spec, in order, made by `workers` DataLoader worker processes ahead of their use (two
    each in flight) while this process computes (0: here, when asked for; the same items); pinned for a CUDA
    `device`, so model_inputs copies them without waiting. build must need no model (a worker has none). An error
    in a worker is raised here as it was raised there (an unreadable image names its item and file, one line)."""
    cuda = str(device).startswith("cuda")
    for item in torch.utils.data.DataLoader(Prepared(build, specs, not cuda), batch_size=None, num_workers=workers,
                                            pin_memory=cuda, prefetch_factor=2 if workers else None,
                                            generator=torch.Generator()):  # its seed draw leaves the global RNG alone
        if isinstance(item, Failed):
            raise item.error
        yield item


def default_workers():
    """--workers' default. With a GPU: the cores this process may use, shared among the processes torchrun starts on
    the machine, less one for the process itself, at most 8. Without one: 0, for the model's own threads use the
    cores (on this 2-core machine a worker beside them made training 1.05x slower than preparing in-process:
    docs/efficiency.md)."""
    if not torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


# --------------------------------------------------------------------------------- demonstrations: random, or RICES

def demonstrations(query_ids, support, m, seed):
    """m ICDs per query, drawn at random from the support set, never the query itself (same id). The draw for a query
    depends only on (seed, query id, support set), not on which other queries are drawn for or in what order, so a
    teacher run for a query is reproducible."""
    if len(support) <= m:
        raise ValueError(f"a support set of {len(support)} items is too small for {m} ICDs per query (need {m + 1}; "
                         "--shots sets the ICDs)")
    icds = []
    for qid in query_ids:  # a 64-bit seed per query from hashlib: the same in every Python process
        query_seed = int.from_bytes(hashlib.sha256(f"{seed}:{qid}".encode()).digest()[:8], "little")
        picks = random.Random(query_seed).sample(range(len(support)), m + 1)  # one spare for the query
        icds.append([support[i] for i in picks if support[i].id != qid][:m])
    return icds


def choose_demonstrations(backbone, args, queries, support, shots):
    """The ICDs of each query: random (demonstrations) or RICES (rices_demonstrations on the features of
    image_encoder, cached by image_features)."""
    ids = [q.id for q in queries]
    if args.icds == "random":
        return demonstrations(ids, support, shots, args.seed)
    encode, encoder_id = image_encoder(backbone, args.rices_encoder)
    features = lambda items: image_features(encode, encoder_id, items, args.rices_cache)
    return rices_demonstrations(ids, features(queries), support, features(support), shots)


def rices_demonstrations(query_ids, query_features, support, support_features, m):
    """RICES (Yang et al. 2022): per query, the m support items whose image features are most cosine-similar, never
    the query itself (same id), as `demonstrations` returns them. Order: least to most similar, so the most similar
    ICD is the last one, right before the query; equal similarities rank in support order."""
    if len(support) <= m:
        raise ValueError(f"a support set of {len(support)} items is too small for {m} ICDs per query (need {m + 1}; "
                         "--shots sets the ICDs)")
    sim = F.normalize(query_features.double(), dim=-1) @ F.normalize(support_features.double(), dim=-1).T
    ids = torch.tensor([it.id for it in support])
    if sim.isnan().any():
        raise ValueError("RICES: the image features contain NaN")
    sim[ids[None, :] == torch.tensor(query_ids)[:, None]] = -math.inf  # the query is never its own ICD
    order = torch.argsort(-sim, dim=-1, stable=True)[:, :m]  # most similar first
    return [[support[j] for j in reversed(row.tolist())] for row in order]


def image_features(encode, encoder_id, items, cache_dir, batch_size=32):
    """Each item's image features under a frozen encoder (encode(PIL images) -> [n, d]), [len(items), d] float32, each
    distinct image encoded once. The cache file is named by a hash of encoder_id and of every item's id, image path,
    file size and modification time: a change of the encoder or of the data is another file (never a stale read)."""
    stat = lambda p: (os.stat(p).st_size, os.stat(p).st_mtime_ns) if os.path.exists(p) else None
    spec = {"encoder": encoder_id, "items": [[it.id, it.image_path, stat(it.image_path)] for it in items]}
    key = hashlib.sha256(json.dumps(spec).encode()).hexdigest()
    path = os.path.join(cache_dir, key[:32] + ".safetensors")
    remove_stale_tmp(cache_dir)
    cached = read_cache(path, key, {"features": ((len(items), None), torch.float32)})
    if cached is not None:
        return cached["features"]
    paths = list(dict.fromkeys(it.image_path for it in items))
    by_path = {it.image_path: it for it in items}  # an item that shows each image
    feats = []
    for i in tqdm(range(0, len(paths), batch_size), desc=f"image features ({encoder_id})", unit="batch"):
        feats.append(encode([load_image(by_path[p]) for p in paths[i:i + batch_size]]).float().cpu())
    row = {p: k for k, p in enumerate(paths)}
    features = torch.cat(feats)[[row[it.image_path] for it in items]].contiguous()
    write_cache(path, {"features": features}, key)
    return features


def image_encoder(backbone, hub_id=None):
    """RICES's frozen image encoder: (encode(images) -> [n, d] features, an id that changes with the encoder).
    Default: the backbone's own vision tower (vision_tower_features; its id hashes the tower's weights); hub_id: a
    CLIP checkpoint (clip_encoder)."""
    if hub_id:
        return clip_encoder(hub_id, next(backbone.model.parameters()).device), f"clip:{hub_id}"
    h, inner = hashlib.sha256(f"{backbone.name}:{backbone.family}".encode()), backbone.model.model
    for p in (inner.vision_model if backbone.family in ("idefics2", "idefics") else inner.vision_tower).parameters():
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    encoder_id = f"vision-tower:{backbone.name}:{h.hexdigest()[:16]}"
    return (lambda images: vision_tower_features(backbone, images)), encoder_id


@torch.no_grad()
def vision_tower_features(backbone, images):
    """The backbone's own vision tower, pooled: [n, d_vision] float32, the mean of its last hidden states over an
    image's patches. Idefics2 images are encoded whole (no splitting) and only their real (unpadded) patches are
    averaged; LLaVA-OneVision's base tile is the whole image, resized."""
    model, family = backbone.model, backbone.family
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    process = backbone.processor.image_processor
    if family == "idefics2":
        out = process([[im] for im in images], do_image_splitting=False, return_tensors="pt")
        pixels, mask = out["pixel_values"][:, 0], out["pixel_attention_mask"][:, 0]
        p = model.config.vision_config.patch_size
        real = mask.unfold(1, p, p).unfold(2, p, p).flatten(-2).any(-1).to(device)  # [n, H/p, W/p]: any real pixel
        hidden = model.model.vision_model(pixel_values=pixels.to(device, dtype), patch_attention_mask=real)
        hidden = hidden.last_hidden_state
        keep = real.flatten(1)[..., None].to(hidden.dtype)
        return ((hidden * keep).sum(1) / keep.sum(1)).float()
    out = process(images, return_tensors="pt")
    pixels = out if torch.is_tensor(out) else out["pixel_values"]  # Idefics' processor returns the tensor itself
    if family == "llava-onevision":
        pixels = pixels[:, 0]
    tower = model.model.vision_model if family == "idefics" else model.model.vision_tower
    return tower(pixel_values=pixels.to(device, dtype)).last_hidden_state.mean(1).float()


def clip_encoder(hub_id, device="cpu"):
    """A CLIP checkpoint's image encoder (hub id or local path), loaded with transformers: images -> its projected
    image embedding [n, d] float32. A checkpoint that cannot be loaded is a ValueError naming it."""
    from transformers import AutoImageProcessor, AutoModel
    try:
        clip, process = AutoModel.from_pretrained(hub_id).to(device).eval(), AutoImageProcessor.from_pretrained(hub_id)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the RICES image encoder {hub_id!r} ({e}); leave out --rices-encoder to use the "
                         "backbone's own vision tower, which works offline") from e

    @torch.no_grad()
    def encode(images):
        out = clip.get_image_features(pixel_values=process(images, return_tensors="pt")["pixel_values"].to(device))
        return (out if torch.is_tensor(out) else out.pooler_output).float()
    return encode


# ---------------------------------------------------------------------------------- readers of the official formats

def load_task(task, split, data_root=None):
    """The items of one split ("train" or "val") of a task; the toy-icl tasks are generated on first use. MME and
    SEED-Bench have no training split: "train" is their training pool, "val" the evaluation part (pool_split), and
    the sizes of both are printed."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if data_root is not None and os.path.exists(data_root) and not os.path.isdir(data_root):
        raise NotADirectoryError(f"--data-root {data_root} is a file; it must be the folder of the datasets")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if task.startswith("toy-icl-"):
        return read_vqa(toy_icl_root(task.removeprefix("toy-icl-"), data_root), split, "vqav2")
    if data_root is None:
        raise ValueError(f"task {task!r} reads its files from --data-root (layout: docs/real-models.md)")
    if TASKS[task].kind not in ("yes-no", "choice"):
        return (read_vqa if TASKS[task].kind == "vqa" else read_karpathy)(data_root, split, task)
    items = BENCHMARK_READERS[task](data_root)
    pool, rest = pool_split(items, POOL_FRACTION[task])
    count = lambda part: f"{len(part)} questions on {len({it.image_path for it in part})} images"
    print(f"{task}: {count(items)}; seeded split by image: training pool {count(pool)}, evaluation {count(rest)}")
    return pool if split == "train" else rest


def load_image(item):
    """The item's image as an RGB PIL image; an unreadable file is an OSError naming the item and the path."""
    try:
        with Image.open(item.image_path) as im:
            return im.convert("RGB")
    except Image.DecompressionBombError as e:  # PIL refuses images over 2 x Image.MAX_IMAGE_PIXELS
        raise OSError(f"item {item.id}: its image {item.image_path} is too large to read ({e})") from e
    except OSError as e:
        raise OSError(f"item {item.id}: cannot read its image {item.image_path} ({e})") from e


VQA_FILES = {  # dataset -> (folder, questions file, annotations file); {} is the split
    "vqav2": ("vqav2", "v2_OpenEnded_mscoco_{}2014_questions.json", "v2_mscoco_{}2014_annotations.json"),
    "ok-vqa": ("ok-vqa", "OpenEnded_mscoco_{}2014_questions.json", "mscoco_{}2014_annotations.json"),
}
KARPATHY_SPLITS = {"train": ("train", "restval"), "val": ("test",)}
KARPATHY_IDS = {"coco": "cocoid", "flickr30k": "imgid"}  # an item's id: COCO's image id, Flickr30k's Karpathy id


def read_json(path, dataset):
    """Parse a JSON file; a missing or malformed file is an error naming the path and the dataset."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{dataset}: expected the file {path} (layout: docs/real-models.md)")
    try:
        return json.loads(read_text(path, dataset))
    except json.JSONDecodeError as e:
        raise ValueError(f"{dataset}: {path} is not valid JSON ({e})") from e


def read_text(path, dataset):
    """A UTF-8 text file's contents, a byte-order mark stripped; undecodable bytes are an error naming the file."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{dataset}: {path} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}); "
                         "save it as UTF-8") from e


def text_field(record, name):
    """record[name] as a stripped string; null, empty or not a string is a ValueError naming the field."""
    value = record[name]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"its {name} is {value!r}; it must be non-empty text")
    return value.strip()


def integer_field(record, name):
    """record[name], an integer; null, a boolean or anything else is a ValueError naming the field."""
    value = record[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"its {name} is {value!r}; it must be an integer")
    return value


def unique_id(seen, qid, what):
    """Record an item id; one seen before is a ValueError (every prediction line must name one item)."""
    if qid in seen:
        raise ValueError(f"duplicate {what} {qid!r}")
    seen.add(qid)


def records(path, dataset, key):
    """The list under `key` in a JSON file whose top level is an object; any other shape names the file."""
    obj = read_json(path, dataset)
    if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
        raise ValueError(f"{dataset}: {path} should be a JSON object with a list under {key!r} (the official format)")
    return obj[key]


@contextlib.contextmanager
def entry(path, dataset, n, record, question=False):
    """Turn a missing, mistyped or bad field of the n-th entry of a JSON file into a ValueError naming the file and
    the entry: by its text, or (`question`, SEED-Bench's) by its question_id."""
    def where():  # only on an error: str(record) of every record would slow the readers down
        qid = record.get("question_id") if isinstance(record, dict) else "?"
        return f"question #{n} (question_id {qid}) in {path}" if question else \
            f"entry {n} of {path} ({str(record)[:80]})"
    try:
        yield
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{dataset}: {where()} has a missing or malformed field ({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise ValueError(f"{dataset}: {where()} is malformed: {e}") from e


def coco_image(root, split, image_id):
    """The path of a COCO 2014 image under data_root."""
    return os.path.join(root, "coco", f"{split}2014", f"COCO_{split}2014_{image_id:012d}.jpg")


def vqa_answers(answers):
    """The human answers of a VQA annotation ([{"answer": text}, ...]) as a tuple of strings: an empty list, or an
    answer that is not text, is a ValueError (VQA accuracy and the most frequent answer need them)."""
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"its answers are {answers!r}; they must be a non-empty list of {{'answer': text}}")
    for x in answers:
        if not isinstance(x, dict) or not isinstance(x.get("answer"), str):
            raise ValueError(f"an answer is {x!r}; every answer must be {{'answer': text}}")
    return tuple(x["answer"] for x in answers)


def most_frequent(answers):
    """The most frequent answer; ties go to the one that occurs first."""
    return Counter(answers).most_common(1)[0][0]  # Counter keeps first-seen order among equal counts


def read_vqa(root, split, dataset):
    """VQAv2 or OK-VQA ("vqav2" / "ok-vqa") questions of one split, joined with their annotations."""
    folder, qfile, afile = VQA_FILES[dataset]
    qpath, apath = (os.path.join(root, folder, f.format(split)) for f in (qfile, afile))
    questions, annotations = records(qpath, dataset, "questions"), {}
    for n, a in enumerate(records(apath, dataset, "annotations")):
        with entry(apath, dataset, n, a):
            answers = vqa_answers(a["answers"])
            target = text_field(a, "multiple_choice_answer") if dataset == "vqav2" else most_frequent(answers)
            if a["question_id"] in annotations:  # a second annotation would silently replace the first
                raise ValueError(f"duplicate question_id {a['question_id']!r} (another annotation has it)")
            annotations[a["question_id"]] = answers, target
    items, seen = [], set()
    for n, q in enumerate(questions):
        with entry(qpath, dataset, n, q):
            if q["question_id"] not in annotations:
                raise ValueError(f"question {q['question_id']} in {qpath} has no annotation in {apath}")
            unique_id(seen, q["question_id"], "question_id")
            items.append(Item(q["question_id"], coco_image(root, split, integer_field(q, "image_id")),
                              text_field(q, "question"),
                              *annotations[q["question_id"]]))
    return items


def read_karpathy(root, split, dataset):
    """COCO Caption or Flickr30k ("coco" / "flickr30k") images of one split from the Karpathy split file."""
    path, id_field = os.path.join(root, dataset, f"dataset_{dataset}.json"), KARPATHY_IDS[dataset]
    items, seen = [], set()
    for n, im in enumerate(records(path, dataset, "images")):
        with entry(path, dataset, n, im):
            image_id = integer_field(im, id_field)  # what a prediction line and CIDEr's per-image score go by
            unique_id(seen, image_id, id_field)
            if im["split"] not in KARPATHY_SPLITS[split]:
                continue
            folder = im["filepath"] if dataset == "coco" else "flickr30k-images"
            filename = im["filename"]
            if not isinstance(filename, str) or not filename or not isinstance(folder, str):
                raise ValueError(f"its filename is {filename!r} in folder {folder!r}; both must be text")
            captions = tuple(text_field(s, "raw") for s in im["sentences"])
            if not captions:
                raise ValueError("it has no captions")
        items.append(Item(image_id, os.path.join(root, dataset, folder, filename), None, captions, captions[0]))
    return items


def instances_path(root, folder):
    """The official COCO instance annotations of one image folder ("train2014" / "val2014") under data_root."""
    return os.path.join(root, "coco", "annotations", f"instances_{folder}.json")


def read_instances(items):
    """The COCO objects in each caption item's image (its id is the COCO image id), from the official instances files
    of the images' folders: ({item id: set of category names}, all category names the files declare)."""
    objects, categories = {}, set()
    for folder in sorted({os.path.dirname(it.image_path) for it in items}):
        path = instances_path(os.path.dirname(os.path.dirname(folder)), os.path.basename(folder))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CHAIR needs the COCO instance annotations {path} (instances_*2014.json of "
                                    "annotations_trainval2014.zip)")
        names = {}
        for n, c in enumerate(records(path, "coco instances", "categories")):
            with entry(path, "coco instances", n, c):
                names[c["id"]] = c["name"]
        categories |= set(names.values())
        per_image = {}
        for n, a in enumerate(records(path, "coco instances", "annotations")):
            with entry(path, "coco instances", n, a):
                if a["category_id"] not in names:
                    raise ValueError(f"category_id {a['category_id']!r} is not among the file's categories")
                per_image.setdefault(a["image_id"], set()).add(names[a["category_id"]])
        objects |= {it.id: per_image.get(it.id, set()) for it in items if os.path.dirname(it.image_path) == folder}
    return objects, categories


MME_PERCEPTION = ("existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork",
                  "OCR")  # subtask lists and order of the official eval_tool/calculation.py
MME_COGNITION = ("commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def mme_files(folder):
    """(question file, image) paths of one MME subtask folder, in either official layout."""
    qdir, idir = os.path.join(folder, "questions_answers_YN"), os.path.join(folder, "images")
    if os.path.isdir(qdir) != os.path.isdir(idir):  # half of the nested layout: its questions would vanish
        have, lack = (qdir, idir) if os.path.isdir(qdir) else (idir, qdir)
        raise FileNotFoundError(f"mme: {have} is there but {lack} is not; the release keeps both (layout: "
                                "docs/real-models.md)")
    if not os.path.isdir(qdir):
        qdir = idir = folder
    images = {}
    for f in sorted(os.listdir(idir)):
        if f.lower().endswith(IMAGE_EXTENSIONS):
            stem = os.path.splitext(f)[0]
            if stem in images:
                raise ValueError(f"mme: {os.path.join(idir, images[stem])} and {os.path.join(idir, f)} are two "
                                 "images for one question file; keep one")
            images[stem] = f
    names = sorted(f for f in os.listdir(qdir) if f.endswith(".txt"))
    alone = sorted(images.keys() - {name[:-len(".txt")] for name in names})  # their questions would vanish
    if alone:
        more = f", nor for {len(alone) - 1} more images" if alone[1:] else ""
        raise FileNotFoundError(f"mme: no question file for {os.path.join(idir, images[alone[0]])} (expected "
                                f"{alone[0]}.txt in {qdir}){more}")
    for name in names:
        path, stem = os.path.join(qdir, name), name[:-len(".txt")]
        if stem not in images:
            raise FileNotFoundError(f"mme: no image for {path} (expected {stem}.jpg or .png in {idir})")
        yield path, os.path.join(idir, images[stem])


def read_mme_questions(path):
    """The (question, Yes|No) lines of one MME question file: exactly two, blank lines skipped."""
    pairs = []
    for n, line in enumerate(read_text(path, "mme").split("\n"), 1):
        if not line.strip():
            continue
        fields = line.rstrip("\r").split("\t")
        if len(fields) != 2 or not fields[0].strip() or fields[1].strip().lower() not in ("yes", "no"):
            raise ValueError(f"mme: {path} line {n}: expected `question<TAB>Yes|No`, got {line.strip()!r}")
        pairs.append((fields[0].strip(), fields[1].strip().capitalize()))
    if len(pairs) != 2:
        raise ValueError(f"mme: {path} has {len(pairs)} questions; MME asks two about each image")
    return pairs


def read_mme(root, subtasks=MME_PERCEPTION + MME_COGNITION):
    """MME's questions from root/mme/<subtask>/..., subtask by subtask, files in name order. Ids count from 0."""
    items = []
    for subtask in subtasks:
        folder = os.path.join(root, "mme", subtask)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"mme: expected the subtask folder {folder} (layout: docs/real-models.md)")
        before = len(items)
        for path, image in mme_files(folder):
            items += [Item(len(items) + k, image, q, (a,), a, subtask)
                      for k, (q, a) in enumerate(read_mme_questions(path))]
        if len(items) == before:  # MME's totals sum every subtask: one missing is not comparable with Table 2
            raise ValueError(f"mme: the subtask folder {folder} holds no question; expected <name>.txt and its image "
                             "(or questions_answers_YN/ and images/; layout: docs/real-models.md)")
    return items


SEED_LETTERS = "ABCD"
SEED_IMAGE_DIMENSIONS = range(1, 10)  # question_type_id of the image questions; 10-12 are video
SEED2_FILE = "SEED-Bench_v2_level1_2_3.json"  # the official eval.py's --anno_path
SEED2_FOLDERS = {"cc3m": "cc3m-image", "SEED-Bench v2": "SEED-Bench-2-image"}  # data_source -> image folder
SEED2_SUBPART = "Single-Image & Text Comprehension"  # dimensions 1-16: one image, a text answer
SEED2_MAX_K = 1_000_000


def read_seed(root):
    """SEED-Bench-1's image questions (dimensions 1-9) from root/seed-bench, in file order. Ids: question_id."""
    path, folder = (os.path.join(root, "seed-bench", f) for f in ("SEED-Bench.json", "SEED-Bench-image"))
    questions, names = seed_questions(path, "seed")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"seed: expected the image folder {folder} (layout: docs/real-models.md)")
    items, seen = [], set()
    for n, q in enumerate(questions):
        with entry(path, "seed", n, q, question=True):
            if int(q["question_type_id"]) in names.keys() - set(SEED_IMAGE_DIMENSIONS):
                continue  # a video question
            unique_id(seen, int(q["question_id"]), "question_id")
            items.append(seed_item("seed", path, folder, q, int(q["question_id"]), names))
    return items


def read_seed2(root):
    """SEED-Bench-2's single-image questions (subpart "Single-Image & Text Comprehension", dimensions 1-16, levels
    L1-L2 as its eval.py's default) from root/seed-bench-2, in file order; prints the count per dimension. The
    multi-image, video, interleaved and generation dimensions (17-27) need more than one image or an image output,
    which a single-image model cannot give, and are skipped."""
    path = os.path.join(root, "seed-bench-2", SEED2_FILE)
    questions, names = seed_questions(path, "seed2")
    items, seen = [], set()
    for n, q in enumerate(questions):
        with entry(path, "seed2", n, q, question=True):
            if q["subpart"] != SEED2_SUBPART or q["level"] not in ("L1", "L2"):
                continue  # not the single-image part
            if not isinstance(q["data_id"], str):
                raise ValueError(f"a single-image question needs one data_id, got {q['data_id']!r}")
            if q["data_source"] not in SEED2_FOLDERS:
                raise ValueError(f"its data_source {q['data_source']!r} is none of {sorted(SEED2_FOLDERS)}")
            folder = os.path.join(root, "seed-bench-2", SEED2_FOLDERS[q["data_source"]])
            unique_id(seen, q["question_id"], "question_id")  # the plain form only (seed2_id): one number each
            items.append(seed_item("seed2", path, folder, q, seed2_id(q["question_id"]), names))
    counts = Counter(it.category for it in items)
    print(f"seed2: {len(items)} single-image questions; " +
          ", ".join(f"{names[k]} {counts[names[k]]}" for k in sorted(names) if names[k] in counts))
    return items


def seed_questions(path, dataset):
    """A SEED-Bench file's questions and its dimensions {question_type_id: name}."""
    obj = read_json(path, dataset)
    try:
        names = {int(v): k for k, v in obj["question_type"].items()}
        if not isinstance(obj["questions"], list):
            raise TypeError(f"`questions` is {type(obj['questions']).__name__}, not a list")
        return obj["questions"], names
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{dataset}: {path} needs `questions` and a `question_type` name -> id mapping ({e!r})") from e


def seed_item(dataset, path, folder, q, qid, names):
    """A SEED-Bench(-2) question as an Item, after the checks of both: a known dimension, four options, an answer
    letter, a question, and its image in `folder` (data_id, else data_id with an image extension)."""
    if int(q["question_type_id"]) not in names:
        raise ValueError(f"question_type_id {q['question_type_id']!r} is not in its question_type mapping")
    answer, options = q["answer"].strip(), tuple(text_field(q, f"choice_{x}") for x in "abcd")
    if answer not in tuple(SEED_LETTERS):
        raise ValueError(f"answer {answer!r} is not one of A, B, C, D")
    question = text_field(q, "question")
    candidates = [os.path.join(folder, q["data_id"] + e) for e in ("", *IMAGE_EXTENSIONS)]
    image = next((p for p in candidates if os.path.isfile(p)), None)
    if image is None:
        raise FileNotFoundError(f"{dataset}: question {q['question_id']} in {path}: its image {q['data_id']!r} is "
                                f"not under {folder}")
    return Item(qid, image, question, options, answer, names[int(q["question_type_id"])])


def seed2_id(question_id):
    """An int id for a SEED-Bench-2 question_id "{dimension}_{k}": dimension x SEED2_MAX_K + k. Only the plain form
    is read (no sign, no leading zero, k below SEED2_MAX_K), so two ids never share a number."""
    parts = str(question_id).split("_") if isinstance(question_id, str) else ()
    if len(parts) != 2 or not all(p.isdigit() and p.isascii() and str(int(p)) == p for p in parts) or \
            int(parts[1]) >= SEED2_MAX_K:
        raise ValueError(f"question_id {question_id!r} is not of the form <dimension>_<k> (plain numbers, k below "
                         f"{SEED2_MAX_K:,})")
    return int(parts[0]) * SEED2_MAX_K + int(parts[1])


BENCHMARK_READERS = {"mme": read_mme, "seed": read_seed, "seed2": read_seed2}


# The share of each subtask's (dimension's) images in the training pool: MME's half (about 1,187 questions) holds
# the 1,000 training queries + 32 held out; SEED-Bench's 14,233 image questions need a fifth for that, so most of it
# stays for evaluation; SEED-Bench-2's single-image part as SEED-Bench-1.
POOL_FRACTION = {"mme": 0.5, "seed": 0.2, "seed2": 0.2}
SPLIT_SEED = 0


def pool_split(items, fraction, seed=SPLIT_SEED):
    """(training pool, evaluation part) of a benchmark without a training split: a seeded split by image. The images
    of each category (an image's first question's) are shuffled with (seed, category) and the first
    round(fraction x count) go to the pool, so every question of an image lands on the same side and each
    subtask / dimension is split in the same proportion. Item order is kept on both sides."""
    pool = set()
    for c, images in images_by_category(items).items():
        pool.update(random.Random(f"{seed}:{c}").sample(images, round(fraction * len(images))))
    return [it for it in items if it.image_path in pool], [it for it in items if it.image_path not in pool]


def images_by_category(items):
    """{category: its images}, in order of first appearance; an image's category is its first question's."""
    category, by_category = {}, {}
    for it in items:
        category.setdefault(it.image_path, it.category)
    for image, c in category.items():
        by_category.setdefault(c, []).append(image)
    return by_category


def largest_remainder(total, sizes):
    """Whole shares of `total` in proportion to sizes (Hamilton's method; ties go to the earlier size)."""
    exact = [total * k / sum(sizes) for k in sizes]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[:total - sum(shares)]:
        shares[i] += 1
    return shares


def stratified_subset(items, n, seed=0):
    """A seeded subset of about n questions of a benchmark, stratified by category, drawn by image (--n-eval). The
    m = round(n x images / questions) images (MME: n / 2) are shared among the categories (an image's first
    question's) in proportion to their images (largest remainders), and each category's images are drawn with
    (seed, category); every question of a drawn image is kept, so both questions of an MME image are, and its
    results file is one official calculation.py accepts. Item order is kept."""
    if n <= 0:
        raise ValueError(f"--n-eval must be at least 1, got {n}")
    if not items:
        return items
    by_category = {c: sorted(images) for c, images in sorted(images_by_category(items).items())}
    n_images = sum(len(images) for images in by_category.values())
    m = min(n_images, max(1, round(n * n_images / len(items))))
    shares = largest_remainder(m, [len(images) for images in by_category.values()])
    chosen = {image for (c, images), k in zip(by_category.items(), shares)
              for image in random.Random(f"n-eval:{seed}:{c}").sample(images, k)}
    return [it for it in items if it.image_path in chosen]


# ----------------------------------------------------------------- toy-icl: a world where demonstrations are needed
#
# Every question is the same uninformative "What is it?"; which attribute of the image is asked (the colour of its
# squares or of the background) is readable only from the demonstrations' image-answer pairs. One VQAv2
# dataset per attribute, task `toy-icl-<attribute>`, in ~/.cache/hyper-icl/toy-icl/<attribute> (or
# data_root/toy-icl/<attribute>). Images are 42 x 42, a 3 x 3 grid of 14-px cells: one vision patch per cell of
# the toy backbone (model.py), which is meta-trained on scenes of its own drawing, never on these files.

ICL_QUESTION = "What is it?"
ICL_COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 210, 30)}
ICL_BACKGROUNDS = {"white": (245, 245, 240), "grey": (128, 128, 128), "black": (20, 20, 20), "purple": (120, 40, 140)}
ICL_ATTRIBUTES = {"colour": tuple(ICL_COLOURS), "background": tuple(ICL_BACKGROUNDS)}
ICL_NAMED = {"colour": "What colour are the squares?", "background": "What colour is the background?"}
ICL_SIZES = {"train": 1100, "val": 300}  # images (= questions) per split and attribute
ICL_SIDE, ICL_CELL = 42, 14


def icl_scene(rng):
    """1-4 shapes of one kind and colour in distinct cells; each shape's margins (size, place) and the shade vary."""
    count = rng.randint(1, 4)
    return dict(colour=rng.choice(ICL_ATTRIBUTES["colour"]), background=rng.choice(ICL_ATTRIBUTES["background"]),
                count=str(count), cells=rng.sample(range(9), count),
                margins=[[rng.randint(1, 2) for _ in range(4)] for _ in range(count)],
                shade=[rng.randint(-15, 15) for _ in range(3)])


def icl_jpeg(scene):
    """The scene drawn on a light background and encoded as a JPEG (4:4:4, quality 95): the bytes of its file."""
    im = Image.new("RGB", (ICL_SIDE, ICL_SIDE), ICL_BACKGROUNDS[scene["background"]])
    draw = ImageDraw.Draw(im)
    fill = tuple(max(0, min(255, c + s)) for c, s in zip(ICL_COLOURS[scene["colour"]], scene["shade"]))
    for cell, (left, top, right, bottom) in zip(scene["cells"], scene["margins"]):
        x, y = cell % 3 * ICL_CELL, cell // 3 * ICL_CELL
        draw.rectangle((x + left, y + top, x + ICL_CELL - 1 - right, y + ICL_CELL - 1 - bottom), fill=fill)
    buffer = io.BytesIO()
    im.save(buffer, format="JPEG", quality=95, subsampling=0)
    return buffer.getvalue()


def icl_text_pieces(processor):
    """Every piece a meta-training episode is made of, as ids and labels: {(question, answer, last): piece}. A piece
    is `<image>Question: q Short answer: a<end>` (+ the separator unless `last`, the query), tokenised once (its ids
    do not depend on the image) exactly as PROMPTS writes evaluation prompts, labels on the answer + end token."""
    blank = Image.new("RGB", (ICL_SIDE, ICL_SIDE))
    ids = lambda text: encode_piece(processor, "idefics2", text, blank)["input_ids"]
    pieces = {}
    for attribute, answers in ICL_ATTRIBUTES.items():
        for question, answer, last in [(q, a, l) for q in (ICL_QUESTION, ICL_NAMED[attribute]) for a in answers
                                       for l in (False, True)]:
            prompt = prompt_text("vqa", Item(0, "", question, (answer,), answer))
            with_answer = prompt + answer_text(processor, "idefics2", "vqa", answer)
            p, a = ids(prompt), ids(with_answer)
            full = a if last else ids(with_answer + SEPARATOR)
            if a[:len(p)] != p or full[:len(a)] != a:
                raise ValueError(f"the answer {answer!r} does not tokenise as a continuation of its prompt")
            pieces[question, answer, last] = {"input_ids": full, "labels": [-100] * len(p) + a[len(p):] +
                                              [-100] * (len(full) - len(a))}
    return pieces


def icl_episode(processor, pieces):
    """A meta-training row: BOS, the instruction, then the pieces (ICDs, the query last; each with its "images"),
    labels on every answer, so one row trains every number of demonstrations up to its own."""
    start = encode_prefix(processor, "idefics2", "vqa", [])["input_ids"]
    return {"input_ids": start + [i for p in pieces for i in p["input_ids"]],
            "labels": [-100] * len(start) + [i for p in pieces for i in p["labels"]],
            "images": [p["images"] for p in pieces], "query_len": len(pieces[-1]["input_ids"])}


def write_toy_icl(root, attribute):
    """Write the toy-icl-<attribute> dataset under `root` in the official VQAv2 + COCO formats."""
    rng = random.Random(f"toy-icl:{attribute}")  # str seeds hash with sha512: the same in every process
    for split, n_images in ICL_SIZES.items():
        os.makedirs(os.path.join(root, "coco", f"{split}2014"))
        questions, annotations = [], []
        for i in range(n_images):
            image_id, scene = (i + 1 if split == "train" else 100_000 + i), icl_scene(rng)
            with open(coco_image(root, split, image_id), "wb") as f:
                f.write(icl_jpeg(scene))
            add_vqa(questions, annotations, image_id, ICL_QUESTION, [scene[attribute]] * 10, "other")
        write_vqa(root, split, f"hyper-icl toy-icl-{attribute}", questions, annotations)


def write_vqa(root, split, description, questions, annotations):
    """A split's VQAv2 questions and annotations files under `root`, as the official ones are laid out."""
    _, qfile, afile = VQA_FILES["vqav2"]
    header = {"info": {"description": description}, "license": {}, "data_type": "mscoco",
              "data_subtype": f"{split}2014"}
    write_json(os.path.join(root, "vqav2", qfile.format(split)),
               {**header, "task_type": "Open-Ended", "questions": questions})
    write_json(os.path.join(root, "vqav2", afile.format(split)), {**header, "annotations": annotations})


def add_vqa(questions, annotations, image_id, question, answers, answer_type):
    """Append a VQAv2 question about a toy image and its annotation (the ten answers; the question type its first
    two words, the multiple-choice answer the most frequent)."""
    qid = image_id * 1000
    questions.append({"image_id": image_id, "question": question, "question_id": qid})
    annotations.append({"question_id": qid, "image_id": image_id,
                        "question_type": " ".join(question.split()[:2]).lower(), "answer_type": answer_type,
                        "multiple_choice_answer": most_frequent(answers),
                        "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": k + 1}
                                    for k, a in enumerate(answers)]})


def toy_icl_root(attribute, data_root=None):
    """The data_root of toy-icl-<attribute>: data_root/toy-icl/<attribute>, or ~/.cache/hyper-icl/toy-icl/<attribute>
    (generated on first use)."""
    folder = os.path.join(data_root or os.path.expanduser("~/.cache/hyper-icl"), "toy-icl", attribute)
    return generated(folder, lambda tmp: write_toy_icl(tmp, attribute))


def generated(root, write):
    """`root`, written by write(folder) first if it is not there: into a temporary folder beside it, then renamed
    into place, so an interrupted generation never leaves a half-written dataset; if another process finished first,
    its copy is kept."""
    if os.path.isdir(root):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    remove_stale_tmp(os.path.dirname(root))
    tmp = tmp_name(root)
    os.mkdir(tmp, 0o700)
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # private while written
        os.rename(tmp, root)
    except OSError:
        if not os.path.isdir(root):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def discard(folder):
    """Remove a folder the project wrote, at once for its readers: renamed to a temporary name first (then removed;
    a kill leaves only that name, which remove_stale_tmp removes). No folder there: nothing to do."""
    if not os.path.isdir(folder) or os.path.islink(folder):  # a link is not this project's folder (replaced says so)
        return
    gone = tmp_name(folder)
    try:
        os.rename(folder, gone)
    except OSError as e:
        raise OSError(f"could not remove the old {folder} ({e.strerror or e})") from e
    shutil.rmtree(gone, ignore_errors=True)


def replaced(root, write):
    """Write the folder `root` whole or not at all: write(folder) fills a temporary folder beside it, which then takes
    its place (the old folder renamed to a temporary name first and removed after), so a kill leaves the old folder
    whole, none, or the new one whole, never a mix; leftovers are temporary names (remove_stale_tmp). A failed write
    is an OSError naming `root`."""
    parent = os.path.dirname(os.path.abspath(root))
    tmp = old = None
    try:
        os.makedirs(parent, exist_ok=True)
        remove_stale_tmp(parent)
        tmp = tmp_name(root)
        os.mkdir(tmp)
        write(tmp)
        if os.path.lexists(root):
            if not os.path.isdir(root) or os.path.islink(root):  # not a folder this project wrote
                raise FileExistsError(f"{root} is there and is not a folder; move it away")
            old = tmp_name(root)
            os.rename(root, old)
        try:
            os.rename(tmp, root)
        except OSError:
            if old:  # put the previous folder back
                os.rename(old, root)
                old = None
            raise
    except OSError as e:
        raise OSError(f"could not write the folder {root} ({e.strerror or e}); the previous one, if any, is "
                      "unchanged") from e
    finally:
        for leftover in (tmp, old):
            if leftover and os.path.lexists(leftover):
                shutil.rmtree(leftover) if os.path.isdir(leftover) and not os.path.islink(leftover) else \
                    os.remove(leftover)
    return root


# -------------------------------------------------------------------------- files: atomic writes and checked caches
# The writes every script makes (model.py and evaluate.py use them too), their leftovers cleaned up.

def atomic_write(path, write, durable=True):
    """Call write(f) on a new binary file beside `path`, then rename it over `path`: readers see the old file or the
    new one, never half of one; the new file follows the umask. durable: flushed to the disk (fsync) before the
    rename, so that even a power loss leaves the old file or the new one (checkpoints, adapters, results); caches
    pass False (a crash of the machine, not of the process, may then leave a renamed file whose bytes did not reach
    the disk, which read_cache refuses). A failed write, a full disk included, is an OSError naming `path`, which
    stays as it was. What killed writes left in the folder is removed first (remove_stale_tmp)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"could not create the folder {folder} for {path} ({e.strerror or e})") from e
    remove_stale_tmp(folder)
    tmp = tmp_name(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"could not write {path} ({e.strerror or e}); the previous file, if any, is unchanged") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj, indent=None):
    """Write obj as JSON to path atomically (atomic_write), creating its folder."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=indent).encode()))


STALE_TMP_S = 15 * 60  # a temporary file of another machine untouched this long has no live writer
TMP_MARK = "hyper-icl-tmp"
# Only names of this form are ever removed: .<name>.hyper-icl-tmp-<host>-<pid>-<12 hex>.tmp, never a user's file
TMP_NAME = re.compile(r"^\..*\." + TMP_MARK + r"-(?P<host>[A-Za-z0-9]{1,32})-(?P<pid>[0-9]{1,10})-[0-9a-f]{12}\.tmp$")


def this_host():
    """The host name as it goes into a temporary name: letters and digits only, at most 32."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def tmp_name(path, pid=None):
    """A new temporary name beside `path` that only this project makes: it names the writing host and process."""
    folder, base = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{base[:120]}.{TMP_MARK}-{this_host()}-{pid or os.getpid()}-"
                                f"{secrets.token_hex(6)}.tmp")


def is_stale_tmp(path):
    """Whether `path` is a temporary file or folder of a write that is over: a name tmp_name made whose process is
    gone (on this machine), or, from another machine, untouched for STALE_TMP_S. Any other name is never stale."""
    m = TMP_NAME.match(os.path.basename(path))
    if m is None:
        return False
    if m["host"] == this_host():
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            return True  # its process is gone
        except OSError:
            pass  # it exists, owned by someone else
        return False
    return time.time() - os.path.getmtime(path) > STALE_TMP_S


def remove_stale_tmp(folder):
    """Delete what killed writes left in `folder` (is_stale_tmp): atomic_write's files, `generated`'s folders.
    Nothing else is touched, whatever its name or age."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if is_stale_tmp(path):
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except FileNotFoundError:
            pass  # another process removed it first


def weights_digest(tensors):
    """sha256 of a state dict's names, shapes, dtypes and bytes (in name order): a cached file's checksum."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def bytes_checksum(tensors):
    """A cheap checksum of a state dict (in name order): each tensor's name, shape, dtype and the wrapping int64 sum of
    its bytes read as 8-byte words (its last bytes alone): any changed word, a zeroed tail, a truncation changes it.
    It costs a fraction of reading the bytes (sha256 cost more than the read itself); it guards against damage, not
    against someone forging a file."""
    parts = []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8
        total = int(raw[:whole].view(torch.int64).sum()) + int(raw[whole:].sum()) if raw.numel() else 0
        parts.append(f"{name}{tuple(t.shape)}{t.dtype}:{total % 2 ** 64:x}")
    return ";".join(parts)


def write_cache(path, tensors, key):
    """Write tensors to a cache file atomically, with their settings key and bytes_checksum in the metadata; not
    flushed to the disk (a cache is recomputed when a crash damaged it: read_cache)."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"key": key, "checksum": bytes_checksum(tensors)}
    atomic_write(path, lambda f: f.write(save(tensors, metadata=meta)), durable=False)


def read_cache(path, key, shapes):
    """The tensors of a cache file written by write_cache, or None when there is none or it is unusable: unreadable
    (truncated, foreign), other tensors, shapes or dtypes than `shapes` ({name: (shape, dtype)}; a dimension or dtype
    None may be any), another settings key or bytes that do not match its checksum (reported in one line). A read
    costs about what reading the file's bytes costs (README)."""
    if not os.path.exists(path):
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
    except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
        return cache_warning(path, f"unreadable: {str(e)[:80]}")
    if set(tensors) != set(shapes):
        return cache_warning(path, f"holds {sorted(tensors)}, expected {sorted(shapes)}")
    for name, (shape, dtype) in shapes.items():
        t = tensors[name]
        if len(t.shape) != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)) or \
                dtype is not None and t.dtype != dtype:
            return cache_warning(path, f"{name} is {tuple(t.shape)} {t.dtype}, expected "
                                       f"{tuple('*' if s is None else s for s in shape)} {dtype or ''}".rstrip())
    if meta.get("key") != key:
        return cache_warning(path, "it was written for other settings")
    if meta.get("checksum") != bytes_checksum(tensors):
        return cache_warning(path, "its bytes do not match their checksum")
    return tensors


def cache_warning(path, why):
    """Report an unusable cache file in one line; returns None (read_cache's answer for it)."""
    tqdm.write(f"warning: cache file {path} is unusable ({why}); computing it again")
    return None
