"""Training: distil what a frozen teacher does with demonstrations into an adapter the student runs without them.

Hyper-ICL (Eq 16-17): the teacher (backbone, no adapter, no gradient) reads [ICDs; query + target]; the student
(backbone + adapter) reads [query + target]; loss = L_H-anchor over every decoder layer's own output
(model.layer_outputs) at the query's tokens + lambda * cross-entropy on the target. HiFICL: cross-entropy only,
no teacher.

The teacher's states depend only on the query and its fixed ICDs: computed once, then cached (lab/run/teacher_cache.py).
`<out>/last.pt` is written every epoch and on Ctrl-C, SIGTERM or an error; --resume continues bit-for-bit
(lab/run/runs.py); `<out>/adapter.safetensors` is the best epoch's adapter.

    python train.py                                   # the default: toy-idefics2 on toy-icl-colour, CPU
    python train.py --model idefics2 --task vqav2 --data-root /data
    python -m lab build-toy                           # meta-train a toy-idefics2 of your own (probed, ~5 min)
    python -m lab train --help                        # every flag: the harness's too (RICES, caches, --proceed)
"""
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

import torch
from transformers import get_cosine_schedule_with_warmup

import data
import model as M
from lab.datasets import rices, tasks
from lab.models import backbones, families
from lab.methods import registry
from lab.run import (adapter_files, anchor_scale, locks, prefetch, proceed, resume, runs, shard, torchrun,
                     training_batches)
from lab.cli import harness, train_cli


@dataclass
class Config(harness.TrainSettings):
    """The paper's settings and one run's; each field a train.py flag, its value the default, its comment the help
    (lab/cli/flags.py). The harness's settings (lab/cli/harness.py) are inherited with their defaults: flags of
    `python -m lab train` only."""
    # what is trained, on what
    model: str = "toy-idefics2"       # backbone: a name (lab/models/published.py, tiny-*, toy-idefics2), file, folder
    task: str = "toy-icl-colour"      # data.TASKS, or one's own: a .jsonl, a folder, a LLaVA .json (README)
    method: registry.Name = "hyper-icl"  # what is learned (adapters.py); each trains with its own --anchor
    # the paper's settings (Section 4.1)
    n_train: int = 1000               # training queries
    lr: float = 5e-3                  # AdamW, every method (the baselines' code: MimIC 1e-5, LoRA 5e-4, LIVE 1e-3)
    warmup: float = 0.1               # fraction of the steps of linear warm-up, then cosine decay to 0
    kappa: float = 0.1                # curvature magnitude of the Lorentz model (Eq 10)
    lam: float = 0.5                  # lambda: the weight of L_sup beside the anchor's 1 (Eq 17; MimIC, LIVE: 0.5)
    rank: Optional[int] = None        # r of U_q, U_k (Eq 6): 4; None: the method's own (RANKS, filled())
    anchor: Optional[Literal[tuple(registry.ANCHORS)]] = None  # None: the method's (ANCHORS)
    shots: Optional[int] = None       # the teacher's ICDs per query; None: data.default_shots (8 for Idefics2)
    icds: Literal["random", "rices"] = "random"  # how ICDs are chosen: random, or rices (lab/datasets/rices.py)
    # not stated in the paper
    n_heldout: int = 32               # queries held out of the training pool to pick the best epoch
    epochs: int = 3                   # passes over the training queries (the best epoch is kept)
    batch_size: int = 4               # queries per micro-batch
    grad_accum: int = 1               # micro-batches per optimiser step
    weight_decay: float = 0.0         # AdamW's
    clip: float = 1.0                 # gradient norm clipping
    virtual_tokens: int = 8           # HiFICL's n virtual key-value pairs
    temperature: float = 1.0          # T of LIVE's KL
    seed: int = 0                     # the query split, ICD draw, order and adapter init
    image_splitting: Literal[families.IMAGE_SPLITTING] = "checkpoint"  # Idefics2's image crops: as the checkpoint says
    # files: the data, the run's folder
    data_root: Optional[str] = None    # the datasets' folder (data.py, README)
    out: Optional[str] = None          # None: runs/<model>-<task>-<method> (lab/cli/train_cli.py)
    max_steps: Optional[int] = None    # stop after this many steps (the schedule spans every epoch; --resume goes on)
    resume: bool = False               # continue from <out>/last.pt
    overwrite: bool = False            # replace the run in --out (without it a folder holding a run is refused)
    # the machine
    threads: Optional[int] = None      # CPU threads for torch (None: one for the tiny and toy backbones on CPU)
    workers: int = field(default_factory=prefetch.default_workers)  # DataLoader workers that prepare batches

    def filled(self):
        """This config with the method's own rank and anchor where none is given (lab/methods/registry.py): each
        method trains with its own loss (HiFICL and LoRA the task loss only, MimIC its layer-wise MSE, LIVE its KL;
        the rest Eq 16)."""
        own = registry.METHODS[self.method]
        return replace(self, rank=own.rank if self.rank is None else self.rank, anchor=self.anchor or own.anchor)


