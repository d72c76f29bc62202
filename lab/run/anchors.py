"""The distillation losses besides the paper's Eq 16 and what is not in the paper around it: the baselines' own
losses (Table 4's Euclidean anchor, MimIC's layer-wise MSE, LIVE's KL), --anchor-norm first and the anchor's scale on
a backbone. train.py's `losses` calls `baseline_loss` for every --anchor but hyperbolic."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import lorentz
import model as M
from lab.models import backbones
from lab.run import runs, torchrun


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


# The anchors on the layer states h^(l): (student, teacher [L, B, W, d], span [B, W], kappa); Eq 16 trains in train.eq17
LAYER_ANCHORS = {"hyperbolic": lorentz.hyperbolic_anchor_loss,
                 "euclidean": lambda s, t, span, kappa: lorentz.euclidean_anchor_loss(s, t, span),      # L2, Table 4
                 "mse": lambda s, t, span, kappa: layerwise_mse(s, t, span)}                            # MimIC


def baseline_loss(cfg, logits, labels, h, teacher, span, anchor_scale=1.0):
    """A baseline's loss, L_anchor + lambda L_sup with its own L_anchor: Table 4's Euclidean anchor, MimIC's layer-wise
    MSE, LIVE's KL at the answer positions (teacher: [n_answers, V]), or none (L = L_sup: HiFICL, LoRA). h: the
    student's layer states [L, B, W, d] (None for kl and none); logits, labels: at its answer window."""
    answers = M.answer_positions(labels)                               # [B, K] bool: predicts a target token
    sup = torchrun.share_of_global_mean(M.supervised_loss(logits, labels), answers.sum())
    if cfg.anchor == "none":
        return {"sup": sup, "loss": sup}
    if cfg.anchor == "kl":
        anchor = torchrun.share_of_global_mean(answer_kl(logits[answers], teacher, cfg.temperature), answers.sum())
    else:
        anchor = LAYER_ANCHORS[cfg.anchor](h, teacher, span, cfg.kappa)
        anchor = torchrun.share_of_global_mean(anchor, span.any(1).sum())
    anchor = anchor / anchor_scale  # --anchor-norm first: by its first-step value (initial_anchor); none: by 1
    return {"anchor": anchor, "sup": sup, "loss": anchor + cfg.lam * sup}


def before_training(run, loss):
    """What runs before the first step beside the paper: --anchor-norm first's divisor (initial_anchor, kept in the
    run's progress) and, on a fresh run, the anchor's scale on this backbone (anchor_regime), on the run's first
    micro-batch (runs.first_pair). loss(student, teacher): their loss parts (train.py's losses)."""
    cfg = run.cfg
    if cfg.anchor_norm == "first" and cfg.anchor != "none" and "anchor_scale" not in run.progress:
        run.progress["anchor_scale"] = initial_anchor(runs.first_pair(run, share=True), loss)
    if cfg.anchor in ("hyperbolic", "euclidean") and not cfg.resume:
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
    loss = lambda states: f"{LAYER_ANCHORS[anchor](states, teacher, span, kappa).item():.4g}"  # to the teacher's
    shuffled = teacher.roll(1, dims=1) if span.shape[0] > 1 and (span == span.roll(1, 0)).all() else None
    unrelated = "" if shuffled is None else f"; between different queries' teacher states {loss(shuffled)}"
    print(f"anchor ({anchor}, kappa {kappa}, d {d}): sqrt(kappa)|LN(h)| = {(kappa * d) ** 0.5:.1f}; "
          f"noise floor (teacher states vs their own rounding to {str(dtype).split('.')[-1]}, the training dtype) "
          f"{loss(teacher.to(dtype).float())}, to bfloat16 {loss(teacher.to(torch.bfloat16).float())}{unrelated}")
