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
import functools
import math
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

import data
import lorentz
import model as M
from lorentz import euclidean_anchor_loss, hyperbolic_anchor_loss
from lab import (backbones, checkpoints, feed, files, plan, rices, tasks, teacher_cache, torchrun, toy_backbone,
                 train_cli)


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
    sup = M.supervised_loss(logits, labels)                               # L_sup: CE per target token (not in paper)
    anchor = torchrun.share_of_global_mean(anchor, span.any(1).sum()) / anchor_scale  # torchrun; --anchor-norm (not in paper)
    sup = torchrun.share_of_global_mean(sup, M.answer_positions(labels).sum())
    return {"anchor": anchor, "sup": sup, "loss": anchor + args.lam * sup}  # Eq 17


def losses(backbone, args, student, teacher, model=None, anchor_scale=1.0):
    """The training loss of one micro-batch: Hyper-ICL's (hyper_icl_loss), or a baseline's own (baseline_loss).
    student: the student batch (data.student_batch); teacher: what micro_batch gives for args.anchor. model: what runs
    the student (the DistributedDataParallel wrapper under torchrun; default backbone.model). anchor_scale: what the
    anchor is divided by (--anchor-norm first: its value at the first step; the paper: 1)."""
    run = lambda: M.target_logits(model or backbone.model, student)     # the LM head at the answer window only
    with backbones.autocast(student["input_ids"].device):
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
    answers = M.answer_positions(labels)                               # [B, K] bool: predicts a target token
    sup = torchrun.share_of_global_mean(M.supervised_loss(logits, labels), answers.sum())
    if args.anchor == "none":
        return {"sup": sup, "loss": sup}
    if args.anchor == "kl":
        anchor = torchrun.share_of_global_mean(answer_kl(logits[answers], teacher, args.temperature), answers.sum())
    else:
        anchor = LAYER_ANCHORS[args.anchor](torch.stack(h), teacher, span, args)
        anchor = torchrun.share_of_global_mean(anchor, span.any(1).sum())
    anchor = anchor / anchor_scale
    return {"anchor": anchor, "sup": sup, "loss": anchor + args.lam * sup}


@torch.no_grad()
def initial_anchor(backbone, args, kind, queries, icds, device, cache):
    """--anchor-norm first: L_anchor of the first micro-batch before any step (the adapter at its identity start),
    the constant the anchor is then divided by, so that it starts at 1 beside lambda L_sup. Not in the paper."""
    rank, world = torchrun.rank_and_world()
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


def anchor_regime(args, student, teacher):
    """Print the anchor's scale on this backbone (The anchor regime, README): sqrt(kappa)|LN(h)| (|LN(h)| = sqrt(d)),
    the noise floor (the loss between the teacher states and their own rounding to the training dtype, and to bf16)
    and the loss between the teacher states of different queries."""
    span, dtype, d = student["query_target"], backbones.autocast_dtype(student["input_ids"].device), teacher.shape[-1]
    loss = lambda states: f"{LAYER_ANCHORS[args.anchor](states, teacher, span, args).item():.4g}"  # to the teacher's
    shuffled = teacher.roll(1, dims=1) if span.shape[0] > 1 and (span == span.roll(1, 0)).all() else None
    unrelated = "" if shuffled is None else f"; between different queries' teacher states {loss(shuffled)}"
    print(f"anchor ({args.anchor}, kappa {args.kappa}, d {d}): sqrt(kappa)|LN(h)| = {(args.kappa * d) ** 0.5:.1f}; "
          f"noise floor (teacher states vs their own rounding to {str(dtype).split('.')[-1]}, the training dtype) "
          f"{loss(teacher.to(dtype).float())}, to bfloat16 {loss(teacher.to(torch.bfloat16).float())}{unrelated}")


# ------------------------------------------------------------------------------------------------------ the teacher


@torch.no_grad()
def run_teacher(backbone, kind, queries, icds, pieces, device, output="states", batch=None):
    """The frozen teacher on [ICDs; query + target], no adapter: per query, its states [L, T_q, d] at the query + target
    tokens; output="logits" (LIVE's teacher): its logits at the answer positions, [n_answer, V] in float32. They stay
    on `device`. batch: their teacher batch, when a DataLoader worker made it already (data.teacher_batch)."""
    batch = backbones.to_device(batch or data.teacher_batch(backbone.processor, backbone.family, kind, pieces, icds), device)
    with M.without_adapter(backbone.model), backbones.autocast(device):
        if output == "logits":
            logits, labels = M.target_logits(backbone.model, batch)
            answer = M.answer_positions(labels)
            return [logits[b, answer[b]].float() for b in range(len(queries))]
        inputs = {**data.model_inputs(batch), "logits_to_keep": 1, "use_cache": False}  # no logits, no KV cache
        kept = M.layer_outputs(backbone.model, keep=batch["query_target"], **inputs)[1]  # L x [sum of T_q, d]
    ends = batch["query_target"].sum(1).cumsum(0).tolist()
    return [torch.stack([h[end - n:end] for h in kept]) for end, n in zip(ends, batch["query_target"].sum(1).tolist())]


