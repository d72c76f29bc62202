"""Training: distil what a frozen teacher does with demonstrations into an adapter the student runs without them.

Hyper-ICL (Eq 16-17): the teacher (backbone, no adapter, no gradient) reads [ICDs; query + target]; the student
(backbone + adapter) reads [query + target]; loss = L_H-anchor over every decoder layer's own output
(model.layer_outputs) at the query's tokens + lambda * cross-entropy on the target. HiFICL: cross-entropy only,
no teacher.

The teacher's states depend only on the query and its (fixed) ICDs, so they are computed once, in the first
epoch, and read back from a cache in later ones; the cache key covers the backbone's weights, the task, the
query, its ICDs and the prompt format, so a change of any of them recomputes. Nothing is lost on interruption:
`<out>/last.pt` (adapter, optimiser, schedule, step) is written atomically every epoch, every --save-every steps
and on Ctrl-C or SIGTERM, and --resume continues bit-for-bit (an epoch stopped while it was being scored is scored
on resume); `<out>/adapter.safetensors` is the best epoch's adapter. A folder that holds a run is never trained into
without --resume or --overwrite, and one process at a time holds a folder (`locked`).

    python train.py                                   # the default: toy-idefics2 on toy-icl-colour, CPU
    python train.py --model idefics2 --task vqav2 --data-root /data
    python train.py --build-toy                       # meta-train a toy-idefics2 of your own (probed, ~5 min)
"""
import argparse
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save
from PIL import Image
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

import data
import lorentz
import model as M
from model import fingerprint
from lorentz import euclidean_anchor_loss, hyperbolic_anchor_loss


# The paper's settings (Section 4.1), the defaults of train.py's flags; --help lists every other flag.
PAPER = dict(n_train=1000,   # training queries
             lr=5e-3,        # AdamW, every method
             warmup=0.1,     # fraction of the steps of linear warm-up, then cosine decay to 0
             kappa=0.1,      # curvature magnitude of the Lorentz model (Eq 10)
             lam=0.5,        # lambda: weight of the cross-entropy beside the anchor (Eq 17)
             rank=4)         # r of U_q, U_k (Eq 6); HiFICL: n = 8 virtual pairs of rank 8 (DEFAULT_RANK)
DEFAULT_RANK = {"hificl": 8, "lora": 16}  # LoRA: rank 16, MimIC's public setting


# Each method's own loss (the rest distil with Eq 16): HiFICL and LoRA the task loss only, MimIC its layer-wise
# MSE, LIVE its KL at the answer positions.
DEFAULT_ANCHOR = {"hificl": "none", "lora": "none", "mimic": "mse", "live": "kl"}


def method_sizes(args):
    """The sizes of args.method for model.attach: none for MimIC and LIVE; the rank, and HiFICL's n pairs."""
    sizes = {} if args.method in ("mimic", "live") else {"rank": args.rank}
    return sizes | ({"n": args.virtual_tokens} if args.method == "hificl" else {})


# ---------------------------------------------------------------------------------------------- the loss (Eq 16-17)

def hyper_icl_loss(h, h_teacher, span, logits, labels, args, anchor_scale=1.0):
    """Eq 17 on one micro-batch: L = L_H-anchor + lambda L_sup. Returns {"anchor", "sup", "loss"}.

    h, h_teacher: [L, B, W, d], every decoder layer's own output (model.layer_outputs) for the student (query only,
    with the adapter) and the teacher (with the ICDs, laid at the student's positions: stack_teacher).
    span: bool [B, W], the tokens Eq 16 compares: the query's and its target's (answer + end token), the tokens both
    rows hold (data.collate). A choice: the paper says "the query tokens", and the target is part of both rows.
    logits, labels: the student's at its answer window (target_logits).
    """
    anchor = hyperbolic_anchor_loss(h, h_teacher, span, args.kappa)     # Eq 16: mean d_L^2 per query, then queries
    sup = supervised_loss(logits, labels)                               # L_sup: CE per target token (not in paper)
    anchor = share_of_global_mean(anchor, span.any(1).sum()) / anchor_scale  # torchrun; --anchor-norm (not in paper)
    sup = share_of_global_mean(sup, answer_positions(labels).sum())
    return {"anchor": anchor, "sup": sup, "loss": anchor + args.lam * sup}  # Eq 17


def losses(backbone, args, student, teacher, model=None, anchor_scale=1.0):
    """The training loss of one micro-batch: Hyper-ICL's (hyper_icl_loss), or a baseline's own (baseline_loss).
    student: the student batch (data.student_batch); teacher: what micro_batch gives for args.anchor. model: what runs
    the student (the DistributedDataParallel wrapper under torchrun; default backbone.model). anchor_scale: what the
    anchor is divided by (--anchor-norm first: its value at the first step; the paper: 1)."""
    run = lambda: target_logits(model or backbone.model, student)     # the LM head at the answer window only
    with autocast(student["input_ids"].device):
        (logits, labels), h = M.layer_outputs(backbone.model, run) if args.anchor in LAYER_ANCHORS else (run(), None)
    if args.anchor == "hyperbolic":
        return hyper_icl_loss(torch.stack(h), teacher, student["query_target"], logits, labels, args, anchor_scale)
    return baseline_loss(args, logits, h, teacher, student["query_target"], labels, anchor_scale)


# The anchors on the layer states h^(l) (student, teacher: [L, B, W, d]; span: [B, W]); Eq 16 trains in hyper_icl_loss
LAYER_ANCHORS = {"hyperbolic": lambda s, t, span, args: lorentz.hyperbolic_anchor_loss(s, t, span, args.kappa),
                 "euclidean": lambda s, t, span, args: euclidean_anchor_loss(s, t, span),                # L2, Table 4
                 "mse": lambda s, t, span, args: layerwise_mse(s, t, span)}                              # MimIC


def baseline_loss(args, logits, h, teacher, span, labels, anchor_scale=1.0):
    """A baseline's loss, L_anchor + lambda L_sup with its own L_anchor: Table 4's Euclidean anchor, MimIC's layer-wise
    MSE, LIVE's KL at the answer positions (teacher: [n_answers, V]), or none (L = L_sup: HiFICL, LoRA)."""
    answers = answer_positions(labels)                               # [B, K] bool: predicts a target token
    sup = share_of_global_mean(supervised_loss(logits, labels), answers.sum())
    if args.anchor == "none":
        return {"sup": sup, "loss": sup}
    if args.anchor == "kl":
        anchor = share_of_global_mean(answer_kl(logits[answers], teacher, args.temperature), answers.sum())
    else:
        anchor = LAYER_ANCHORS[args.anchor](torch.stack(h), teacher, span, args)
        anchor = share_of_global_mean(anchor, span.any(1).sum())
    anchor = anchor / anchor_scale
    return {"anchor": anchor, "sup": sup, "loss": anchor + args.lam * sup}


@torch.no_grad()
def initial_anchor(backbone, args, kind, queries, icds, device, cache):
    """--anchor-norm first: L_anchor of the first micro-batch before any step (the adapter at its identity start),
    the constant the anchor is then divided by, so that it starts at 1 beside lambda L_sup. Not in the paper."""
    rank, world = rank_and_world()
    qs = [queries[i] for i in epoch_order(len(queries), args.batch_size, args.seed, 0)[0][rank::world]]
    anchor = losses(backbone, args, *micro_batch(backbone, args, kind, qs, [icds[q.id] for q in qs], device, cache))
    anchor = anchor["anchor"].detach().float()
    if dist.is_initialized():
        dist.all_reduce(anchor)  # the processes' shares add up to the global mean times the number of processes
        anchor /= world
    if not anchor > 0:
        raise FloatingPointError(f"--anchor-norm first: the first step's anchor is {anchor.item()}, "
                                 "nothing to divide by")
    tqdm.write(f"--anchor-norm first: the anchor is divided by its first-step value {anchor.item():.4g}")
    return anchor.item()


def target_logits(model, batch, **kwargs):
    """model's logits [B, K, V] at `batch`'s data.answer_window and the labels [B, K] they line up with."""
    keep = batch.get("window") or data.answer_window(batch["labels"])  # "window": counted on the host (finished)
    return model(**data.model_inputs(batch), logits_to_keep=keep, use_cache=False, **kwargs).logits, \
        batch["labels"][:, -keep:]


def supervised_loss(logits, labels):
    """L_sup: next-token cross-entropy on the target tokens (labels -100 elsewhere)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def layerwise_mse(student, teacher, span):
    """MimIC's layer-wise loss: per query, the mean squared difference of the student's and teacher's states over
    layers, query tokens and features; then the mean over queries. student, teacher: [L, B, W, d]; span: [B, W]."""
    return torch.stack([(student[:, b, a] - teacher[:, b, a]).float().square().mean()
                        for b, a in enumerate(span)]).mean()


def answer_kl(student_logits, teacher_logits, temperature):
    """LIVE's loss, T^2 KL(softmax(teacher / T) || softmax(student / T)), mean over N answer positions: both [N, V]."""
    t = F.log_softmax(teacher_logits.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1)
    return temperature ** 2 * (t.exp() * (t - s)).sum(-1).mean()


def share_of_global_mean(mean, count):
    """This process's share of a mean over the global micro-batch, from the mean over its `count` items: under
    torchrun, N processes hold parts of the micro-batch and DDP averages their gradients, so mean * count * N /
    (global count), whose average over the processes is the mean over the whole micro-batch. Else `mean` itself."""
    if not dist.is_initialized():
        return mean
    total = count.detach().float().clone()
    dist.all_reduce(total)
    return mean * count * dist.get_world_size() / total


