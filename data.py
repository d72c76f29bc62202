"""Data: the items, their prompts, what the teacher and the student read, and the demonstrations.

Items. Each question (VQA, MME, SEED-Bench) or image (captions) is one `Item`: VQA `answers` are the ten human
answers and the target VQAv2's `multiple_choice_answer` (OK-VQA: the most frequent answer); captions have no
question, all references as answers and the first as target; MME the answer Yes or No, SEED-Bench the four options
and the answer's letter, `category` the subtask / dimension.

Prompts (PROMPTS): an instruction line, then each in-context demonstration (ICD) as
`<image>Question: {q} Short answer: {a}<end>` and a newline, then the query as `<image>Question: {q} Short answer:`.
`<end>`, which closes every answer and is part of the training label, is the family's end token: Idefics2's
`<end_of_utterance>`, Idefics' eos `</s>` (a base model pretrained on web documents, not dialogues), the LLaVA models'
eos (plain interleaved text, no chat turns). `<image>` becomes the family's placeholder, which its processor expands.
What a family needs beyond its processor is one record, lab/models/families.py:Rows, carried as
`processor.row_format`; LLaVA-OneVision's multi-image mode and Idefics' cross-attention keep a few lines of their own.

Batches (Section 3). A row is [start, instruction, ICD_1 .. ICD_m, query + target]: the teacher's has m ICDs, the
student's none. Each piece is tokenised once, with its image, by the family's own processor, and rows are
concatenations of those ids, so the query's ids are identical in teacher and student; rows are left-padded, so the
query + target (T tokens) are the last T positions of both (`query_target`). LLaVA-OneVision encodes every image in its
multi-image mode (`onevision_piece`), so the query image gets the same tokens with and without ICDs.

The readers of the official formats (lab/datasets/readers.py, mme_seed.py: the layout of --data-root and their checks
are in docs/real-models.md, "Data layout") and the toy-icl datasets (lab/datasets/toy_world.py) make the Items."""
import hashlib
import os
import random
from dataclasses import dataclass

import numpy
import torch
from PIL import Image
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
    kind: str            # "vqa", "caption", "yes-no" (MME) or "choice" (SEED-Bench): the PROMPTS entry
    max_new_tokens: int  # generation length at evaluation
    shots: int | None = None  # ICDs per query where the paper fixes them for the task, else DEFAULT_SHOTS


TASKS = {
    "vqav2": Task("vqa", 5), "ok-vqa": Task("vqa", 5), "coco": Task("caption", 20), "flickr30k": Task("caption", 20),
    "mme": Task("yes-no", 5, shots=2), "seed": Task("choice", 5, shots=2),  # the paper's 2-shot ICL (Table 2)
    "seed2": Task("choice", 5, shots=2),  # SEED-Bench-2's single image
    "toy-icl-colour": Task("vqa", 3), "toy-icl-background": Task("vqa", 3),
}
SPLITS = ("train", "val")
DEFAULT_SHOTS = {"idefics2": 8, "idefics": 32, "llava-interleave": 8, "llava-onevision": 8, **dict.fromkeys(  # paper
    ["qwen2.5-vl", "qwen3-vl", "internvl3", "gemma3", "idefics3", "smolvlm", "llava-onevision-1.5"], 8)}  # as 7-8B


def default_shots(task, family):
    """ICDs per query of a Task (TASKS' entry): its own (MME, SEED: 2, as the paper runs them), else the backbone's."""
    return task.shots if task.shots is not None else DEFAULT_SHOTS[family]


# ---------------------------------------------------------------------------------------------------------- prompts

PROMPTS = {  # task kind -> the instruction line, the query (an ICD without its answer), the answer
    "vqa": dict(instruction="Answer each question about its image with a short answer.\n",
                query="<image>Question: {question} Short answer:", answer=" {answer}"),
    "caption": dict(instruction="Describe each image in one sentence.\n", query="<image>Caption:", answer=" {answer}"),
    "yes-no": dict(instruction="Answer each question about its image with yes or no.\n",  # MME
                   query="<image>Question: {question} Answer:", answer=" {answer}"),
    "choice": dict(instruction="Answer each question about its image with the letter of the correct option.\n",
                   query="<image>Question: {question}{options}\nAnswer:", answer=" {answer}"),  # SEED, letter
    # SEED's likelihood protocol (evaluate.option_logliks): SEED-Bench's official prompt "Question: {question}\nAnswer:"
    # (its model/instruct_blip_interface.py), no instruction line and no options; an answer is an option's text.
    "choice-likelihood": dict(instruction="", query="<image>Question: {question}\nAnswer:", answer=" {answer}"),
}
SEPARATOR = "\n"  # after each ICD
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # PIL's formats opened: never EPS (it runs Ghostscript)
MIN_IMAGE_SIDE, MAX_ASPECT = 2, 200  # pixels, and sides' ratio: Idefics2's splitting halves each; Qwen's refuses 200:1
SEED_LETTERS = "ABCD"  # SEED-Bench's options, in order