# ---------------------------------------------------------------------------------------------- the loss (Eq 16-17)

def eq17(anchor, sup, lam):
    """Eq 17: L = L_H-anchor + lambda L_sup, L_H-anchor the mean squared geodesic distance of Eq 16
    (lorentz.hyperbolic_anchor_loss) and L_sup the cross-entropy of the target tokens; another --anchor's L_anchor
    (Table 4, the baselines) is summed the same way."""
    return anchor + lam * sup


def losses(backbone, cfg, student, teacher, model=None, progress=None):
    """Eq 17 on one micro-batch (student batch, teacher tensor: training_batches.pair): the student's forward with the
    adapter; L_anchor, Eq 16 or --anchor's (lab/methods/registry.py; none: L = L_sup); L_sup; under torchrun each as
    this process's share of the global mean; with --anchor-norm first (not in the paper), L_anchor over its value on
    the run's first micro-batch (kept in `progress`). model: what runs the student (default backbone.model).

    Eq 16 compares h^(l), every decoder layer's own output (model.layer_outputs), of the student (query only, with the
    adapter) and the teacher (with the ICDs) at query_target, the query's and its target's tokens, which both rows
    hold (data.collate). A choice: the paper says "the query tokens", and the target is part of both rows."""
    anchor = registry.ANCHORS[cfg.anchor]
    forward = lambda: M.target_logits(model or backbone.model, student)  # the LM head at the answer window only
    with backbones.autocast(student["input_ids"].device):
        (logits, labels), h = M.layer_outputs(backbone.model, forward) if anchor.teacher == "states" else \
            (forward(), None)
    answers = M.answer_positions(labels)                                 # [B, K] bool: predicts a target token
    sup = torchrun.share_of_global_mean(M.supervised_loss(logits, labels), answers.sum())  # L_sup, per target token
    if anchor.loss is None:
        return {"sup": sup, "loss": sup}
    reads, query_target = {k: getattr(cfg, k) for k in anchor.reads}, student["query_target"]
    if anchor.teacher == "states":  # h^(l) with the adapter, [L, B, W, d]: Eq 16, mean d_L^2 per query, then queries
        L_anchor, n = anchor.loss(torch.stack(h), teacher, query_target, **reads), query_target.any(1).sum()
    else:                           # the answer positions' logits (LIVE's KL): the mean over them
        L_anchor, n = anchor.loss(logits[answers], teacher, **reads), answers.sum()
    L_anchor = torchrun.share_of_global_mean(L_anchor, n)
    if cfg.anchor_norm == "first":  # not in the paper: the anchor over its first micro-batch's value, then kept
        if "anchor_scale" not in progress:
            progress["anchor_scale"] = anchor_scale.initial_anchor(L_anchor)
        L_anchor = L_anchor / progress["anchor_scale"]
    return {"anchor": L_anchor, "sup": sup, "loss": eq17(L_anchor, sup, cfg.lam)}


# ------------------------------------------------------------------------------------------------------ the teacher


@torch.no_grad()
def run_teacher(backbone, batch, output="states"):
    """The frozen teacher, no adapter, on a teacher batch [ICDs; query + target] (data.teacher_batch): per row, its
    states [L, T_q, d] at the query + target tokens, every decoder layer's own output h'^(l) (Eq 12-16); "logits"
    (LIVE's teacher): its logits at the answer positions, [n_answer, V] in float32; "both": {"states", "logits"} of
    each row from one forward (what the loop caches, for every distilling method of a task). On the device."""
    device = backbone.model.device
    batch = backbones.to_device(batch, device)
    with M.without_adapter(backbone.model), backbones.autocast(device):
        if output == "states":  # no logits, no KV cache
            inputs = {**data.model_inputs(batch), "logits_to_keep": 1, "use_cache": False}
            kept = M.layer_outputs(backbone.model, keep=batch["query_target"], **inputs)[1]  # L x [sum of T_q, d]
        else:  # the logits of the answer window, the states beside them
            (logits, labels), kept = M.layer_outputs(backbone.model, lambda: M.target_logits(backbone.model, batch),
                                                     keep=batch["query_target"])
            answers = [logits[b, a].float() for b, a in enumerate(M.answer_positions(labels))]
            if output == "logits":
                return answers
    ends, sizes = batch["query_target"].sum(1).cumsum(0).tolist(), batch["query_target"].sum(1).tolist()
    states = [torch.stack([h[end - n:end] for h in kept]) for end, n in zip(ends, sizes)]
    return states if output == "states" else [{"states": s, "logits": a} for s, a in zip(states, answers)]


# --------------------------------------------------------------------------------------------------------- the loop

