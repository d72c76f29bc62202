"""What is not in the paper around the anchor: --anchor-norm first's divisor and the anchor's scale on a backbone."""
import torch
import torch.distributed as dist
from tqdm import tqdm

from lab.models import backbones
from lab.methods import registry
from lab.run import runs, torchrun


def before_training(run, loss):
    """What runs before the first step beside the paper: --anchor-norm first's divisor (initial_anchor, kept in the
    run's progress) and, on a fresh run, the anchor's scale on this backbone (anchor_regime), on the run's first
    micro-batch (runs.first_pair). loss(student, teacher): their loss parts (train.py's losses)."""
    cfg = run.cfg
    if cfg.anchor_norm == "first" and registry.ANCHORS[cfg.anchor].loss and "anchor_scale" not in run.progress:
        run.progress["anchor_scale"] = initial_anchor(runs.first_pair(run, share=True), loss)
    if registry.ANCHORS[cfg.anchor].regime and not cfg.resume:
        anchor_regime(cfg.anchor, cfg.kappa, *runs.first_pair(run))


@torch.no_grad()
def initial_anchor(batch, loss):
    """--anchor-norm first: L_anchor of this process's share of the first micro-batch before any step (the adapter at
    its identity start; batch: (student, teacher), loss: train.py's losses of a batch), the constant the anchor is
    then divided by, so that it starts at 1 beside lambda L_sup. Not in the paper."""
    anchor = loss(*batch)["anchor"].detach().float()
    if dist.is_initialized():
        dist.all_reduce(anchor)  # the processes' shares add up to the global mean times the number of processes
        anchor /= torchrun.rank_and_world()[1]
    if not anchor > 0:
        raise FloatingPointError(f"--anchor-norm first: the first step's anchor is {anchor.item()}, "
                                 "nothing to divide by")
    tqdm.write(f"--anchor-norm first: the anchor is divided by its first-step value {anchor.item():.4g}")
    return anchor.item()


def anchor_regime(anchor, kappa, student, teacher):
    """Print the anchor's scale on this backbone (The anchor regime, README): sqrt(kappa)|LN(h)| (|LN(h)| = sqrt(d)),
    the noise floor (the loss between the teacher states and their own rounding to the training dtype, and to bf16)
    and the loss between the teacher states of different queries."""
    span, dtype, d = student["query_target"], backbones.autocast_dtype(student["input_ids"].device), teacher.shape[-1]
    own = registry.ANCHORS[anchor]
    reads = {"kappa": kappa} if "kappa" in own.reads else {}  # the regime's anchors read at most kappa
    loss = lambda states: f"{own.loss(states, teacher, span, **reads).item():.4g}"  # to the teacher's
    shuffled = teacher.roll(1, dims=1) if span.shape[0] > 1 and (span == span.roll(1, 0)).all() else None
    unrelated = "" if shuffled is None else f"; between different queries' teacher states {loss(shuffled)}"
    print(f"anchor ({anchor}, kappa {kappa}, d {d}): sqrt(kappa)|LN(h)| = {(kappa * d) ** 0.5:.1f}; "
          f"noise floor (teacher states vs their own rounding to {str(dtype).split('.')[-1]}, the training dtype) "
          f"{loss(teacher.to(dtype).float())}, to bfloat16 {loss(teacher.to(torch.bfloat16).float())}{unrelated}")