def anchor_regime(args, student, teacher):
    """Print the anchor's scale on this backbone (The anchor regime, README): sqrt(kappa)|LN(h)| (|LN(h)| = sqrt(d)),
    the noise floor (the loss between the teacher states and their own rounding to the training dtype, and to bf16)
    and the loss between the teacher states of different queries."""
    span, dtype, d = student["query_target"], autocast_dtype(student["input_ids"].device), teacher.shape[-1]
    loss = lambda states: f"{LAYER_ANCHORS[args.anchor](states, teacher, span, args).item():.4g}"  # to the teacher's
    shuffled = teacher.roll(1, dims=1) if span.shape[0] > 1 and (span == span.roll(1, 0)).all() else None
    unrelated = "" if shuffled is None else f"; between different queries' teacher states {loss(shuffled)}"
    print(f"anchor ({args.anchor}, kappa {args.kappa}, d {d}): sqrt(kappa)|LN(h)| = {(args.kappa * d) ** 0.5:.1f}; "
          f"noise floor (teacher states vs their own rounding to {str(dtype).split('.')[-1]}, the training dtype) "
          f"{loss(teacher.to(dtype).float())}, to bfloat16 {loss(teacher.to(torch.bfloat16).float())}{unrelated}")


# ------------------------------------------------------------------------------------------------------ the teacher

def teacher_key(backbone_id, args, query, icds, images=None):
    """The cache key of one query's teacher states: backbone, task, query, its ICDs, the prompt format, how images
    are encoded (`images`: Idefics2's image splitting, which changes the query's tokens) and the version of what the
    states are (model.LAYER_OUTPUTS_VERSION), so states cached under another definition are never read."""
    item = lambda it: [it.id, it.image_path, it.question, it.target]
    spec = {"backbone": backbone_id, "task": args.task, "query": item(query), "icds": [item(d) for d in icds],
            "prompts": data.PROMPTS, "separator": data.SEPARATOR, "states": M.LAYER_OUTPUTS_VERSION, "images": images}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def answer_positions(labels):
    """Bool [B, W]: the positions whose logits predict an answer token (labels -100 elsewhere; next-token shift)."""
    return F.pad(labels[:, 1:] != -100, (0, 1))


@torch.no_grad()
def run_teacher(backbone, kind, queries, icds, pieces, device, output="states", batch=None):
    """The frozen teacher on [ICDs; query + target], no adapter: per query, its states [L, T_q, d] at the query + target
    tokens; output="logits" (LIVE's teacher): its logits at the answer positions, [n_answer, V] in float32. They stay
    on `device`. batch: their teacher batch, when a DataLoader worker made it already (data.teacher_batch)."""
    batch = to_device(batch or data.teacher_batch(backbone.processor, backbone.family, kind, pieces, icds), device)
    with M.without_adapter(backbone.model), autocast(device):
        if output == "logits":
            logits, labels = target_logits(backbone.model, batch)
            answer = answer_positions(labels)
            return [logits[b, answer[b]].float() for b in range(len(queries))]
        inputs = {**data.model_inputs(batch), "logits_to_keep": 1, "use_cache": False}  # no logits, no KV cache
        kept = M.layer_outputs(backbone.model, keep=batch["query_target"], **inputs)[1]  # L x [sum of T_q, d]
    ends = batch["query_target"].sum(1).cumsum(0).tolist()
    return [torch.stack([h[end - n:end] for h in kept]) for end, n in zip(ends, batch["query_target"].sum(1).tolist())]


def read_teacher(path, key, shape, output="states"):
    """One query's cached teacher tensor `output` ("states" or "logits") of `shape` (None: any size), or None if there
    is no file or it is unusable (truncated, another shape, key or checksum: reported), so it is computed again."""
    cached = data.read_cache(path, key + output, {output: (shape, None)})
    return None if cached is None else cached[output]


def teacher_file(args, cache, query, icds):
    """One query's cache key and file under --teacher-cache: its teacher states, or for --anchor kl its logits."""
    key = teacher_key(cache["id"], args, query, icds, cache.get("images"))
    return key, os.path.join(args.teacher_cache, key + ("-logits" if args.anchor == "kl" else "") + ".safetensors")


def query_sizes(pieces):
    """(T_q, answer tokens) of each query piece (data.query_pieces): the sizes of its teacher tensor."""
    return [(len(p["input_ids"]), sum(x != -100 for x in p["labels"])) for p in pieces]


def query_tokens(processor, family, kind, queries):
    """query_sizes of every query without loading its image: one query encoded in full (data.query_pieces) gives the
    tokens its image stands for, a count fixed per family and setting (Idefics2 66 or 326, LLaVA-Interleave 729,
    LLaVA-OneVision 730), and each query adds the tokens of its own text (text_tokens)."""
    (reference, _), = query_sizes(data.query_pieces(processor, family, kind, queries[:1]))
    image = reference - text_tokens(processor, family, kind, queries[0])[1]
    return [(image + whole, whole - prompt) for prompt, whole in (text_tokens(processor, family, kind, q)
                                                                  for q in queries)]


def text_tokens(processor, family, kind, query):
    """Tokens of the query's prompt and of its prompt + answer by the tokenizer alone, the image placeholder one
    special token (each family's image tokens end in a special token too, so the text after it reads the same)."""
    count = lambda text: len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt = data.prompt_text(kind, query)
    return count(prompt), count(prompt + data.answer_text(processor, family, kind, query.target))


def teacher_states(backbone, args, kind, queries, icds, pieces, device, cache):
    """Each query's teacher states (its answer logits for --anchor kl), from the cache when present (computed and
    stored once otherwise). A cached tensor must have the shape of states [L, T_q, d] or logits [answer tokens, any]."""
    found = cached_states(args, cache, teacher_shape(backbone.model), queries, icds, pieces)
    return completed_states(backbone, args, kind, queries, icds, pieces, device, cache, found)


def teacher_shape(model):
    """(layers, width) of the teacher's states: what a cached tensor must have besides its tokens."""
    return M.attention_shape(model)[0], model.config.get_text_config().hidden_size


def cached_states(args, cache, shape, queries, icds, pieces):
    """What the cache holds for these queries, read without the model (in a DataLoader worker): {"states": each
    query's cached tensor, None where there is none or it is unusable (all None with --no-teacher-cache), "keys",
    "paths"}. shape: teacher_shape."""
    output = "logits" if args.anchor == "kl" else "states"
    keys, paths = zip(*(teacher_file(args, cache, q, d) for q, d in zip(queries, icds)))
    shapes = [(answers, None) if output == "logits" else (shape[0], tokens, shape[1])
              for tokens, answers in query_sizes(pieces)]
    states = [None] * len(queries) if args.no_teacher_cache else \
        [read_teacher(p, k, s, output) for p, k, s in zip(paths, keys, shapes)]
    return {"states": states, "keys": list(keys), "paths": list(paths)}


def completed_states(backbone, args, kind, queries, icds, pieces, device, cache, found, batch=None):
    """`found` (cached_states) with the missing states computed by the teacher on `device` (where they stay) and
    stored; batch: the teacher batch of the missing queries, if already made. The hits and misses are counted."""
    output = "logits" if args.anchor == "kl" else "states"
    states, missing = list(found["states"]), [i for i, s in enumerate(found["states"]) if s is None]
    fresh = run_teacher(backbone, kind, [queries[i] for i in missing], [icds[i] for i in missing],
                        None if batch else [pieces[i] for i in missing], device, output, batch) if missing else []
    cache["misses"] += len(missing)
    cache["hits"] += len(queries) - len(missing)
    for i, s in zip(missing, fresh):
        states[i] = s
        if not args.no_teacher_cache:
            try:
                data.write_cache(found["paths"][i], {output: s.cpu()}, found["keys"][i] + output)
            except OSError as e:  # a full disk mid-run: the same sentence as the room check before the first step
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                room = cache.get("room", f"the teacher cache in {args.teacher_cache} needs {size(s.nbytes)} a "
                                 "query; give --teacher-cache DIR on a disk with room, or --no-teacher-cache")
                raise OSError(e.errno, f"{e.strerror} writing {found['paths'][i]}: {room}") from None
    return [s.to(device, non_blocking=True) for s in states]


def stack_teacher(states, span):
    """Lay per-query teacher states [L, T_q, d] at the student's aligned positions: [L, B, W, d]. Those are each row's
    last T_q positions (data.collate pads on the left), so they are sliced, with no wait for the device."""
    L, d = states[0].shape[0], states[0].shape[-1]
    out = torch.zeros(L, *span.shape, d, dtype=states[0].dtype, device=span.device)
    for b, s in enumerate(states):
        out[:, b, span.shape[1] - s.shape[1]:] = s.to(span.device)
    return out


def micro_batch(backbone, args, kind, queries, icds, device, cache):
    """Student batch (query + target) and, for the anchor, the teacher's states laid at its aligned positions."""
    setup = Setup(backbone.processor, backbone.family, kind, args, cache, teacher_shape(backbone.model))
    return finished(backbone, args, kind, prepared_micro_batch(setup, (queries, icds)), device, cache)


@dataclass
class Setup:
    """What a DataLoader worker needs to prepare micro-batches (no model): the processor, family, task kind, flags,
    the teacher cache's identity (cache: its "id" and "images") and teacher_shape."""
    processor: object
    family: str
    kind: str
    args: argparse.Namespace
    cache: dict
    shape: tuple