def teacher_states(backbone, args, kind, queries, icds, pieces, device, cache):
    """Each query's teacher states (its answer logits for --anchor kl), from the cache when present (computed and
    stored once otherwise). A cached tensor must have the shape of states [L, T_q, d] or logits [answer tokens, any]."""
    found = teacher_cache.cached_states(args, cache, teacher_cache.teacher_shape(backbone.model), queries, icds, pieces)
    return completed_states(backbone, args, kind, queries, icds, pieces, device, cache, found)


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
                files.write_cache(found["paths"][i], {output: s.cpu()}, found["keys"][i] + output)
            except OSError as e:  # a full disk mid-run: the same sentence as the room check before the first step
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                room = cache.get("room", f"the teacher cache in {args.teacher_cache} needs {plan.size(s.nbytes)} a "
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
    setup = Setup(backbone.processor, backbone.family, kind, args, cache, teacher_cache.teacher_shape(backbone.model))
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
    found = teacher_cache.cached_states(s.args, s.cache, s.shape, queries, icds, pieces)
    missing = [i for i, state in enumerate(found["states"]) if state is None]
    teacher = data.teacher_batch(s.processor, s.family, s.kind, [pieces[i] for i in missing],
                                 [icds[i] for i in missing]) if missing else None
    return out | {"found": found, "teacher": teacher}


def finished(backbone, args, kind, prepared, device, cache):
    """(student batch, teacher tensor for args.anchor) of a prepared micro-batch on `device`: the missing teacher
    states computed there, the cached ones copied there; laid at the student's aligned positions (stack_teacher)."""
    student = {**backbones.to_device(prepared["student"], device), "window": data.answer_window(prepared["student"]["labels"])}
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
                  {k: run.cache[k] for k in ("id", "images")}, teacher_cache.teacher_shape(run.backbone.model))
    return feed.prepared(functools.partial(prepared_micro_batch, setup), specs, run.args.workers, run.device)


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
            checkpoints.save_run(run)
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
                                     f"checkpoint is untouched. Settings that can cause it: {train_cli.diverging(run.args)}; "
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
        checkpoints.save_run(run)


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
    queries, heldout, pool, shots = tasks.split_pool(args, M.family_of(args.model))
    backbone = backbones.load_backbone(args.model, device=device, image_splitting=args.image_splitting,
                               image_memory=args.image_memory * 1e9)
    if backbone.images:
        print(backbone.images)
    icds = dict(zip((q.id for q in queries), rices.choose_demonstrations(backbone, args, queries, pool, shots)))
    try:
        params = M.attach(backbone.model, args.method, **train_cli.method_sizes(args)).parameters()
    except RuntimeError as e:  # torch.OutOfMemoryError too: a --rank or --virtual-tokens too large for memory
        raise ValueError(f"the {args.method} adapter of {train_cli.method_sizes(args)} does not fit in memory "
                         f"({str(e).splitlines()[0][:160]}); lower --rank or --virtual-tokens") from e
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    student_model = torchrun.data_parallel(backbone.model, args, len(queries)) if torchrun.rank_and_world()[1] > 1 else None
    steps_per_epoch = math.ceil(math.ceil(len(queries) / args.batch_size) / args.grad_accum)
    total = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, round(args.warmup * total)), total)  # Section 4.1
    os.makedirs(args.teacher_cache, exist_ok=True)
    progress = checkpoints.restore(args, backbone, optimizer, scheduler) if args.resume else \
        {"step": 0, "best": math.inf, "history": []}
    cache = {"id": checkpoints.fingerprint(backbone), "hits": 0, "misses": 0, "images": plan.image_key(backbone.processor)}
    kind = data.TASKS[args.task].kind
    if args.anchor != "none" and not args.no_teacher_cache:
        plan.check_cache_room(backbone, args, kind, queries, icds, cache)
    if args.anchor_norm == "first" and args.anchor != "none" and "anchor_scale" not in progress:
        progress["anchor_scale"] = initial_anchor(backbone, args, kind, queries, icds, device, cache)
    if args.anchor in ("hyperbolic", "euclidean") and not args.resume:
        first = [queries[i] for i in epoch_order(len(queries), args.batch_size, args.seed, 0)[0]]
        anchor_regime(args, *micro_batch(backbone, args, kind, first, [icds[q.id] for q in first], device, cache))
    bar = tqdm(total=total, initial=progress["step"], desc="train", dynamic_ncols=True, disable=torchrun.rank_and_world()[0] > 0)
    return Run(args, backbone, kind, queries, heldout, icds, device, cache, optimizer, scheduler, student_model,
               progress, steps_per_epoch, bar)


