"""A training run's plumbing around train.py's loop, one call away from it: what the loop's helpers share (Run), the
state before the first step (a resumed checkpoint, the teacher cache and its room, the progress bar), each epoch's
steps (resumed, torchrun's share, prepared by DataLoader workers), the NaN stop, a step counted whole, the progress
shown and checkpointed, the save on Ctrl-C or SIGTERM, the held-out loss, the best epoch's adapter written, and the
end of the run."""
import contextlib
import functools
import itertools
import math
import os
import signal
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

import model as M
from lab.disk import files
from lab.models import backbones, families
from lab.methods import registry
from lab.run import adapter_files, prefetch, resume, shard, teacher_cache, torchrun, training_batches


@dataclass
class Run:
    """What the training loop's wrappers share; `progress` is what last.pt saves beside the adapter and AdamW."""
    cfg: object               # train.py's Config (what plumbing reads of it: --out, --epochs, --save-every...)
    backbone: families.Backbone
    queries: list             # training queries
    heldout: list             # held-out queries, which pick the best epoch
    icds: dict                # query id -> its demonstrations (fixed for the run)
    kind: str                 # the task's kind (tasks.spec): how its prompts and answers are written
    device: str
    optimizer: torch.optim.Optimizer
    scheduler: object
    student_model: object     # what runs the student: the DistributedDataParallel wrapper under torchrun, else None
    cache: dict               # the teacher cache (teacher_cache.identity): its keys, tensor, folder; hits, misses
    progress: dict            # step, best held-out loss, history (one entry per scored epoch), anchor_scale
    steps_per_epoch: int
    record: dict = None       # what made the run (adapter_files.run_record), which last.pt and the adapter keep
    bar: tqdm = None          # the progress bar (the first process's)
    stop: str = None          # the signal that asked the run to stop (saved_on_interrupt), read between steps
    updating: bool = False    # inside an optimiser update (updating): its parameters are between two steps
    regime: bool = False      # the anchor's scale on the backbone is still to be shown (training_batches.pair)


def attached(backbone, method, sizes):
    """The parameters of a fresh `method` adapter of `sizes` (registry.sizes) attached to the backbone, as a list;
    one too large for memory is a ValueError naming --rank and --virtual-tokens."""
    try:
        return list(registry.attach(backbone.model, method, **sizes).parameters())
    except RuntimeError as e:  # torch.OutOfMemoryError too: a --rank or --virtual-tokens too large for memory
        raise ValueError(f"the {method} adapter of {sizes} does not fit in memory "
                         f"({str(e).splitlines()[0][:160]}); lower --rank or --virtual-tokens") from e


def start(cfg, backbone, device, data_, optimizer, scheduler):
    """The run before its first step: torchrun's DistributedDataParallel over the adapter, a resumed run's checkpoint
    (--resume), the teacher cache (a stop if it would not fit its folder: check_cache_room), the progress bar.
    data_: (training queries, held-out queries, their ICDs, the task's kind)."""
    queries, heldout, icds, kind = data_
    student_model = (torchrun.data_parallel(backbone.model, cfg.batch_size, len(queries))
                     if torchrun.rank_and_world()[1] > 1 and not shard.is_sharded(backbone.model) else None)
    os.makedirs(cfg.teacher_cache, exist_ok=True)
    record = adapter_files.run_record(cfg, queries, heldout, icds)
    progress = resume.restore(cfg.out, backbone, optimizer, scheduler, record) if cfg.resume else \
        {"step": 0, "best": math.inf, "history": []}
    anchor = registry.ANCHORS[cfg.anchor]
    cache = teacher_cache.identity(backbone, cfg.task, anchor.teacher, None if cfg.no_teacher_cache else
                                   cfg.teacher_cache)
    if anchor.teacher and cache["folder"]:
        teacher_cache.check_cache_room(backbone, kind, queries, icds, cache, cfg.epochs)
    run = Run(cfg, backbone, queries, heldout, icds, kind, device, optimizer, scheduler, student_model, cache,
              progress, epoch_steps(len(queries), cfg.batch_size, cfg.grad_accum), record=record,
              regime=anchor.regime and not cfg.resume)
    run.bar = tqdm(total=run.steps_per_epoch * cfg.epochs, initial=progress["step"], desc="train", dynamic_ncols=True,
                   disable=torchrun.rank_and_world()[0] > 0)
    return run


def epoch_steps(n_train, batch_size, grad_accum):
    """Optimiser steps in one pass over n_train queries: --batch-size queries a micro-batch, --grad-accum a step."""
    return math.ceil(math.ceil(n_train / batch_size) / grad_accum)


def warmup_steps(warmup, total):
    """The linear warm-up's steps (Section 4.1): --warmup's share of the run's `total` steps, rounded; a run too short
    for one (10% of its steps rounds to 0) has none, so its first step runs at the full learning rate."""
    return round(warmup * total)


