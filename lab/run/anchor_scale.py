"""What is not in the paper around the anchor: --anchor-norm first's divisor, taken by train.py's losses from the
loop's first micro-batch, and the anchor's scale on a backbone, shown from the run's first pair
(training_batches.pair)."""
import torch
import torch.distributed as dist
from tqdm import tqdm

from lab.models import backbones
from lab.methods import registry
from lab.run import torchrun


@torch.no_grad()
def initial_anchor(anchor):
    """--anchor-norm first: L_anchor of the run's first micro-batch before any step (the adapter at its identity
    start; `anchor`: this process's share of it, as the loss assembles it), the constant the anchor is then divided
    by, so that it starts at 1 beside lambda L_sup. Not in the paper."""
    anchor = anchor.detach().float()
    if dist.is_initialized():
        dist.all_reduce(anchor)  # the processes' shares add up to the global mean times the number of processes
        anchor /= torchrun.rank_and_world()[1]
    if not anchor > 0:
        raise FloatingPointError(f"--anchor-norm first: the first step's anchor is {anchor.item()}, "
                                 "nothing to divide by")
    tqdm.write(f"--anchor-norm first: the anchor is divided by its first-step value {anchor.item():.4g}")
    return anchor.item()


def anchor_regime(anchor, kappa, query_target, teacher):
    """Print the anchor's scale on this backbone (The anchor regime, README): sqrt(kappa)|LN(h)| (|LN(h)| = sqrt(d)),
    the noise floor (the loss between the teacher states and their own rounding to the training dtype, and to bf16)
    and the loss between the teacher states of different queries. teacher: [L, B, W, d] at query_target [B, W]."""
    dtype, d, own = backbones.autocast_dtype(query_target.device), teacher.shape[-1], registry.ANCHORS[anchor]
    reads = {"kappa": kappa} if "kappa" in own.reads else {}  # the regime's anchors read at most kappa
    loss = lambda states: f"{own.loss(states, teacher, query_target, **reads).item():.4g}"  # to the teacher's
    same = query_target.shape[0] > 1 and (query_target == query_target.roll(1, 0)).all()
    unrelated = f"; between different queries' teacher states {loss(teacher.roll(1, dims=1))}" if same else ""
    tqdm.write(f"anchor ({anchor}, kappa {kappa}, d {d}): sqrt(kappa)|LN(h)| = {(kappa * d) ** 0.5:.1f}; "
               f"noise floor (teacher states vs their own rounding to {str(dtype).split('.')[-1]}, the training dtype) "
               f"{loss(teacher.to(dtype).float())}, to bfloat16 {loss(teacher.to(torch.bfloat16).float())}{unrelated}")