def remaining_steps(run, epoch):
    """The optimiser steps of `epoch` not taken yet (a resumed run starts where its checkpoint left off), each as its
    micro-batches of queries: this process's share of each under torchrun."""
    order = epoch_order(len(run.queries), run.args.batch_size, run.args.seed, epoch)
    (rank, world), accum = torchrun.rank_and_world(), run.args.grad_accum
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
        checkpoints.save_run(run)
        run.bar.close()
        sys.exit(f"interrupted: saved step {run.progress['step']} to {run.args.out}/last.pt ({str(e) or 'Ctrl-C'}); "
                 "continue with --resume")
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_of_epoch(run, epoch):
    """Score the held-out queries; keep the best epoch's adapter as <out>/adapter.safetensors. The epoch enters the
    history only once its adapter is saved, so a run stopped in between scores it again."""
    progress, first = run.progress, torchrun.rank_and_world()[0] == 0
    loss = heldout_loss(run.backbone, run.args, run.kind, run.heldout, run.device)
    if loss < progress["best"]:
        if first:
            checkpoints.save_adapter(os.path.join(run.args.out, "adapter.safetensors"), run.backbone)
        progress["best"] = loss
    progress["history"].append({"epoch": epoch + 1, "step": progress["step"], "heldout_loss": loss})
    if first:
        tqdm.write(f"epoch {epoch + 1}: held-out loss {loss:.4f} (best {progress['best']:.4f})")


@torch.no_grad()
def heldout_loss(backbone, args, kind, heldout, device):
    """The supervised loss of the held-out queries, which picks the best epoch. Under torchrun each process scores
    every N-th batch; the batches' values are gathered and summed in order."""
    rank, world = torchrun.rank_and_world()
    starts, totals = range(0, len(heldout), args.batch_size), {}
    mine = starts[rank::world]
    build = functools.partial(feed.student_rows, backbone.processor, backbone.family, kind)
    for i, batch in zip(mine, feed.prepared(build, [heldout[i:i + args.batch_size] for i in mine], args.workers,
                                            device)):
        with backbones.autocast(device):
            loss = M.supervised_loss(*M.target_logits(backbone.model, backbones.to_device(batch, device)))
        totals[i] = loss, len(batch["labels"])
    totals = {i: loss.item() * n for i, (loss, n) in totals.items()}  # read after the last forward
    totals = torchrun.gathered(totals)
    return sum(totals[i] for i in starts) / len(heldout)


def finish(run):
    """Final checkpoint, history.json and the summary line (the first process's); returns the adapter's parameters."""
    checkpoints.save_run(run)
    run.bar.close()
    if torchrun.rank_and_world()[0] == 0:
        progress, cache = run.progress, run.cache
        files.write_json(os.path.join(run.args.out, "history.json"), progress["history"], indent=1)
        best = os.path.join(run.args.out, "adapter.safetensors")
        print(f"done: {progress['step']} steps; teacher states computed {cache['misses']}, reused {cache['hits']}; "
              + (f"best adapter: {best}" if os.path.exists(best) else "no epoch scored yet, so no best adapter "
                 "(continue with --resume)"))
    return {k: v.detach().clone() for k, v in M.adapter_modules(run.backbone.model).state_dict().items()}


def epoch_order(n, batch_size, seed, epoch):
    """The batches of one epoch: a permutation that depends only on (seed, epoch), so a resumed run sees the same."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


# ----------------------------------------------------------------------------------------------------- command line


def parse_args(argv=None):
    """train.py's flags (lab/train_cli.py), their defaults the paper's settings above."""
    return train_cli.parse_args(argv, __doc__, PAPER, DEFAULT_RANK, DEFAULT_ANCHOR)


def main(argv=None):
    args = parse_args(argv)
    if args.build_toy:  # a toy-idefics2 that learns in context at --out (an existing file needs --overwrite)
        train_cli.check_build_out(args.out, args.overwrite)
        return toy_backbone.build_toy(args.out, {**toy_backbone.TOY_RECIPE, "seed": args.seed}, args.build_tries, args.threads or 1)
    if args.plan:
        return plan.plan(args)
    backbones.choose_threads(args.model, args.threads)
    if args.benchmark:
        return train_cli.benchmark(args, train)
    with torchrun.process_group(), checkpoints.locked(args.out):
        checkpoints.claim(args)
        return train(args)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, FloatingPointError) as e:  # bad input or a diverged run: the message, no traceback
        sys.exit(f"error: {e}")