def end_token(processor, family):
    """The token that closes an answer: the family's (row_format.end: Idefics2's <end_of_utterance>), else eos."""
    return processor.row_format.end or processor.tokenizer.eos_token


def prompt_text(kind, item):
    """The query text of an item, its image placeholder first (for "choice", the options after the question, one line
    each: "\nA. {choice_a}\nB. {choice_b}...")."""
    if "{question}" in PROMPTS[kind]["query"] and (not isinstance(item.question, str) or not item.question.strip()):
        raise ValueError(f"item {item.id}: its question is {item.question!r}; a {kind} task asks one (text)")
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
    {"input_ids": list[int], "images": {name: one entry an image}}; `pixels` (image_pixels) reused where the caller
    has them. Idefics (cross-attention): its processor's pixel_values [1, 3, H, W] (float); the others: image_pixels."""
    if processor.row_format.images == "cross-attention":  # list format; the processor starts with BOS, the row's own
        out = processor(text=[image, text.removeprefix("<image>")], return_tensors="pt")
        return {"input_ids": out["input_ids"][0, 1:].tolist(), "images": {"pixel_values": out["pixel_values"][0]}}
    pixels = pixels or image_pixels(processor, family, image)
    return {"input_ids": piece_ids(processor, family, text, pixels), "images": pixels}


def piece_ids(processor, family, text, pixels):
    """The ids of a piece's text, its `<image>` the family's placeholder, expanded into the tokens its processor gives
    the image: replace_image_token of the processed image (LLaVA-Interleave: a token a patch; Qwen: merged patches),
    LLaVA-OneVision's base view (onevision_tokens), or the processor's call on the text (expand "text": Idefics2)."""
    form = processor.row_format
    text = text.replace("<image>", form.placeholder, 1)
    if form.expand == "text":
        return processor(text=text, add_special_tokens=False)["input_ids"][0]
    one = processor.image_token * onevision_tokens(processor) if form.images == "multi-image" else \
        processor.replace_image_token(pixels, 0)
    return processor.tokenizer(text.replace(processor.image_token, one, 1), add_special_tokens=False)["input_ids"]


def image_pixels(processor, family, image):
    """One image through the family's image processor with the processor's own settings (images_kwargs): a raw
    family's stopped before rescaling and normalisation (model_inputs does those on the device), uint8 (Idefics2: its
    crops [3, h, w], each its own size; LLaVA-Interleave [1, 3, 384, 384]; LLaVA-OneVision: onevision_piece); another's
    whole output, float32 (Qwen: flattened patches and image_grid_thw; InternVL: tiles; Idefics3: crops, rows, cols)."""
    form, process = processor.row_format, processor.image_processor
    if form.images == "multi-image":
        return onevision_piece(process, image)
    canvas = form.images == "canvas"  # a row's crops go on one canvas (collate), so none is padded here
    settings = {**getattr(processor, "images_kwargs", {}), **({"do_pad": False} if canvas else {})}
    if form.raw:
        out = process([[image]] if canvas else [image], do_rescale=False, do_normalize=False, **settings)
        crops = [chw(c) for c in (out["pixel_values"][0] if canvas else out["pixel_values"])]
        return {"pixel_values": crops if canvas else torch.stack(crops)}
    out = dict(process([[image]] if canvas else [image], return_tensors="pt", **settings))
    return {**out, "pixel_values": list(out["pixel_values"][0])} if canvas else out


def chw(array):
    """A processor's [3, h, w] uint8 array (a view of PIL's h x w x 3 pixels) as a contiguous tensor, transposed by
    numpy on one thread: torch splits such a copy over its threads, slower on a busy CPU (docs/efficiency.md)."""
    return torch.from_numpy(numpy.ascontiguousarray(array))


def onevision_tokens(processor):
    """The tokens of one LLaVA-OneVision image in multi-image mode: its base view and a newline (less CLS under the
    "default" feature strategy)."""
    return processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")


def onevision_piece(process, image):
    """A LLaVA-OneVision image as one of several, the model's multi-image mode: its base 384 x 384 view,
    num_image_tokens + 1 (newline) = 730 tokens (alone in a prompt, anyres tiles it: 2,929 tokens for 640 x 480). A
    teacher row holds several images, so the student's lone query image must be in that mode too, or the query's tokens
    would differ between the rows (Eq 16 compares them token by token): every image, in training and evaluation
    (`image_inputs` tells the model), padded to a square of the mean colour and resized, as the image processor does
    for an image among several. Returns image_pixels' dict: pixel_values uint8 [1, 3, H, W], "image_sizes" [1, 2]."""
    pixels = process.process_image(image, do_convert_rgb=True)
    square = process.pad_to_square(pixels, tuple(int(x * 255) for x in process.image_mean))
    view = process.resize(square, process.size, resample=process.resample)
    return {"pixel_values": chw(view)[None], "image_sizes": torch.tensor([pixels.shape[-2:]])}