def prepared_micro_batch(setup, spec):
    """Everything of one micro-batch spec = (queries, their ICDs) that needs no model, as a DataLoader worker makes it
    (micro_batches): the student batch, the queries, and for the anchor what the cache holds (cached_states) and
    the teacher batch of the queries it lacks."""
    (queries, icds), s = spec, setup
    pieces = data.query_pieces(s.processor, s.family, s.kind, queries)
    out = {"student": data.student_batch(s.processor, s.family, s.kind, pieces), "queries": queries, "icds": icds}
    if s.args.anchor == "none":
        return out
    found = cached_states(s.args, s.cache, s.shape, queries, icds, pieces)
    missing = [i for i, state in enumerate(found["states"]) if state is None]
    teacher = data.teacher_batch(s.processor, s.family, s.kind, [pieces[i] for i in missing],
                                 [icds[i] for i in missing]) if missing else None
    return out | {"found": found, "teacher": teacher}


def finished(backbone, args, kind, prepared, device, cache):
    """(student batch, teacher tensor for args.anchor) of a prepared micro-batch on `device`: the missing teacher
    states computed there, the cached ones copied there; laid at the student's aligned positions (stack_teacher)."""
    student = {**to_device(prepared["student"], device), "window": data.answer_window(prepared["student"]["labels"])}
    if args.anchor == "none":
        return student, None
    states = completed_states(backbone, args, kind, prepared["queries"], prepared["icds"], None, device, cache,
                              prepared["found"], prepared["teacher"])
    if args.anchor == "kl":
        return student, torch.cat(states)  # answer logits, in the order of answer_positions
    return student, stack_teacher(states, student["query_target"])


def micro_batches(run, specs):
    """The prepared micro-batches of `specs` ((queries, ICDs) each), in order, built by --workers DataLoader workers
    while the accelerator runs the ones before (0: in this process, one at a time)."""
    setup = Setup(run.backbone.processor, run.backbone.family, run.kind, run.args,
                  {k: run.cache[k] for k in ("id", "images")}, teacher_shape(run.backbone.model))
    return data.prepared(functools.partial(prepared_micro_batch, setup), specs, run.args.workers, run.device)


# --------------------------------------------------------------------------------------------------------- the loop

def train(args):
    """Minimise Eq 17 over the adapter's parameters only (the backbone stays frozen): AdamW with linear warm-up and
    cosine decay, --epochs passes over the training queries, the best epoch (held-out loss) kept. Ctrl-C or SIGTERM
    saves the run (saved_on_interrupt), and --resume continues it exactly. Returns the final adapter's parameters."""
    run = start(args)
    with saved_on_interrupt(run):
        for epoch in range(len(run.progress["history"]), args.epochs):  # an epoch counts once it is scored
            for batches in remaining_steps(run, epoch):
                if args.max_steps is not None and run.progress["step"] >= args.max_steps:
                    return finish(run)
                train_step(run, batches)
            end_of_epoch(run, epoch)
            save_run(run)
        return finish(run)