def train(cfg, load=None):
    """Minimise Eq 17 over the adapter's parameters only (the backbone stays frozen): AdamW with linear warm-up and
    cosine decay, --epochs passes, the adapter of the best epoch (the lowest held-out loss) kept; the plumbing one
    call away (lab/run/runs.py). Returns the final adapter's parameters. load: what loads the backbone (None:
    backbones.load_backbone; a table's runner hands in one that loads it once for all its runs)."""
    # the data (first: it fails fast), the backbone, each training query's demonstrations (fixed for the run)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    queries, heldout, pool, shots = tasks.split_pool(cfg, families.family_of(cfg.model))
    backbone = shard.loading(load, cfg.model, cfg.shard)(cfg.model, device=device, image_splitting=cfg.image_splitting,
                                                         image_memory=cfg.image_memory * 1e9)
    if backbone.images:
        print(backbone.images)
    icds = dict(zip((q.id for q in queries), rices.choose_demonstrations(backbone, cfg, queries, pool, shots)))
    kind = tasks.spec(cfg.task).kind
    # the adapter (identity at its start: Eq 5-8), AdamW, linear warm-up then cosine decay to 0 (Section 4.1)
    sizes = registry.sizes(cfg.method, cfg.rank, cfg.virtual_tokens)  # --rank, --virtual-tokens: those it takes
    adapter = runs.attached(backbone, cfg.method, sizes)
    optimizer = torch.optim.AdamW(adapter, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = runs.epoch_steps(len(queries), cfg.batch_size, cfg.grad_accum) * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, runs.warmup_steps(cfg.warmup, total), total)
    # the run's plumbing: torchrun's DDP, a resumed checkpoint, the teacher cache and its room, the progress bar
    run = runs.start(cfg, backbone, device, (queries, heldout, icds, kind), optimizer, scheduler)
    with runs.saved_on_interrupt(run):  # Ctrl-C or SIGTERM: saved at the next step boundary, --resume continues
        for epoch in range(len(run.progress["history"]), cfg.epochs):  # an epoch counts once it is scored
            for step in runs.remaining_steps(run, epoch):  # a step's micro-batches, prepared by DataLoader workers
                if runs.at_max_steps(run):
                    return runs.finish(run)
                parts = {}
                for prepared in step:  # the student's rows, the teacher's states the cache holds, a batch of the rest
                    # the teacher: each query's states and logits computed once, in the first epoch, then cached
                    computed = run_teacher(backbone, prepared["teacher"], "both") if prepared["teacher"] else []
                    student, h_teacher = training_batches.pair(run, prepared, computed)  # on the device, aligned
                    part = losses(backbone, cfg, student, h_teacher, run.student_model, run.progress)  # Eq 17
                    (part["loss"] / cfg.grad_accum).backward()
                    parts = {k: parts.get(k, 0) + v.detach() / cfg.grad_accum for k, v in part.items()}
                with runs.step(run, parts):  # a NaN stops the run before it; counted, shown and saved after it
                    torch.nn.utils.clip_grad_norm_(adapter, cfg.clip)  # --clip (not in the paper)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            loss = runs.heldout_loss(run)  # L_sup of the held-out queries
            if loss < run.progress["best"]:  # the best epoch's adapter is the one kept (Section 4.1)
                runs.keep_adapter(run, loss)  # <out>/adapter.safetensors
            runs.end_of_epoch(run, epoch, loss)  # the epoch in the history, checkpointed
        return runs.finish(run)  # last.pt, history.json, the summary line


# ----------------------------------------------------------------------------------------------------- command line


def parse_args(argv=None):
    """train.py's flags (lab/cli/train_cli.py), the fields Config itself writes, their defaults a Config's; each
    method's own rank and anchor filled. A flag of lab's (a harness setting, another mode) names its new command."""
    return train_cli.parse_args(argv, __doc__, Config(), shown=Config.__annotations__, script=True).filled()


def main(argv=None, load=None):
    """python train.py [flags]: one training run in --out. The harness's flags and the other modes are lab's
    (`python -m lab train`, `python -m lab plan train`, ...: lab/cli/commands.py). load: as train's."""
    return launch(parse_args(argv), load)


def launch(cfg, load=None):
    """One training run of the parsed flags `cfg` in cfg.out, the folder locked (--proceed: started, continued or,
    finished, skipped). load: as train's."""
    backbones.choose_threads(cfg.model, cfg.threads)
    with torchrun.process_group(), locks.locked(cfg.out):
        run = proceed.proceeding(cfg) if cfg.proceed else cfg
        if run is None:  # --proceed, and the run is finished
            print(f"{cfg.out}: a finished run of these settings (its last.pt, history.json); nothing to train")
            return adapter_files.read_tensors(os.path.join(cfg.out, "adapter.safetensors"))
        resume.claim(run)
        return train(run, load)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, FloatingPointError) as e:  # bad input or a diverged run: the message, no traceback
        sys.exit(f"error: {e}")
