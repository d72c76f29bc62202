"""Data: the items, their prompts, what the teacher and the student read, and the demonstrations.

Items. One `Item` per question (VQA, MME, SEED-Bench) or image (captions); its fields say what each task keeps.
Prompts (PROMPTS): an instruction line, then each in-context demonstration (ICD) as
`<image>Question: {q} Short answer: {a}<end>` and a newline, then the query as `<image>Question: {q} Short answer:`.
`<end>`, part of the training label, is the family's end token (Idefics2's `<end_of_utterance>`, else eos: plain
interleaved text, no chat turns); `<image>` the family's placeholder, which its processor expands. A family's record
(lab/models/families.py) rides on its processor: `processor.row_format` (its Rows) and `processor.image_layout`
(lab/models/image_layouts.py), which makes a piece's image tokens and pixels and lays a batch's images out.

Batches (Section 3). A row is [start, instruction, ICD_1 .. ICD_m, query + target]: the teacher's has m ICDs, the
student's none. Each piece is tokenised once, with its image, and rows are concatenations of those ids, so the query's
ids are identical in teacher and student; rows are left-padded, so the query + target (T tokens) are the last T
positions of both (`query_target`). The readers of the official formats and the toy world (lab/datasets/) make the
Items."""
import hashlib
import os
import random
from dataclasses import dataclass

import torch
from PIL import Image


# -------------------------------------------------------------------------------------------------- items and tasks

@dataclass(frozen=True)
class Item:
    """One query: a question about an image (VQA) or an image to caption (question None)."""
    id: int                  # VQA question_id; COCO cocoid; Flickr30k Karpathy imgid
    image_path: str
    question: str | None
    answers: tuple[str, ...]  # the ten human answers (VQA), all reference captions, SEED-Bench's four options
    target: str              # VQAv2's multiple_choice_answer, OK-VQA's most frequent, the first caption, Yes/No, A-D
    category: str = ""       # MME subtask / SEED-Bench dimension


@dataclass(frozen=True)
class Task:
    kind: str            # "vqa", "caption", "yes-no" (MME) or "choice" (SEED-Bench): the PROMPTS entry
    max_new_tokens: int  # generation length at evaluation
    shots: int | None = None  # ICDs per query where the paper fixes them for the task, else the backbone's


TASKS = {
    "vqav2": Task("vqa", 5), "ok-vqa": Task("vqa", 5), "coco": Task("caption", 20), "flickr30k": Task("caption", 20),
    "mme": Task("yes-no", 5, shots=2), "seed": Task("choice", 5, shots=2),  # the paper's 2-shot ICL (Table 2)
    "seed2": Task("choice", 5, shots=2),  # SEED-Bench-2's single image
    "toy-icl-colour": Task("vqa", 3), "toy-icl-background": Task("vqa", 3),
}
SPLITS = ("train", "val")
SHOTS, SHOTS_ON_EVERY_TASK = {}, set()  # each family's ICDs a query, and those whose hold on MME and SEED too:
# their records' default_shots and shots_on_every_task (lab/models/families.py:register)


def default_shots(task, family):
    """ICDs per query, as the paper runs them: the Task's own (MME, SEED: 2 on Idefics2-8B-base) unless its family's
    hold on every task (SHOTS_ON_EVERY_TASK: Idefics-9b), else the family's (SHOTS: Idefics 32, the others 8)."""
    if task.shots is not None and family not in SHOTS_ON_EVERY_TASK:
        return task.shots
    if family not in SHOTS:
        raise ValueError(f"backbone family {family!r} has no default shots; register its record "
                         "(lab/models/families.py:register) or pass --shots")
    return SHOTS[family]


# ---------------------------------------------------------------------------------------------------------- prompts

PROMPTS = {  # task kind -> the instruction line, the query (an ICD without its answer), the answer
    "vqa": dict(instruction="Answer each question about its image with a short answer.\n",
                query="<image>Question: {question} Short answer:", answer=" {answer}"),
    "caption": dict(instruction="Describe each image in one sentence.\n", query="<image>Caption:", answer=" {answer}"),
    "yes-no": dict(instruction="Answer each question about its image with yes or no.\n",  # MME
                   query="<image>Question: {question} Answer:", answer=" {answer}"),
    "choice": dict(instruction="Answer each question about its image with the letter of the correct option.\n",
                   query="<image>Question: {question}{options}\nAnswer:", answer=" {answer}"),  # SEED, letter
    # SEED's likelihood protocol (lab/scores/seed_likelihood.py): SEED-Bench's official prompt "Question: {question}
    # \nAnswer:" (its model/instruct_blip_interface.py), no instruction line and no options; an answer an option's text.
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
    """Token ids and images of one piece of a row (text starting with `<image>`), by the family's processor and image
    layout (processor.image_layout, lab/models/image_layouts.py): {"input_ids": list[int], "images": {name: one entry
    an image}}; `pixels` (the layout's) reused where the caller has them."""
    return processor.image_layout.piece(processor, family, text, image, pixels)


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
        piece = encode_piece(processor, family, prompt + answer_text(processor, family, kind, query.target), image,
                             piece["images"] if processor.image_layout.reuses_pixels else None)
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


def normalised(batch):
    """The batch with uint8 pixel_values normalised (lab/models/image_layouts.py:pixel_norm), float32, zero outside
    pixel_attention_mask (Idefics2's padding, as its processor pads); a batch without pixel_norm as it is. Wherever the
    batch lives: on the device."""
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
    per_token = processor.row_format.token_inputs(processor, input_ids, attention_mask)  # positions (0 on padding)
    return {"input_ids": input_ids, "attention_mask": attention_mask, **per_token,
            "labels": torch.tensor([left_pad(r["labels"], -100) for r in rows]), "query_target": query_target,
            **processor.image_layout.batch(rows, processor, input_ids)}


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