def load_image(item):
    """The item's image, RGB, of IMAGE_FORMATS, sides MIN_IMAGE_SIDE or more, MAX_ASPECT:1 at most; errors name it."""
    if not isinstance(item.image_path, (str, os.PathLike)):
        raise ValueError(f"item {item.id}: its image_path is {item.image_path!r}; every item needs an image file")
    if os.path.exists(item.image_path) and not os.path.isfile(item.image_path):
        raise OSError(f"item {item.id}: its image {item.image_path} is not a regular file (a folder, FIFO or device)")
    try:
        with Image.open(item.image_path, formats=IMAGE_FORMATS) as im:  # EPS and the rest refused: no program runs
            if not (min(im.size) >= MIN_IMAGE_SIDE and max(im.size) <= MAX_ASPECT * min(im.size)):
                raise OSError(f"{im.width} x {im.height} pixels; each side must be at least {MIN_IMAGE_SIDE} and at "
                              f"most {MAX_ASPECT} times the other")
            return im.convert("RGB")
    except (OSError, Image.DecompressionBombError) as e:  # not of IMAGE_FORMATS, too small, over PIL's limit, broken
        raise OSError(f"item {item.id}: cannot read its image {item.image_path} as {'/'.join(IMAGE_FORMATS)} ({e})")


def encode_query(processor, family, kind, query, with_target=True):
    """The query piece, built once and shared by the query's teacher and student rows: ids, images, labels (-100 on
    the prompt, the ids on the answer + end token; the model shifts them), the answer's ids read off the whole piece's
    tokens (what the model would generate), the image processed once for both (Idefics': its processor takes both)."""
    image, prompt = load_image(query), prompt_text(kind, query)
    piece = encode_piece(processor, family, prompt, image)
    ids = piece["input_ids"]
    if with_target:
        reuse = processor.row_format.images != "cross-attention"  # Idefics: its processor takes both
        piece = encode_piece(processor, family, prompt + answer_text(processor, family, kind, query.target), image,
                             piece["images"] if reuse else None)
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
    """The image tensors of a batch as the family's forward takes them (images in row order, row_format.images):
    "concat" along dim 0 (LLaVA-Interleave [images, 3, H, W]; Qwen's patches and grids); "canvas" (crop_canvas);
    LLaVA-OneVision's multi-image mode; Idefics' [B, images, 3, H, W] and which image each token cross-attends to.
    Raw pixels stay uint8, with "pixel_norm" for model_inputs."""
    form = processor.row_format
    per_row = lambda: [[x for p in r["images"] for x in p["pixel_values"]] for r in rows]  # each row's crops
    if form.images == "cross-attention":
        pixel_values = pad_stack([pad_stack(v) for v in per_row()])
        latest, _ = image_attention_mask_for_packed_input_ids(input_ids, processor.tokenizer, "pt")
        mask = incremental_to_binary_attention_mask(latest, "pt", num_classes=pixel_values.shape[1])
        return {"pixel_values": pixel_values, "image_attention_mask": mask}
    norm = {"pixel_norm": pixel_norm(processor.image_processor)} if form.raw else {}
    if form.images == "canvas":  # [B, crops, 3, H, W] and its mask; padding crops are all zero (once normalised)
        return {**crop_canvas(per_row()), **norm}
    images = [p for r in rows for p in r["images"]]
    out = {k: torch.cat([p[k] for p in images]) for k in form.inputs}
    if form.images == "multi-image":  # it tiles exactly the images of one-image samples; none here (onevision_piece),
        out["pixel_values"] = out["pixel_values"][:, None]  # [images, 1 view, 3, H, W]
        out["image_sizes"] = torch.cat([p["image_sizes"] for p in images])
        out["batch_num_images"] = torch.tensor([max(len(out["image_sizes"]), 2)])  # so: one sample of several
    return {**out, **norm}