def epoch_order(n, batch_size, seed, epoch):
    """The batches of one epoch: a permutation that depends only on (seed, epoch), so a resumed run sees the same."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def remaining_steps(run, epoch):
    """The optimiser steps of `epoch` not taken yet (a resumed run starts where its checkpoint left off), each as its
    micro-batches, one at a time (training_batches.prepared: the student's rows, what the teacher cache holds and the
    teacher batch of what it lacks, made ahead by --workers DataLoader workers), this process's share of each under
    torchrun."""
    order = epoch_order(len(run.queries), run.cfg.batch_size, run.cfg.seed, epoch)
    (rank, world), accum = torchrun.rank_and_world(), run.cfg.grad_accum
    steps = [[[run.queries[i] for i in idx[rank::world]] for idx in order[s * accum:(s + 1) * accum]]
             for s in range(run.progress["step"] - epoch * run.steps_per_epoch, run.steps_per_epoch)]
    specs = [(qs, [run.icds[q.id] for q in qs]) for step in steps for qs in step]
    prepared = shard.teacher_in_step(run, training_batches.prepared(run, specs, run.cfg.workers))
    for step in steps:
        yield itertools.islice(prepared, len(step))  # drawn one by one by the loop: one teacher tensor at a time


def at_max_steps(run):
    """Whether --max-steps steps are taken (the schedule still spans every epoch; --resume continues)."""
    return run.cfg.max_steps is not None and run.progress["step"] >= run.cfg.max_steps


@contextlib.contextmanager
def step(run, parts):
    """The plumbing around one optimiser update (the loop's clipping, AdamW's step, the schedule and zero_grad, in the
    with): before it, the step's loss parts (summed on the device) read once, the one host sync of a step, a NaN or
    inf stopping the run (naming the step, the part and the settings that can cause it); during it, marked as under
    way (run.updating), so that no error or second signal saves half of it; after it, counted, shown with its loss
    parts and learning rate, checkpointed every --save-every steps, and stopped if a signal asked for it
    (at_boundary)."""
    parts = dict(zip(parts, torch.stack(list(parts.values())).tolist()))
    for name, value in parts.items():
        if not math.isfinite(value):
            raise FloatingPointError(f"step {run.progress['step'] + 1}: loss part {name!r} is {value}; stopping. The "
                                     "last good checkpoint is untouched. Settings that can cause it: "
                                     f"{diverging(run.cfg)}; try a lower value of one of them (--lr first)")
    run.updating = True
    if shard.is_sharded(run.backbone.model):  # DistributedDataParallel's part: the adapter's gradients averaged
        shard.average_gradients(list(M.adapter_modules(run.backbone.model).parameters()))
    yield
    run.progress["step"] += 1
    run.updating = False
    run.bar.update()
    run.bar.set_postfix({k: f"{v:.4g}" for k, v in parts.items()} | {"lr": f"{run.scheduler.get_last_lr()[0]:.2g}",
                                                                       "teacher passes": run.cache["misses"]})
    if run.progress["step"] % run.cfg.save_every == 0:
        resume.save_run(run)
    at_boundary(run)


class Stopped(Exception):
    """A signal asked the run to stop (raised at the next step boundary: at_boundary)."""


@contextlib.contextmanager
def saved_on_interrupt(run):
    """Ctrl-C or SIGTERM (a scheduler's kill warning) only sets a flag, which the loop reads between steps
    (at_boundary), so the run is saved at a step boundary wherever the signal lands, and exits naming --resume; a
    second one stops within the step (its last completed step saved). A run that dies of an error saves its last
    completed step too."""
    def on_signal(signum, frame):
        if run.stop:  # the second: at once (the last completed step saved)
            raise KeyboardInterrupt(signal.Signals(signum).name)
        run.stop = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except (Stopped, KeyboardInterrupt) as e:
        for s in previous:  # no signal cuts the save short
            signal.signal(s, signal.SIG_IGN)
        run.bar.close()
        if run.updating:  # a second signal inside an optimiser update: half of it is not saved
            sys.exit(f"interrupted inside step {run.progress['step'] + 1}'s update: not saved; {run.cfg.out}/last.pt "
                     "holds the last save; continue with --resume")
        resume.save_run(run)
        sys.exit(f"interrupted: saved step {run.progress['step']} to {run.cfg.out}/last.pt "
                 f"({run.stop or str(e) or 'Ctrl-C'}); continue with --resume")
    except Exception as e:  # the state is the last completed step's (the step under way changed no parameter)
        if not run.updating:
            saved_after_error(run, e)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def saved_after_error(run, error):
    """Save the run's last completed step after `error` stopped it, saying so; a save that fails too (the same full
    disk) is reported beside the error, which stays the one raised."""
    try:
        resume.save_run(run)
    except OSError as e:
        tqdm.write(f"could not save the run after the error below: {e}")
    else:
        if torchrun.rank_and_world()[0] == 0:
            tqdm.write(f"saved step {run.progress['step']} to {run.cfg.out}/last.pt before stopping "
                       f"({type(error).__name__}); continue with --resume once the cause is fixed")


def at_boundary(run, agreed=True):
    """Between two steps: stop (Stopped) if a signal asked for it (saved_on_interrupt); under torchrun all processes
    stop at the same boundary (agreed: any process's signal stops them all)."""
    if agreed and torchrun.rank_and_world()[1] > 1 and torchrun.any_of(bool(run.stop)):
        run.stop = run.stop or "a signal to another process"
    if run.stop:
        raise Stopped(run.stop)


def keep_adapter(run, loss):
    """The best epoch so far (its held-out `loss` below every earlier one's): its adapter written to
    <out>/adapter.safetensors (by the first process), the loss kept as the one to beat."""
    if torchrun.rank_and_world()[0] == 0:
        adapter_files.save_adapter(os.path.join(run.cfg.out, "adapter.safetensors"), run.backbone, run.record)
    run.progress["best"] = loss


def end_of_epoch(run, epoch, loss):
    """An epoch scored: its held-out loss enters the history (only now, after the best adapter is written: a run
    stopped in between scores the epoch again), and the run is checkpointed."""
    progress = run.progress
    progress["history"].append({"epoch": epoch + 1, "step": progress["step"], "heldout_loss": loss})
    if torchrun.rank_and_world()[0] == 0:
        tqdm.write(f"epoch {epoch + 1}: held-out loss {loss:.4f} (best {progress['best']:.4f})")
    resume.save_run(run)
    at_boundary(run)


@torch.no_grad()
def heldout_loss(run):
    """The supervised loss of the held-out queries, which picks the best epoch. Under torchrun each process scores
    every N-th batch; the batches' values are gathered and summed in order."""
    backbone, cfg, heldout, device = run.backbone, run.cfg, run.heldout, run.device
    world = torchrun.rank_and_world()[1]
    starts, totals = range(0, len(heldout), cfg.batch_size), {}
    mine = shard.share(starts, backbone.model)
    build = functools.partial(prefetch.student_rows, backbone.processor, backbone.family, run.kind)
    for i, batch in zip(mine, prefetch.prepared(build, [heldout[i:i + cfg.batch_size] for i in mine], cfg.workers,
                                            device)):
        with backbones.autocast(device):
            loss = M.supervised_loss(*M.target_logits(backbone.model, backbones.to_device(batch, device)))
        totals[i] = loss, len(batch["labels"])
        if world == 1:  # scoring changes nothing: a signal stops it at any batch (torchrun's wait for the epoch end)
            at_boundary(run, agreed=False)
    totals = torchrun.gathered({i: loss.item() * n for i, (loss, n) in totals.items()})  # read after the last forward
    return sum(totals[i] for i in starts) / len(heldout)


def keep_partial(run):
    """A run that --max-steps stopped before its first epoch was scored: its held-out loss scored now and its adapter
    kept as the best so far, its run record saying so ("partial": the step and that loss), so that a smoke run leaves
    an adapter to evaluate. The run's progress is left as it is: --resume goes on exactly as it would have, and its
    first scored epoch replaces this adapter."""
    loss = heldout_loss(run)
    if torchrun.rank_and_world()[0] == 0:
        record = {**run.record, "partial": {"step": run.progress["step"], "heldout_loss": loss}}
        adapter_files.save_adapter(os.path.join(run.cfg.out, "adapter.safetensors"), run.backbone, record)
        tqdm.write(f"--max-steps {run.cfg.max_steps}: stopped before an epoch was scored; held-out loss {loss:.4f}, "
                   "the adapter kept as a partial run's (--resume continues)")


def finish(run):
    """Final checkpoint, history.json and the summary line (the first process's); returns the adapter's parameters.
    A run that --max-steps stopped before any epoch was scored keeps its adapter first (keep_partial)."""
    if at_max_steps(run) and not run.progress["history"]:
        keep_partial(run)
    resume.save_run(run)
    run.bar.close()
    if torchrun.rank_and_world()[0] == 0:
        progress, cache = run.progress, run.cache
        files.write_json(os.path.join(run.cfg.out, "history.json"), progress["history"], indent=1)
        best = os.path.join(run.cfg.out, "adapter.safetensors")
        print(f"done: {progress['step']} steps; teacher states computed {cache['misses']}, reused {cache['hits']}; "
              + (f"best adapter: {best}" + ("" if progress["history"] else " (a partial run's: no epoch scored yet; "
                                             "--resume continues)") if os.path.exists(best) else
                 f"its best adapter {best} is missing (removed since it was written?): train again with --overwrite"))
    return {k: v.detach().clone() for k, v in M.adapter_modules(run.backbone.model).state_dict().items()}


def diverging(args):
    """The settings of this run that can make its loss NaN or inf, with their values, as the stop names them."""
    names = ["lr", "weight_decay", "clip", "lam", *registry.ANCHORS[args.anchor].reads] + \
        (["anchor_norm"] if args.anchor_norm != "none" else [])
    return ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names)