def train_step(run, batches):
    """One optimiser step: per prepared micro-batch (micro_batches), the teacher's states and the student's forward
    give the loss (Eq 17); then one clipped AdamW step, shown and checkpointed every --save-every steps. The loss
    parts are summed on the device and read once a step. A NaN or inf loss stops the run before the step."""
    parts, step = {}, run.progress["step"] + 1
    for prepared in batches:
        student, teacher = finished(run.backbone, run.args, run.kind, prepared, run.device, run.cache)  # h'^(l)
        part = losses(run.backbone, run.args, student, teacher, run.student_model, run.progress.get("anchor_scale", 1))
        (part["loss"] / run.args.grad_accum).backward()
        parts = {k: parts.get(k, 0) + v.detach() / run.args.grad_accum for k, v in part.items()}
    parts = dict(zip(parts, torch.stack(list(parts.values())).tolist()))  # the one host sync of the step
    for name, value in parts.items():
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step}: loss part {name!r} is {value}; stopping. The last good "
                                     f"checkpoint is untouched. Settings that can cause it: {diverging(run.args)}; "
                                     "try a lower value of one of them (--lr first)")
    # the step: gradients clipped (--clip, not in the paper), AdamW, the learning-rate schedule
    torch.nn.utils.clip_grad_norm_(M.adapter_modules(run.backbone.model).parameters(), run.args.clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.progress["step"] = step
    run.bar.update()
    run.bar.set_postfix({k: f"{v:.4g}" for k, v in parts.items()} | {"lr": f"{run.scheduler.get_last_lr()[0]:.2g}"})
    if step % run.args.save_every == 0:
        save_run(run)


@dataclass
class Run:
    """What the training loop's functions share; `progress` is what last.pt saves beside the adapter and AdamW."""
    args: argparse.Namespace
    backbone: M.Backbone
    kind: str                 # the task's kind (data.TASKS)
    queries: list             # training queries
    heldout: list             # held-out queries, which pick the best epoch
    icds: dict                # query id -> its demonstrations (fixed for the run)
    device: str
    cache: dict               # the teacher cache: backbone id, image setting, hits and misses
    optimizer: torch.optim.Optimizer
    scheduler: object
    student_model: object     # the DistributedDataParallel wrapper under torchrun, else None
    progress: dict            # step, best held-out loss, history (one entry per scored epoch), anchor_scale
    steps_per_epoch: int
    bar: tqdm                 # the progress bar (the first process's)


def start(args):
    """Everything before the first step: the data (first: it fails fast), the backbone, the ICDs, a fresh adapter, AdamW
    and its schedule, a resumed run's checkpoint; then a stop if the teacher cache would not fit its folder
    (check_cache_room), the anchor's first-step value for --anchor-norm first, and its noise floor (anchor_regime)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    queries, heldout, pool, shots = split_pool(args, M.family_of(args.model))
    backbone = M.load_backbone(args.model, device=device, image_splitting=args.image_splitting,
                               image_memory=args.image_memory * 1e9)
    if backbone.images:
        print(backbone.images)
    icds = dict(zip((q.id for q in queries), data.choose_demonstrations(backbone, args, queries, pool, shots)))
    try:
        params = M.attach(backbone.model, args.method, **method_sizes(args)).parameters()
    except RuntimeError as e:  # torch.OutOfMemoryError too: a --rank or --virtual-tokens too large for memory
        raise ValueError(f"the {args.method} adapter of {method_sizes(args)} does not fit in memory "
                         f"({str(e).splitlines()[0][:160]}); lower --rank or --virtual-tokens") from e
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    student_model = data_parallel(backbone.model, args, len(queries)) if rank_and_world()[1] > 1 else None
    steps_per_epoch = math.ceil(math.ceil(len(queries) / args.batch_size) / args.grad_accum)
    total = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, round(args.warmup * total)), total)  # Section 4.1
    os.makedirs(args.teacher_cache, exist_ok=True)
    progress = restore(args, backbone, optimizer, scheduler) if args.resume else \
        {"step": 0, "best": math.inf, "history": []}
    cache = {"id": fingerprint(backbone), "hits": 0, "misses": 0, "images": image_key(backbone.processor)}
    kind = data.TASKS[args.task].kind
    if args.anchor != "none" and not args.no_teacher_cache:
        check_cache_room(backbone, args, kind, queries, icds, cache)
    if args.anchor_norm == "first" and args.anchor != "none" and "anchor_scale" not in progress:
        progress["anchor_scale"] = initial_anchor(backbone, args, kind, queries, icds, device, cache)
    if args.anchor in ("hyperbolic", "euclidean") and not args.resume:
        first = [queries[i] for i in epoch_order(len(queries), args.batch_size, args.seed, 0)[0]]
        anchor_regime(args, *micro_batch(backbone, args, kind, first, [icds[q.id] for q in first], device, cache))
    bar = tqdm(total=total, initial=progress["step"], desc="train", dynamic_ncols=True, disable=rank_and_world()[0] > 0)
    return Run(args, backbone, kind, queries, heldout, icds, device, cache, optimizer, scheduler, student_model,
               progress, steps_per_epoch, bar)


def remaining_steps(run, epoch):
    """The optimiser steps of `epoch` not taken yet (a resumed run starts where its checkpoint left off), each as its
    micro-batches of queries: this process's share of each under torchrun."""
    order = epoch_order(len(run.queries), run.args.batch_size, run.args.seed, epoch)
    (rank, world), accum = rank_and_world(), run.args.grad_accum
    steps = [[[run.queries[i] for i in idx[rank::world]] for idx in order[s * accum:(s + 1) * accum]]
             for s in range(run.progress["step"] - epoch * run.steps_per_epoch, run.steps_per_epoch)]
    prepared = iter(micro_batches(run, [(qs, [run.icds[q.id] for q in qs]) for step in steps for qs in step]))
    for step in steps:
        yield [next(prepared) for _ in step]


@contextlib.contextmanager
def saved_on_interrupt(run):
    """Ctrl-C or SIGTERM (a scheduler's kill warning): save the run (a 2nd SIGTERM ignored), exit naming --resume."""
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        save_run(run)
        run.bar.close()
        sys.exit(f"interrupted: saved step {run.progress['step']} to {run.args.out}/last.pt ({str(e) or 'Ctrl-C'}); "
                 "continue with --resume")
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_of_epoch(run, epoch):
    """Score the held-out queries; keep the best epoch's adapter as <out>/adapter.safetensors. The epoch enters the
    history only once its adapter is saved, so a run stopped in between scores it again."""
    progress, first = run.progress, rank_and_world()[0] == 0
    loss = heldout_loss(run.backbone, run.args, run.kind, run.heldout, run.device)
    if loss < progress["best"]:
        if first:
            M.save_adapter(os.path.join(run.args.out, "adapter.safetensors"), run.backbone)
        progress["best"] = loss
    progress["history"].append({"epoch": epoch + 1, "step": progress["step"], "heldout_loss": loss})
    if first:
        tqdm.write(f"epoch {epoch + 1}: held-out loss {loss:.4f} (best {progress['best']:.4f})")


@torch.no_grad()
def heldout_loss(backbone, args, kind, heldout, device):
    """The supervised loss of the held-out queries, which picks the best epoch. Under torchrun each process scores
    every N-th batch; the batches' values are gathered and summed in order."""
    rank, world = rank_and_world()
    starts, totals = range(0, len(heldout), args.batch_size), {}
    mine = starts[rank::world]
    build = functools.partial(student_rows, backbone.processor, backbone.family, kind)
    for i, batch in zip(mine, data.prepared(build, [heldout[i:i + args.batch_size] for i in mine], args.workers,
                                            device)):
        with autocast(device):
            loss = supervised_loss(*target_logits(backbone.model, to_device(batch, device)))
        totals[i] = loss, len(batch["labels"])
    totals = {i: loss.item() * n for i, (loss, n) in totals.items()}  # read after the last forward
    totals = gathered(totals)
    return sum(totals[i] for i in starts) / len(heldout)


def student_rows(processor, family, kind, queries):
    """The student batch of queries (their pieces made for it alone): the held-out loss's batches."""
    return data.student_batch(processor, family, kind, data.query_pieces(processor, family, kind, queries))


def finish(run):
    """Final checkpoint, history.json and the summary line (the first process's); returns the adapter's parameters."""
    save_run(run)
    run.bar.close()
    if rank_and_world()[0] == 0:
        progress, cache = run.progress, run.cache
        data.write_json(os.path.join(run.args.out, "history.json"), progress["history"], indent=1)
        best = os.path.join(run.args.out, "adapter.safetensors")
        print(f"done: {progress['step']} steps; teacher states computed {cache['misses']}, reused {cache['hits']}; "
              + (f"best adapter: {best}" if os.path.exists(best) else "no epoch scored yet, so no best adapter "
                 "(continue with --resume)"))
    return {k: v.detach().clone() for k, v in M.adapter_modules(run.backbone.model).state_dict().items()}


def split_pool(args, family):
    """Training queries, held-out queries (best epoch), the ICDs' support set (the training split less the held-out
    queries, which would reach the adapter through the teacher and bias the best epoch) and the shots."""
    pool = data.load_task(args.task, "train", args.data_root)
    if len(pool) <= args.n_heldout:
        raise ValueError(f"{args.task} has {len(pool)} training items: none left to train on after "
                         f"--n-heldout {args.n_heldout}")
    order = random.Random(args.seed).sample(range(len(pool)), len(pool))
    heldout = [pool[i] for i in order[:args.n_heldout]]
    train = [pool[i] for i in order[args.n_heldout:args.n_heldout + args.n_train]]
    if len(train) < args.n_train:
        print(f"note: {args.task} has {len(pool)} training items; using {len(train)} queries "
              f"(+{len(heldout)} held out)")
    shots = args.shots if args.shots is not None else data.default_shots(args.task, family)
    held = {it.id for it in heldout}
    return train, heldout, [it for it in pool if it.id not in held], shots


def epoch_order(n, batch_size, seed, epoch):
    """The batches of one epoch: a permutation that depends only on (seed, epoch), so a resumed run sees the same."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


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


# ---------------------------------------------------- toy-idefics2: meta-training a backbone that learns in context
#
# From scratch, on the toy-icl world (data.py), with a curriculum: first single images whose question names the
# attribute (perception), then episodes of 0..8 demonstrations with the uninformative question (in-context
# learning), some batches still naming it. Without demonstrations the model falls back on the more frequent task of
# the episodes (background), as a pretrained model falls back on its prior; with them it answers the task they show.
# Whether a build learns in context is a phase transition that the last bits of the weights can tip (another CPU,
# another thread count): 900 episode steps left some seeds on the prior task for good, 1,800 (a slower cosine decay)
# let every measured seed through (README). So every build is probed on held-out episodes and used only if it
# learns in context (ACCEPT); otherwise the next seed is tried.

TOY_RECIPE = dict(seed=0, named_steps=300, episode_steps=1800, named_batch=32, episode_batch=16, lr=2e-3, warmup=100,
                  named_fraction=0.3, max_shots=8, scenes=4096, probe_every=200, version=2,
                  episode_tasks={"colour": 1, "background": 2})  # colour, the target, is the rarer task in episodes
TOY_TARGET = "colour"
TOY_BUILD_OUT = os.path.join("runs", "toy-idefics2", "backbone.safetensors")
ACCEPT = {"8-shot": 0.9, "0-shot": 0.3}  # the target task's accuracy on held-out episodes: at least / at most
PROBE_EPISODES = 128  # per attribute and number of shots in the acceptance probe (32 in the learning curve)


def toy_scenes(processor, n, rng):
    """n scenes of the meta-training world and their pixels (through the processor, once): (scenes, pixel dicts)."""
    scenes = [data.icl_scene(rng) for _ in range(n)]
    images = [[Image.open(io.BytesIO(data.icl_jpeg(s))).convert("RGB")] for s in scenes]
    out = processor.image_processor(images, do_rescale=False, do_normalize=False, do_pad=False)  # data.image_pixels
    return scenes, [{"pixel_values": [data.chw(c) for c in crops]} for crops in out["pixel_values"]]


def toy_batch(processor, text, scenes, pixels, episodes):
    """One batch of episodes [(attribute, question, scene indices)]: ICDs, then the query (last), answers labelled."""
    rows = []
    for attribute, question, picks in episodes:
        pieces = [{**text[question, scenes[i][attribute], k == len(picks) - 1], "images": pixels[i]}
                  for k, i in enumerate(picks)]
        rows.append(data.icl_episode(processor, pieces))
    return data.collate(rows, processor, "idefics2")


def draw_episodes(recipe, rng, n_scenes, named):
    """One step's episodes: single images with named questions (phase 1, named None; attributes equally often),
    else rows of the same number (0..max_shots, drawn per batch: no padding) of ICDs + a query, named or not, the
    attribute drawn with the weights recipe["episode_tasks"]."""
    shots = 0 if named is None else rng.randint(0, recipe["max_shots"])
    names = list(data.ICL_ATTRIBUTES)
    weights = [1] * len(names) if named is None else [recipe["episode_tasks"][a] for a in names]
    episodes = []
    for _ in range(recipe["named_batch" if named is None else "episode_batch"]):
        attribute = rng.choices(names, weights)[0]
        question = data.ICL_QUESTION if named is False else data.ICL_NAMED[attribute]
        episodes.append((attribute, question, rng.sample(range(n_scenes), shots + 1)))
    return episodes


@torch.no_grad()
def probe_row(model, processor, text, probe_set, n=32):
    """Accuracy of the query's answer token (argmax, teacher-forced) per attribute on n held-out episodes each:
    perception (zero-shot, named question), zero-shot and 8-shot."""
    (scenes, pixels), row = probe_set, {}
    model.eval()
    for setting, shots, named in (("named", 0, True), ("0-shot", 0, False), ("8-shot", 8, False)):
        rng, row[setting] = random.Random(1234), {}
        for attribute in data.ICL_ATTRIBUTES:
            question = data.ICL_NAMED[attribute] if named else data.ICL_QUESTION
            episodes = [(attribute, question, rng.sample(range(len(scenes)), shots + 1)) for _ in range(n)]
            batch = toy_batch(processor, text, scenes, pixels, episodes)
            logits = model(**data.model_inputs(batch)).logits
            last = batch["labels"].shape[1] - 1 - torch.flip(batch["labels"] != -100, [1]).int().argmax(1)  # end token
            rows = torch.arange(n)
            answer = batch["input_ids"][rows, last - 1]       # every answer is one token, then the end token
            row[setting][attribute] = (logits[rows, last - 2].argmax(-1) == answer).float().mean().item()
    model.train()
    return row


def describe_probe(row):
    return "  ".join(f"{k}: " + " ".join(f"{a} {v:.2f}" for a, v in row[k].items())
                     for k in ("named", "0-shot", "8-shot"))


def meta_train(recipe, threads=1, log=print):
    """Meta-train the toy Idefics2 from scratch with the curriculum above, recipe["named_steps"] then
    recipe["episode_steps"] (bit-identical for recipe["seed"] on one thread of one machine). Returns (model,
    processor, learning curve, acceptance probe): probe rows on scenes never trained on."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        processor = M.toy_processor()
        model = M.toy_model(processor, recipe["seed"]).train()
        rng = random.Random(recipe["seed"])
        text = data.icl_text_pieces(processor)
        scenes, pixels = toy_scenes(processor, recipe["scenes"], rng)
        probe_set = toy_scenes(processor, max(64, recipe["scenes"] // 8), random.Random(recipe["seed"] + 1))
        total = recipe["named_steps"] + recipe["episode_steps"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"])
        scheduler = get_cosine_schedule_with_warmup(optimizer, recipe["warmup"], total)
        curve, losses = [], []
        for step in (bar := tqdm(range(total), desc=f"meta-training toy-idefics2 (seed {recipe['seed']})",
                                 dynamic_ncols=True)):
            named = None if step < recipe["named_steps"] else rng.random() < recipe["named_fraction"]
            batch = toy_batch(processor, text, scenes, pixels, draw_episodes(recipe, rng, len(scenes), named))
            loss = model(**data.model_inputs(batch), labels=batch["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if (step + 1) % recipe["probe_every"] == 0:
                curve.append({"step": step + 1, "loss": sum(losses) / len(losses),
                              **probe_row(model, processor, text, probe_set)})
                losses = []
                log(f"step {step + 1}: loss {curve[-1]['loss']:.3f}  " + describe_probe(curve[-1]))
        final = probe_row(model, processor, text, probe_set, n=PROBE_EPISODES)  # leaves the model in train mode
        return model.eval(), processor, curve, final
    finally:
        torch.set_num_threads(before)


def learns_in_context(row, accept=ACCEPT):
    """Whether an acceptance probe shows in-context learning of the target task (ACCEPT's bounds)."""
    return row["8-shot"][TOY_TARGET] >= accept["8-shot"] and row["0-shot"][TOY_TARGET] <= accept["0-shot"]


def build_toy(path, recipe=TOY_RECIPE, tries=3, threads=1, accept=ACCEPT):
    """Meta-train toy-idefics2 with seeds recipe["seed"], +1, ... until a build passes the acceptance probe; write
    that one atomically to `path` (checksum, recipe with the accepted seed, probe and curve in the metadata).
    A ValueError if none of the `tries` passes: then nothing is written. Returns (model, processor)."""
    for seed in range(recipe["seed"], recipe["seed"] + tries):
        start = time.perf_counter()
        model, processor, curve, final = meta_train({**recipe, "seed": seed}, threads, log=tqdm.write)
        passed = learns_in_context(final, accept)
        print(f"toy-idefics2 seed {seed} ({time.perf_counter() - start:.0f} s, {threads} thread(s)): "
              + describe_probe(final) + (" -> accepted" if passed else " -> does not learn in context, rejected"))
        if passed:
            tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            meta = {"sha256": data.weights_digest(tensors), "recipe": json.dumps({**recipe, "seed": seed}),
                    "probe": json.dumps(final), "curve": json.dumps(curve), "threads": json.dumps(threads)}
            data.atomic_write(path, lambda f: f.write(save(tensors, metadata=meta)))
            print(f"toy-idefics2: -> {path} (use it with --model {path})")
            return model, processor
    raise ValueError(f"no toy-idefics2 build learned in context in {tries} tries (seeds {recipe['seed']}.."
                     f"{recipe['seed'] + tries - 1}: 8-shot {TOY_TARGET} below {accept['8-shot']} or 0-shot above "
                     f"{accept['0-shot']}); nothing was written. Try other seeds (--seed) or more (--build-tries)")


# ------------------------------------------------------------------ the plan: what a run costs, before weights load
#
# train.py / evaluate.py --plan: the rows of a sample of the task's queries, encoded by the real processor exactly as
# a run encodes them (data.teacher_batch, data.student_batch), and the model's config on the meta device, give the
# tokens per row, the teacher cache on disk and an estimate of peak accelerator memory; no weights are read.

PLAN_SAMPLE = 32    # queries whose rows the plan encodes (every query when there are fewer)
CACHE_HEADER = 300  # bytes of a cache file besides its tensor: safetensors' header with the key and checksum
RUNTIME = 0.45e9     # bytes: a CPU run's resident Python, torch, transformers and tokenizer before any weight
MEMORY_ASSUMPTIONS = (
    "assumptions: weights and activations in {dtype}, the adapter's state in float32 (16 bytes a parameter); "
    "loading: on a CPU the weights plus the {file} file's copy (mapped while the weights are converted), on a GPU the "
    "weights; images: the batch's pixel tensors as the batch builder returns them for the sampled rows, the real "
    "images' copy in {dtype}, each image's vision-tower output, and one chunk of images (--image-memory {budget}) at "
    "model.image_work; decoder: one layer's work B T (3 i + 5 d) and a B x T x T bool mask (SDPA without T x T "
    "scores), in evaluation the KV cache 2 L B (T + new) kv (training forwards keep none), the teacher's kept states "
    "L B T_q d (no [L, B, T, d] stack), the student's B T_s L (10 d + 3 i) saved for the backward; a phase's peak is "
    "its pixels + the larger of its image and decoder parts; on a CPU the runtime (0.45 GB) is added; rows at the "
    "sample's longest, random ICDs (train.memory)")


def image_key(processor):
    """What of the processor's image settings changes the query's tokens: Idefics2's image splitting (None else)."""
    return getattr(getattr(processor, "image_processor", None), "do_image_splitting", None)


def size(n):
    """n bytes in decimal units: "21.3 GB", "48.4 kB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def cache_file_bytes(args, config, sizes, dtype):
    """The mean bytes of a query's cache file (data.write_cache) over `sizes` (query_sizes): its teacher tensor, states
    [L, T_q, d] in the training dtype or LIVE's logits [answers, vocabulary] in float32, and CACHE_HEADER."""
    text = config.get_text_config()
    if args.anchor == "kl":
        elements, dtype = sum(answers for _, answers in sizes) * text.vocab_size, torch.float32
    else:
        elements = sum(tokens for tokens, _ in sizes) * text.num_hidden_layers * text.hidden_size
    return elements * dtype.itemsize / len(sizes) + CACHE_HEADER


def check_cache_room(backbone, args, kind, queries, icds, cache):
    """Stop before the first step if the teacher tensors not yet cached do not fit the free space of --teacher-cache:
    a ValueError naming the size, the folder, --teacher-cache and --no-teacher-cache (and what that costs)."""
    todo = [q for q in queries if not os.path.exists(teacher_file(args, cache, q, icds[q.id])[1])]
    if not todo:
        return 0
    sizes = query_tokens(backbone.processor, backbone.family, kind, todo)  # every query's tokens, no image loaded
    per_query = cache_file_bytes(args, backbone.model.config, sizes,
                                 autocast_dtype(next(backbone.model.parameters()).device))
    need, free = per_query * len(todo), shutil.disk_usage(args.teacher_cache).free
    cache["room"] = no_room(args, need, len(todo), len(queries))  # what a full disk mid-run says (teacher_states)
    if need > free:
        raise ValueError(no_room(args, need, len(todo), len(queries), free))
    return need


def no_room(args, need, todo, n_queries, free=None):
    """The sentence that names the cache's size, its folder (and its free space), --teacher-cache and
    --no-teacher-cache (and what that costs)."""
    return (f"the teacher cache needs {size(need)} for {todo} queries ({size(need / todo)} each) in "
            f"{args.teacher_cache}" + ("" if free is None else f", which has {size(free)} free") + "; give "
            f"--teacher-cache DIR on a disk with room, or --no-teacher-cache to recompute the teacher at every step "
            f"({args.epochs * n_queries} teacher forwards instead of {todo})")


def plan_backbone(args, family):
    """The processor and a meta-device model (no weights) of --model, its image setting, where each came from and the
    dtype of its weight files (the config's; the published checkpoints' bf16 for a short name; float32 built): a
    folder's own config.json and processor; for a short name model.PUBLISHED's config and the processor of --processor
    or of the local Hugging Face cache (the plan never reaches the hub); a tiny or toy backbone is built."""
    if M.is_built(args.model):
        backbone = M.load_backbone(args.model, image_splitting=args.image_splitting)
        return backbone.processor, backbone.model, backbone.images, f"{args.model} (built)", torch.float32
    if args.processor and not os.path.isdir(args.processor):
        raise ValueError(f"--processor {args.processor}: not a folder; give the folder of the checkpoint's tokenizer "
                         "and preprocessor files")
    folder = args.processor or (args.model if os.path.isdir(args.model) else None)
    if folder is None:  # the local Hugging Face cache's copy: the plan downloads nothing
        from huggingface_hub import snapshot_download
        hub_id = M.FAMILIES[family].hub_id
        try:
            folder = snapshot_download(hub_id, local_files_only=True)
        except Exception as e:  # LocalEntryNotFoundError and its kin: not cached here
            raise ValueError(f"--plan: the processor of {hub_id} is not in the local Hugging Face cache and the plan "
                             f"reaches no hub ({type(e).__name__}); pass --processor DIR, a folder with its tokenizer "
                             f"and preprocessor files (`hf download {hub_id} --exclude '*.safetensors'`)") from None
    config = M.read_config(args.model) if os.path.isdir(args.model) else None
    if config is not None:
        M.check_config(config, args.model)
    try:
        processor, images = M.load_processor(folder, family, args.image_splitting)
    except (AttributeError, ImportError) as e:  # another family's processor: lacks its settings, needs a video one
        raise ValueError(f"{'--processor' if args.processor else '--model'} {folder} is not a {family} processor "
                         f"({e})") from None
    model = M.published_model(family, config=config)  # on the meta device: no weights
    source = f'model.PUBLISHED["{family}"]' if config is None else f"{args.model}/config.json"
    M.context_limit(processor, model.config)
    file_dtype = getattr(torch, str(getattr(model.config, "dtype", None) or "bfloat16").split(".")[-1])
    return processor, model, images, f"config {source}, processor {folder}, no weights", file_dtype


def plan_rows(processor, family, kind, queries, icds, batch):
    """The sampled queries' rows collated as a run collates them, `batch` at a time: {"student": {id: tokens},
    "teacher": {id: tokens}, "query": {id: T_q}, "answers": {id: target tokens}, "images": {"student": [...],
    "teacher": [...]}, each batch's image_sizes}."""
    rows = {"student": {}, "teacher": {}, "query": {}, "answers": {}, "images": {"student": [], "teacher": []}}
    for start in range(0, len(queries), batch):
        qs = queries[start:start + batch]
        pieces = data.query_pieces(processor, family, kind, qs)
        for name, collated in (("student", data.student_batch(processor, family, kind, pieces)),
                               ("teacher", data.teacher_batch(processor, family, kind, pieces,
                                                              icds[start:start + batch]))):
            rows[name].update(zip((q.id for q in qs), collated["attention_mask"].sum(1).tolist()))
            rows["images"][name].append(image_sizes(collated))
        for q, (tokens, answers) in zip(qs, query_sizes(pieces)):
            rows["query"][q.id], rows["answers"][q.id] = tokens, answers
    return rows


def image_sizes(batch):
    """What the image modules of a collated batch run over, read off its pixel tensors as the builder made them:
    {"images": real images (all-zero padding images are dropped by the model), "pixels": [H, W] of each (its canvas),
    "bytes": the pixel tensors' bytes}."""
    pixels = batch["pixel_values"]
    flat = pixels.reshape(-1, *pixels.shape[-3:])
    real = flat.flatten(1).ne(0).any(1)
    return {"images": int(real.sum()), "pixels": tuple(pixels.shape[-2:]),
            "bytes": sum(v.nbytes for k, v in batch.items() if k.startswith("pixel"))}


def memory(config, params, adapter_params, rows, batch, shots, dtype, new_tokens, on_cpu, file_dtype, image_memory):
    """Estimated peak bytes of each part, of training and of evaluation (MEMORY_ASSUMPTIONS, every term here)."""
    text = config.get_text_config()
    b, L, d, i, heads = dtype.itemsize, text.num_hidden_layers, text.hidden_size, text.intermediate_size, \
        text.num_attention_heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * (getattr(text, "head_dim", None) or d // heads)
    t_s, t_t = max(rows["student"].values()), max(rows["teacher"].values())
    kept = L * batch * max(rows["query"].values()) * d * b   # the teacher's states at the query + target tokens

    def vision(sizes):  # the batch's pixels, a chunk's working set, every image's tower output and features
        patch = config.vision_config.patch_size
        patches = (sizes["pixels"][0] // patch) * (sizes["pixels"][1] // patch)
        one = M.image_work(config, patches, b)
        d_v = getattr(config.vision_config, "hidden_size", None) or config.vision_config.embed_dim
        chunk = min(sizes["images"], max(1, int(image_memory // one)))
        return sizes["bytes"] + sizes["images"] * (3 * sizes["pixels"][0] * sizes["pixels"][1] + patches * d_v) * b \
            + chunk * one

    def layer(tokens, cached=False):  # one decoder layer's working set and inputs, the bool mask (+ KV cache)
        return batch * tokens * (3 * i + 5 * d) * b + batch * tokens ** 2 + cached * 2 * L * batch * tokens * kv * b

    pixels = lambda name: max(s["bytes"] for s in rows["images"][name])
    worst = lambda name: max(vision(s) for s in rows["images"][name])
    out = {"weights": params * b, "adapter": adapter_params * 16, "runtime": RUNTIME if on_cpu else 0,
           "load": params * (b + file_dtype.itemsize) if on_cpu else params * b,
           "vision": worst("teacher"), "teacher": max(worst("teacher"), pixels("teacher") + layer(t_t) + kept),
           "student": max(worst("student"), pixels("student") + layer(t_s) + batch * t_s * L * (10 * d + 3 * i) * b)}
    out["train_loaded"] = out["runtime"] + out["weights"] + out["adapter"] + kept + max(out["teacher"], out["student"])
    evaluation = lambda tokens, name: out["runtime"] + out["weights"] + max(
        worst(name), pixels(name) + layer(tokens + new_tokens, cached=True))
    out["eval_adapter_loaded"], out["eval_icl_loaded"] = evaluation(t_s, "student"), evaluation(t_t, "teacher")
    for run in ("train", "eval_adapter", "eval_icl"):  # the peak: loading, or the run once loaded
        out[run] = max(out["runtime"] + out["load"], out[run + "_loaded"])
    return out


def plan(args, queries=None):
    """Print what a run of these flags costs, without loading weights: tokens per student and teacher row at the
    configured shots (the collated rows of a sample of the queries), the images the vision tower runs over, the teacher
    cache on disk (every query's tokens) and the peak memory of training and evaluation (MEMORY_ASSUMPTIONS) in the
    run's own dtype and device (--plan cuda | cpu). Returns the figures as a dict.
    queries: evaluate.py's items (ICDs then come from the training split); None: train.py's training queries."""
    family, kind, training = M.family_of(args.model), data.TASKS[args.task].kind, queries is None
    if training:
        queries, _, pool, shots = split_pool(args, family)
    else:
        shots = args.shots if args.shots else data.default_shots(args.task, family)
        pool = data.load_task(args.task, "train", args.data_root)
    processor, model, images, source, file_dtype = plan_backbone(args, family)
    config = model.config
    sample = queries[:PLAN_SAMPLE]
    icds = data.demonstrations([q.id for q in sample], pool, shots, args.seed)
    batch = min(args.batch_size, len(queries))  # a run's batches hold at most the queries there are
    rows = plan_rows(processor, family, kind, sample, icds, batch)
    dtype, on_cpu = autocast_dtype(args.plan), args.plan == "cpu"  # cuda: bf16; cpu: float32
    params = sum(p.numel() for p in model.parameters())
    adapter = sum(p.numel() for p in M.attach(model, args.method, **method_sizes(args)).parameters()) \
        if training else 0
    mem = memory(config, params, adapter, rows, batch, shots, dtype, data.TASKS[args.task].max_new_tokens, on_cpu,
                 file_dtype, args.image_memory * 1e9)
    mean = lambda values: sum(values) / len(values)
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"
    print(f"plan: {args.model} on {args.task}, {len(queries)} queries, {shots} shots, batch {batch}, "
          f"{str(dtype).split('.')[-1]} ({'a CPU' if on_cpu else 'a CUDA'} run); {source}")
    if images:
        print(images)
    seen = max(rows["images"]["teacher"], key=lambda s: s["images"])
    print(f"tokens a row ({len(sample)} queries encoded): student {mean(rows['student'].values()):.0f} mean, "
          f"{max(rows['student'].values())} max; teacher ({shots} ICDs) {mean(rows['teacher'].values()):.0f} mean, "
          f"{max(rows['teacher'].values())} max; query + target T_q {mean(rows['query'].values()):.1f} mean; a "
          f"teacher batch's images: {seen['images']} of {seen['pixels'][0]} x {seen['pixels'][1]} pixels (as collated)")
    figures = {"rows": rows, "memory": mem, "shots": shots, "dtype": dtype, "queries": len(queries)}
    print(f"weights: {count(params)} parameters = {size(mem['weights'])} (loading: {size(mem['load'])})"
          + (f"; adapter ({args.method}) {count(adapter)} parameters" if training else ""))
    if training:
        sizes = query_tokens(processor, family, kind, queries)  # every query's tokens, no image loaded
        figures["cache"] = plan_cache(args, config, sizes, dtype, 2 * params * mean(rows["teacher"].values()))
        print(f"peak memory, training: ~{size(mem['train'])} (weights {size(mem['weights'])} + max(teacher "
              f"{size(mem['teacher'])}, student {size(mem['student'])}; vision in them {size(mem['vision'])}) + "
              f"adapter {size(mem['adapter'])}" + (f" + runtime {size(mem['runtime'])}" if on_cpu else "") + ")")
    print(f"peak memory, evaluation at batch {batch}: ~{size(mem['eval_adapter'])} with the adapter or "
          f"zero-shot, ~{size(mem['eval_icl'])} for {shots}-shot ICL")
    print(MEMORY_ASSUMPTIONS.format(dtype=str(dtype).split(".")[-1], file=str(file_dtype).split(".")[-1],
                                    budget=size(args.image_memory * 1e9)))
    return figures


def plan_cache(args, config, sizes, dtype, teacher_flops=None):
    """Print and return the planned teacher cache of the run's queries (sizes: their query_sizes), against the free
    space of --teacher-cache (or of the nearest folder above it that exists); and, given the FLOPs of one query's
    teacher forward, whether reading a query's file back costs less than recomputing its teacher (read_or_recompute)."""
    n_queries = len(sizes)
    if args.anchor == "none":
        print(f"teacher cache: none (--anchor none: {args.method} trains without a teacher)")
        return 0
    per_query = cache_file_bytes(args, config, sizes, dtype)
    total = per_query * n_queries
    folder = args.teacher_cache
    while not os.path.isdir(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    writable = os.access(folder, os.W_OK | os.X_OK)
    versus = read_or_recompute(folder, per_query, teacher_flops) if teacher_flops and writable else None
    if args.no_teacher_cache:
        print(f"teacher cache: none (--no-teacher-cache: {args.epochs * n_queries} teacher forwards instead of "
              f"{n_queries}; it would take {size(total)})")
        print(versus or "", end="\n" if versus else "")
        return total
    free, text = shutil.disk_usage(folder).free, config.get_text_config()
    tensor = "logits answer tokens x vocabulary" if args.anchor == "kl" else \
        f"states {text.num_hidden_layers} layers x T_q x {text.hidden_size}"
    print(f"teacher cache: {size(total)} for {n_queries} queries ({size(per_query)} each: {tensor} in "
          f"{str(dtype).split('.')[-1]}; {size(per_query * 1000)} per 1,000) in {args.teacher_cache}; {size(free)} "
          "free there"
          + ("" if total <= free else " -- it does NOT fit: give --teacher-cache DIR or --no-teacher-cache")
          + ("" if writable else f" -- {folder} is NOT writable: give --teacher-cache DIR"))
    print(versus or "", end="\n" if versus else "")
    return total


ACCELERATOR_TFLOPS = 400  # what an H200 sustains in bf16 on these forwards (an estimate; its dense peak is ~990)


def read_or_recompute(folder, per_query, teacher_flops, probe=64 << 20):
    """The plan's line on which costs less a query in later epochs: reading its cached teacher tensor back
    (per_query bytes at the speed this folder's disk reads a file that is not in memory: a probe file written,
    flushed, dropped from the page cache and read once) or recomputing its teacher forward (teacher_flops, about 2 x
    parameters x teacher-row tokens, at ACCELERATOR_TFLOPS)."""
    path = data.tmp_name(os.path.join(folder, "read-probe"))
    try:
        data.atomic_write(path, lambda f: f.write(os.urandom(probe)))
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # Linux: the clean pages leave the page cache
            start = time.perf_counter()
            while f.read(8 << 20):
                pass
            speed = probe / (time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.remove(path)
    read, compute = per_query / speed, teacher_flops / (ACCELERATOR_TFLOPS * 1e12)
    return (f"teacher cache or recomputing, a query: reading its file back ~{read * 1e3:.3g} ms ({folder} reads "
            f"{speed / 1e6:.0f} MB/s, measured), recomputing its teacher ~{compute * 1e3:.3g} ms "
            f"({teacher_flops / 1e12:.3g} TFLOP at ~{ACCELERATOR_TFLOPS} TFLOP/s, an H200's estimate): "
            + ("reading is cheaper" if read <= compute else "recomputing is cheaper here (--no-teacher-cache), unless "
               "the accelerator is slower than that"))


# -------------------------------------------------------------------------------------- checkpoints and run folders

def save_run(run):
    """Everything a resumed run needs, written to <out>/last.pt (by the first process alone under torchrun)."""
    if rank_and_world()[0] != 0:
        return
    state = {"adapter": M.adapter_modules(run.backbone.model).state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "progress": run.progress, "args": vars(run.args),
             "rng": torch.get_rng_state(), "processes": rank_and_world()[1]}
    data.atomic_write(os.path.join(run.args.out, "last.pt"), lambda f: torch.save(state, f))


RESUME_MUST_MATCH = ("model", "task", "method", "image_splitting", "shots", "icds", "rices_encoder", "n_train",
                     "n_heldout", "epochs", "batch_size", "grad_accum", "lr", "weight_decay", "warmup", "clip", "rank",
                     "virtual_tokens", "kappa", "lam", "anchor", "anchor_norm", "temperature", "seed")


def restore(args, backbone, optimizer, scheduler):
    """Load <out>/last.pt into the run; refuse if it was made with other settings."""
    path = os.path.join(args.out, "last.pt")
    if not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")  # not rank 0's GPU on every process
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ValueError(f"--resume: {path} is unreadable (truncated or corrupt: {e}); start over with "
                         "--overwrite") from e
    differ = [f"--{k.replace('_', '-')} {state['args'][k]} (now {getattr(args, k)})" for k in RESUME_MUST_MATCH
              if state["args"].get(k) != getattr(args, k)]
    if state.get("processes", 1) != rank_and_world()[1]:
        differ.append(f"{state.get('processes', 1)} processes (now {rank_and_world()[1]}; a resume is exact only "
                      "with as many as before)")
    if differ:
        raise SystemExit(f"--resume: {path} was made with " + ", ".join(differ))
    M.adapter_modules(backbone.model).load_state_dict(state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["progress"]


def claim(args):
    """Make --out this run's folder: one that holds another run is refused unless --resume (continue it) or
    --overwrite (its run files are deleted first, so none of them is left beside the new run's). Temporary files of
    interrupted writes are cleaned up here and in the teacher cache."""
    found = [f for f in ("last.pt", "adapter.safetensors", "history.json") if os.path.exists(os.path.join(args.out, f))]
    if found and not (args.resume or args.overwrite):
        raise ValueError(f"{args.out} holds a run ({', '.join(found)}); continue it with --resume or replace it "
                         "with --overwrite")
    if rank_and_world()[0] != 0:
        return
    for f in found if args.overwrite else []:
        os.remove(os.path.join(args.out, f))
    data.remove_stale_tmp(args.out)
    data.remove_stale_tmp(args.teacher_cache)


@contextlib.contextmanager
def locked(folder):
    """Hold `folder` (made if need be) for this process: an advisory lock (fcntl.flock) on <folder>/.lock, holding our
    pid. A second process (train.py or evaluate.py) on the same folder stops at once with a ValueError naming the folder
    and the holder's pid. The lock goes with the process, so a killed run (kill -9 included) leaves none behind. Under
    torchrun the first process holds it for all of them."""
    if rank_and_world()[0] != 0:
        yield
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"--out {folder}: cannot make the folder ({e.strerror or e})") from e
    path = os.path.join(folder, ".lock")
    fd, made = open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"{folder} is in use by another run (pid {holder}); wait for it to finish or choose "
                         "another --out") from None
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as e:
            if made:
                os.remove(path)  # ours, empty: not left behind
            raise OSError(f"could not write the lock file {path} ({e.strerror or e})") from e
        yield
    finally:
        os.close(fd)


def open_lock(path):
    """(descriptor of the lock file at `path`, whether this call made it); an OSError naming it if it cannot be.
    Made exclusively (O_EXCL), so only the process that made the file may remove it."""
    for made, verb, exclusive in ((True, "make", os.O_EXCL), (False, "open", 0)):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | exclusive, 0o666), made
        except FileExistsError:  # only with O_EXCL: someone made it first, open it
            continue
        except OSError as e:
            raise OSError(f"could not {verb} the lock file {path} ({e.strerror or e})") from e


# --------------------------------------------------------------------------------------------------------- torchrun

@contextlib.contextmanager
def process_group():
    """Under torchrun (WORLD_SIZE set), join the process group for a while: NCCL, one GPU a process, or gloo on CPU."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_and_world():
    """(rank, number of processes): (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gathered(local):
    """The union of every process's dict (`local` itself without torchrun)."""
    if not dist.is_initialized():
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def data_parallel(model, args, n_train):
    """The backbone in DistributedDataParallel, synchronising the adapter's parameters only (the frozen backbone is
    neither broadcast nor reduced). Every micro-batch must give each process at least one query."""
    world = dist.get_world_size()
    smallest = min(args.batch_size, n_train % args.batch_size or args.batch_size)
    if smallest < world:
        raise ValueError(f"{world} processes need at least {world} queries in every micro-batch; the smallest has "
                         f"{smallest} (--batch-size {args.batch_size}, {n_train} training queries)")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad] + [n for n, _ in model.named_buffers()]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=devices)


# ----------------------------------------------------------------------------------------------------- command line

def parse_args(argv=None):
    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The module docstring as written, and every flag's default."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--model", default="toy-idefics2", help="backbone: idefics2, idefics, llava-interleave, "
                   "llava-onevision, tiny-<one of those> (offline twin, random weights), toy-idefics2 (meta-trained "
                   "to learn in context: the shipped reference copy), a toy backbone's file (--build-toy), or a local "
                   "checkpoint path")
    p.add_argument("--task", default="toy-icl-colour", choices=list(data.TASKS), help="task (toy-icl-* need no "
                   "download and can only be solved from demonstrations)")
    p.add_argument("--method", default="hyper-icl", choices=list(M.METHODS), help="what is learned: hyper-icl "
                   "(gated logit bias), static-layer / static-layer-head (its gate a learned constant per layer / per "
                   "layer and head, Fig 3a), output-level (the same module on the attention output, Table 11), "
                   "hificl (virtual key-values), mimic (MimIC), live (LIVE), lora (LoRA via peft); each trains with "
                   "its own loss (see --anchor)")
    p.add_argument("--shots", type=int, help="ICDs per query for the teacher (paper: 8 for Idefics2 and the "
                   "LLaVA models, 32 for Idefics; 2 on MME and SEED: data.default_shots)")
    add_icd_flags(p)
    add_plan_flags(p)
    p.add_argument("--n-train", type=int, default=PAPER["n_train"], help="training queries (paper: 1000)")
    p.add_argument("--n-heldout", type=int, default=32, help="queries held out of the training pool to pick the "
                   "best epoch (by their loss; the evaluation split is never used)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training queries (paper: best epoch "
                   "reported, count not stated)")
    p.add_argument("--batch-size", type=int, default=4, help="queries per micro-batch (paper: not stated)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step")
    p.add_argument("--lr", type=float, default=PAPER["lr"], help="AdamW learning rate, the same for every method "
                   "(paper: 5e-3; the baselines' own code: MimIC 1e-5 and its LoRA 5e-4 in src/config/peft/, "
                   "LIVE 1e-3 or 5e-3 in its README runs)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (paper: not stated)")
    p.add_argument("--warmup", type=float, default=PAPER["warmup"], help="fraction of steps of linear warm-up "
                   "before the cosine decay (paper: 0.1)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (not in the paper)")
    p.add_argument("--rank", type=int, help="adapter rank r (default 4 for hyper-icl and its variants, 8 for "
                   "hificl, 16 for lora; mimic and live have none)")
    p.add_argument("--virtual-tokens", type=int, default=8, help="HiFICL's n virtual key-value pairs")
    p.add_argument("--kappa", type=float, default=PAPER["kappa"],
                   help="curvature magnitude of the Lorentz model (paper: 0.1)")
    p.add_argument("--lam", type=float, default=PAPER["lam"], help="lambda, weight of the cross-entropy next to the "
                   "distillation loss, which has weight 1 (Eq 17; paper: 0.5; MimIC: ce_loss_weight 0.5 with "
                   "align_loss_weight 1, github.com/Kamichanw/MimIC src/config/peft/mimic.yaml; LIVE: "
                   "hard_loss_weight 0.5 with the KL at weight 1, github.com/ForJadeForest/"
                   "LIVE-Learnable-In-Context-Vector README and icv_src/icv_module.py)")
    p.add_argument("--anchor", choices=["hyperbolic", "euclidean", "mse", "kl", "none"],
                   help="the distillation loss (default: the method's own: hyperbolic for hyper-icl, static-* and "
                   "output-level, mse for mimic, kl for live, none for hificl and lora). hyperbolic: Eq 16; "
                   "euclidean: L2-anchor (Table 4); mse: MimIC's layer-wise MSE of the hidden states at the query "
                   "tokens (MimIC src/shift_model.py); kl: LIVE's T^2 KL(teacher || student) over the vocabulary "
                   "at the answer positions (LIVE icv_src/icv_module.py); none: cross-entropy only")
    p.add_argument("--anchor-norm", choices=["none", "first"], default="none", help="none: the paper's Eq 17; first: "
                   "the distillation loss divided by its value at the first step (before any update), so that it "
                   "starts at 1 beside lambda x CE instead of hundreds of times larger (not in the paper)")
    p.add_argument("--temperature", type=float, default=1.0, help="T of --anchor kl (LIVE divides both logits by "
                   "T and scales the KL by T^2; its value is not in LIVE's public files)")
    p.add_argument("--seed", type=int, default=0, help="seed of the query split, ICD draw, order and adapter init")
    p.add_argument("--data-root", help="folder with the datasets (layout: see data.py / README)")
    p.add_argument("--out", help="output folder (default runs/<model>-<task>-<method>)")
    p.add_argument("--teacher-cache", help="folder of cached teacher states (default <out>/teacher)")
    p.add_argument("--no-teacher-cache", action="store_true", help="recompute the teacher at every step (epochs x "
                   "queries teacher forwards instead of one per query; no disk)")
    p.add_argument("--save-every", type=int, default=50, help="also checkpoint every this many steps")
    p.add_argument("--max-steps", type=int, help="stop after this many optimiser steps (the schedule still "
                   "spans all epochs; --resume continues)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from <out>/last.pt")
    again.add_argument("--overwrite", action="store_true", help="replace the run in --out (without it, a folder "
                       "that holds a run is refused)")
    p.add_argument("--benchmark", action="store_true", help="time this run with and without teacher reuse "
                   "and print the ratio (writes to temporary folders)")
    build = p.add_argument_group("building the toy backbone (instead of training an adapter)")
    build.add_argument("--build-toy", action="store_true", help="meta-train a toy-idefics2 from scratch, seeds --seed, "
                       "--seed + 1, ... until one learns in context on held-out episodes; write it to --out (default "
                       f"{TOY_BUILD_OUT}); use it with --model <that file>")
    build.add_argument("--build-tries", type=int, default=3, help="seeds to try before giving up")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: one for the tiny and toy backbones "
                   "on CPU, which more threads only slow down on a busy machine, and for --build-toy, whose bytes "
                   "then repeat on the same machine; else torch's own choice)")
    add_worker_flag(p)
    args = p.parse_args(argv)
    args.rank = DEFAULT_RANK.get(args.method, PAPER["rank"]) if args.rank is None else args.rank
    args.anchor = args.anchor or DEFAULT_ANCHOR.get(args.method, "hyperbolic")
    check_at_least(p, args, {"rank": 1, "virtual_tokens": 1, "n_train": 1, "n_heldout": 1, "epochs": 1,
                             "batch_size": 1, "grad_accum": 1, "save_every": 1, "max_steps": 1, "shots": 0,
                             "build_tries": 1, "threads": (1, MAX_THREADS), "seed": (0, MAX_SEED),
                             "workers": (0, MAX_WORKERS)})
    if not 0 <= args.warmup < 1:
        p.error(f"--warmup must be a fraction of the steps in [0, 1) (got {args.warmup})")
    check_floats(p, args)
    if not 0 < args.image_memory < math.inf:
        p.error(f"--image-memory must be a finite number > 0 (in GB; got {args.image_memory})")
    args.out = args.out or (TOY_BUILD_OUT if args.build_toy else default_out(args.model, args.task, args.method))
    args.teacher_cache = args.teacher_cache or os.path.join(args.out, "teacher")
    check_folders(p, {"--out": None if args.build_toy else args.out, "--teacher-cache": args.teacher_cache,
                      "--rices-cache": args.rices_cache})
    return args


def diverging(args):
    """The settings of this run that can make its loss NaN or inf, with their values, as the stop names them."""
    names = ["lr", "weight_decay", "clip", "lam"] + (["kappa"] if args.anchor == "hyperbolic" else []) + \
        (["temperature"] if args.anchor == "kl" else []) + (["anchor_norm"] if args.anchor_norm != "none" else [])
    return ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names)


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
    p.add_argument("--workers", type=int, default=data.default_workers(), help="DataLoader worker processes that "
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
    p.add_argument("--image-memory", type=float, default=M.IMAGE_MEMORY / 1e9, help="GB the vision tower and "
                   "Idefics2's connector may hold at once: they encode a batch's images in chunks of as many as fit "
                   "(model.image_work; at least one), the same numbers as one call; the plan counts one chunk")
    p.add_argument("--processor", help="--plan: a local folder with the checkpoint's tokenizer and preprocessor "
                   "files, for a short --model name whose processor is not in the local Hugging Face cache")
    p.add_argument("--image-splitting", default="checkpoint", choices=M.IMAGE_SPLITTING, help="Idefics2: split each "
                   "image into 4 crops + the whole image (5 x 64 tokens instead of 64: 4x the teacher cache) as the "
                   "checkpoint's preprocessor_config.json says (idefics2-8b-base most likely off, idefics2-8b on), "
                   "or on / off")


def default_out(model, task, method):
    """The default output folder of a run: runs/<model>-<task>-<method>."""
    return os.path.join("runs", f"{os.path.basename(model.rstrip('/'))}-{task}-{method}")


def benchmark(args):
    """Time the same run with and without teacher reuse; print both and the ratio (not a test: a measurement)."""
    times = {}
    for reuse in (False, True):
        with tempfile.TemporaryDirectory() as out:
            run = argparse.Namespace(**{**vars(args), "out": out, "teacher_cache": os.path.join(out, "teacher"),
                                        "no_teacher_cache": not reuse, "benchmark": False})
            start = time.perf_counter()
            train(run)
            times[reuse] = time.perf_counter() - start
    print(f"{args.epochs} epochs: teacher recomputed every step {times[False]:.1f} s, computed once "
          f"{times[True]:.1f} s; speed-up x{times[False] / times[True]:.2f}")
    return times


def check_build_out(path, overwrite):
    """Refuse, before the minutes-long build, an --out that the build could not be written to or used from: not a
    .safetensors name (--model takes no other), a folder, an existing file without --overwrite, a path under a
    file, or a folder that cannot be written (tried with a temporary file)."""
    if not M.is_toy_file(path):
        raise ValueError(f"--out {path}: a toy backbone must be a .safetensors file (--model takes no other); "
                         f"name it e.g. {path}.safetensors")
    if os.path.isdir(path):
        raise ValueError(f"--out {path} is a folder; name the file to write, e.g. "
                         f"{os.path.join(path, 'backbone.safetensors')}")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"--out {path} exists; pass --overwrite to replace it, or another --out")
    folder = above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"--out {path}: {above} is a file, not a folder; choose another --out")
    try:
        os.makedirs(folder, exist_ok=True)
        probe = data.tmp_name(path)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write in {folder} ({e.strerror or e}); choose a writable --out") from e


def main(argv=None):
    args = parse_args(argv)
    if args.build_toy:  # a toy-idefics2 that learns in context at --out (an existing file needs --overwrite)
        check_build_out(args.out, args.overwrite)
        return build_toy(args.out, {**TOY_RECIPE, "seed": args.seed}, args.build_tries, args.threads or 1)
    if args.plan:
        return plan(args)
    M.choose_threads(args.model, args.threads)
    if args.benchmark:
        return benchmark(args)
    with process_group(), locked(args.out):
        claim(args)
        return train(args)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, FloatingPointError) as e:  # bad input or a diverged run: the message, no traceback
        sys.exit(f"error: {e}")