def crop_canvas(per_row):
    """A canvas family's crops of each row, [3, h, w] of any size (uint8 raw, or float32), laid top-left on one zero
    canvas [B, crops, 3, H, W] (the batch's largest), with pixel_attention_mask bool [B, crops, H, W] on real pixels."""
    n, (h, w) = max(map(len, per_row)), (max(x.shape[k] for v in per_row for x in v) for k in (1, 2))
    pixels = torch.zeros(len(per_row), n, 3, h, w, dtype=per_row[0][0].dtype)
    mask = torch.zeros(len(per_row), n, h, w, dtype=torch.bool)
    for b, crops in enumerate(per_row):
        for k, x in enumerate(crops):
            pixels[b, k, :, :x.shape[1], :x.shape[2]] = x
            mask[b, k, :x.shape[1], :x.shape[2]] = True
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def pixel_norm(process):
    """[3, 3] float32, per channel (divisor, mean, std): an image processor's rescaling and normalisation, as
    (x / divisor - mean) / std in float32. With transformers' rescale by 1/255 (in float64, then rounded to float32),
    x / 255 in float32 is the same number for every uint8 x: the processor's pixels to the bit (tests/test_data.py)."""
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


def collate(rows, processor, family):
    """Left-pad rows into a batch: input_ids, attention_mask, position_ids (0 on padding), labels (-100 but on the
    answer + end token), query_target (each row's last query_len positions: the query + target, which teacher and
    student share) and the images. A row longer than the tokenizer's model_max_length is an error naming its item."""
    for r in rows:
        if len(r["input_ids"]) > processor.tokenizer.model_max_length:
            raise ValueError(f"item {r['id']}: its prompt has {len(r['input_ids'])} tokens, more than the model's "
                             f"{processor.tokenizer.model_max_length} positions; shorten its question (or use fewer "
                             "demonstrations)")
    width, pad = max(len(r["input_ids"]) for r in rows), processor.tokenizer.pad_token_id
    left_pad = lambda seq, fill: [fill] * (width - len(seq)) + list(seq)  # seq preceded by `fill` up to `width`
    input_ids = torch.tensor([left_pad(r["input_ids"], pad) for r in rows])
    attention_mask = torch.tensor([left_pad([1] * len(r["input_ids"]), 0) for r in rows])
    query_target = torch.tensor([left_pad([True] * r["query_len"], False) for r in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask, **positions(processor, input_ids, attention_mask),
            "labels": torch.tensor([left_pad(r["labels"], -100) for r in rows]), "query_target": query_target,
            **image_inputs(rows, processor, family, input_ids)}


def align_teacher(states, query_target):
    """Eq 16's alignment: per-query teacher states [L, T_q, d] laid at their student rows' query_target, [L, B, W, d]
    (0 elsewhere). collate pads on the left, so they are each row's last T_q positions: sliced, no wait for a device."""
    out = states[0].new_zeros(states[0].shape[0], *query_target.shape, states[0].shape[-1], device=query_target.device)
    for b, s in enumerate(states):
        out[:, b, query_target.shape[1] - s.shape[1]:] = s.to(query_target.device)
    return out


def positions(processor, input_ids, attention_mask):
    """A batch's positions (row_format.positions): "1-d", position_ids = cumsum - 1 over the real tokens (0 on
    padding); "model", none (M-RoPE: the model makes them from the ids, token types, image grids and attention mask).
    And the forward's per-token tensor (row_format.token_types): 1 on image tokens, 0 on padding."""
    form, out = processor.row_format, {}
    if form.positions == "1-d":
        out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if form.token_types:
        out[form.token_types] = torch.tensor(processor.create_mm_token_type_ids(input_ids)) * attention_mask
    return out


def answer_window(labels):
    """K: the last K positions of each left-padded row hold its target tokens and the position before each, so a
    forward with logits_to_keep=K runs the LM head there only, not over every position x the whole vocabulary (152k
    for the Qwen models: gigabytes a row). Logits then line up with labels[:, -K:]."""
    return int((labels != -100).sum(1).max()) + 1


def model_inputs(batch, device=None):
    """A batch as the backbone's forward keyword arguments (all but "labels" and "query_target"), on `device` (copied
    without waiting: the batch is pinned on CUDA), its pixels normalised there (normalised)."""
    return normalised({k: v.to(device, non_blocking=True) for k, v in batch.items()
                       if k not in ("labels", "query_target", "window")})


# --------------------------------------------------------------------------------- demonstrations: random, or RICES

def demonstrations(query_ids, support, m, seed):
    """m ICDs per query, drawn at random from the support set, never the query itself (same id). A query's draw depends
    only on (seed, query id, support set), not on the other queries or their order: its teacher run is reproducible."""
    if len(support) <= m:
        raise ValueError(f"a support set of {len(support)} items is too small for {m} ICDs per query (need {m + 1}; "
                         "--shots sets the ICDs)")
    icds = []
    for qid in query_ids:  # a 64-bit seed per query from hashlib: the same in every Python process
        query_seed = int.from_bytes(hashlib.sha256(f"{seed}:{qid}".encode()).digest()[:8], "little")
        picks = random.Random(query_seed).sample(range(len(support)), m + 1)  # one spare for the query
        icds.append([support[i] for i in picks if support[i].id != qid][:m])
    return icds

