"""Training: distil what a frozen teacher does with demonstrations into an adapter the student runs without them.

Hyper-ICL (Eq 16-17): the teacher (backbone, no adapter, no gradient) reads [ICDs; query + target]; the student
(backbone + adapter) reads [query + target]; loss = L_H-anchor over every decoder layer's own output
(model.layer_outputs) at the query's tokens + lambda * cross-entropy on the target. HiFICL: cross-entropy only,
no teacher.

The teacher's states depend only on the query and its (fixed) ICDs, so they are computed once, in the first
epoch, and read back from a cache in later ones; the cache key covers the backbone's weights, the task, the
query, its ICDs and the prompt format, so a change of any of them recomputes. Nothing is lost on interruption:
`<out>/last.pt` (adapter, optimiser, schedule, step) is written atomically every epoch, every --save-every steps
and on Ctrl-C, and --resume continues bit-for-bit; `<out>/adapter.safetensors` is the best epoch's adapter.

    python train.py                                   # the embedded default: tiny Idefics2 twin on toy-vqa, CPU
    python train.py --model idefics2 --task vqav2 --data-root /data
"""
import argparse
import hashlib
import json
import math
import os
import random
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import data
import model as M
from lorentz import euclidean_anchor_loss, hyperbolic_anchor_loss


def parse_args(argv=None):
    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The module docstring as written, and every flag's default."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--model", default="tiny-idefics2", help="backbone: idefics2, idefics, llava-interleave, "
                   "llava-onevision, tiny-<one of those> (offline twin), or a local checkpoint path")
    p.add_argument("--task", default="toy-vqa", choices=list(data.TASKS), help="task (toy-* need no download)")
    p.add_argument("--method", default="hyper-icl", choices=list(M.METHODS), help="what is learned: Hyper-ICL's "
                   "gated logit bias (distilled from the teacher) or HiFICL's virtual key-values (task loss only)")
    p.add_argument("--shots", type=int, help="ICDs per query for the teacher (paper: 8 for Idefics2 and the "
                   "LLaVA models, 32 for Idefics)")
    p.add_argument("--n-train", type=int, default=1000, help="training queries (paper: 1000)")
    p.add_argument("--n-heldout", type=int, default=32, help="queries held out of the training pool to pick the "
                   "best epoch (by their loss; the evaluation split is never used)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training queries (paper: best epoch "
                   "reported, count not stated)")
    p.add_argument("--batch-size", type=int, default=4, help="queries per micro-batch (paper: not stated)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (paper: 5e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (paper: not stated)")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of steps of linear warm-up before the "
                   "cosine decay (paper: 0.1)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    p.add_argument("--rank", type=int, help="adapter rank r (default 4 for hyper-icl, 8 for hificl)")
    p.add_argument("--virtual-tokens", type=int, default=8, help="HiFICL's n virtual key-value pairs")
    p.add_argument("--kappa", type=float, default=0.1, help="curvature magnitude of the Lorentz model (paper: 0.1)")
    p.add_argument("--lam", type=float, default=0.5, help="lambda, weight of the cross-entropy (Eq 17; paper: 0.5)")
    p.add_argument("--anchor", default="hyperbolic", choices=["hyperbolic", "euclidean", "none"],
                   help="the anchor loss (Table 4 ablations: euclidean = L2-anchor, none = L_sup only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the query split, ICD draw, order and adapter init")
    p.add_argument("--data-root", help="folder with the datasets (layout: see data.py / README)")
    p.add_argument("--out", help="output folder (default runs/<model>-<task>-<method>)")
    p.add_argument("--teacher-cache", help="folder of cached teacher states (default <out>/teacher)")
    p.add_argument("--no-teacher-cache", action="store_true", help="recompute the teacher at every step")
    p.add_argument("--save-every", type=int, default=50, help="also checkpoint every this many steps")
    p.add_argument("--max-steps", type=int, help="stop after this many optimiser steps (the schedule still "
                   "spans all epochs; --resume continues)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/last.pt")
    p.add_argument("--benchmark", action="store_true", help="time this run with and without teacher reuse "
                   "and print the ratio (writes to temporary folders)")
    args = p.parse_args(argv)
    args.rank = args.rank or (4 if args.method == "hyper-icl" else 8)
    args.out = args.out or default_out(args.model, args.task, args.method)
    args.teacher_cache = args.teacher_cache or os.path.join(args.out, "teacher")
    if args.method == "hificl":
        args.anchor = "none"  # HiFICL trains with the task loss only
    return args


def default_out(model, task, method):
    """The default output folder of a run: runs/<model>-<task>-<method>."""
    return os.path.join("runs", f"{os.path.basename(model.rstrip('/'))}-{task}-{method}")


# ------------------------------------------------------------------------------------------------------ data

def split_pool(args, family):
    """Training queries, held-out queries (best epoch) and the support set the ICDs are drawn from."""
    pool = data.load_task(args.task, "train", args.data_root)
    order = random.Random(args.seed).sample(range(len(pool)), len(pool))
    heldout = [pool[i] for i in order[:args.n_heldout]]
    train = [pool[i] for i in order[args.n_heldout:args.n_heldout + args.n_train]]
    if len(train) < args.n_train:
        print(f"note: {args.task} has {len(pool)} training items; using {len(train)} queries "
              f"(+{len(heldout)} held out)")
    shots = args.shots if args.shots is not None else data.DEFAULT_SHOTS[family]
    return train, heldout, pool, shots


def epoch_order(n, batch_size, seed, epoch):
    """The batches of one epoch: a permutation that depends only on (seed, epoch), so a resumed run sees the same."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def to(batch, device):
    """A batch (labels and alignment mask included) on `device`."""
    return {k: v.to(device) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------- teacher states

def fingerprint(backbone):
    """A short hash of the backbone: its name, config and a slice of its weights (tiny twins differ by seed)."""
    h = hashlib.sha256((backbone.name + backbone.model.config.to_json_string()).encode())
    for p in list(backbone.model.parameters())[:4]:
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def teacher_key(backbone_id, args, query, icds):
    """The cache key of one query's teacher states: backbone, task, query, its ICDs, the prompt format and the
    version of what the states are (model.LAYER_OUTPUTS_VERSION), so states cached under another definition are
    never read."""
    item = lambda it: [it.id, it.image_path, it.question, it.target]
    spec = {"backbone": backbone_id, "task": args.task, "query": item(query), "icds": [item(d) for d in icds],
            "prompts": data.PROMPTS, "separator": data.SEPARATOR, "states": M.LAYER_OUTPUTS_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


@torch.no_grad()
def run_teacher(backbone, kind, queries, icds, pieces, device):
    """The frozen teacher on [ICDs; query + target], no adapter: per query, its states at the query's tokens.

    Returns a list of [L, T_q, d] tensors, one per query (L decoder layers, T_q the query + target tokens).
    """
    rows = [data.join(data.encode_prefix(backbone.processor, backbone.family, kind, d), p)
            for d, p in zip(icds, pieces)]
    batch = to(data.collate(rows, backbone.processor, backbone.family), device)
    with M.without_adapter(backbone.model), autocast(device):
        states = torch.stack(M.layer_outputs(backbone.model, **data.model_inputs(batch))[1])  # [L, B, W, d]
    return [states[:, b, batch["align"][b]].cpu() for b in range(len(queries))]


def teacher_states(backbone, args, kind, queries, icds, pieces, device, cache):
    """Each query's teacher states, from the cache when present (computed and stored once otherwise)."""
    keys = [teacher_key(cache["id"], args, q, d) for q, d in zip(queries, icds)]
    paths = [os.path.join(args.teacher_cache, k + ".safetensors") for k in keys]
    missing = [i for i, p in enumerate(paths) if args.no_teacher_cache or not os.path.exists(p)]
    fresh = run_teacher(backbone, kind, [queries[i] for i in missing], [icds[i] for i in missing],
                        [pieces[i] for i in missing], device) if missing else []
    cache["misses"] += len(missing)
    cache["hits"] += len(queries) - len(missing)
    states = {i: s for i, s in zip(missing, fresh)}
    for i, path in enumerate(paths):
        if i in states and not args.no_teacher_cache:
            M.atomic_write(path, lambda tmp: save_file({"states": states[i].contiguous()}, tmp))
        elif i not in states:
            states[i] = load_file(path)["states"]
    return [states[i] for i in range(len(queries))]


def stack_teacher(states, align):
    """Lay per-query teacher states [L, T_q, d] at the student's aligned positions: [L, B, W, d]."""
    L, d = states[0].shape[0], states[0].shape[-1]
    out = torch.zeros(L, *align.shape, d, dtype=states[0].dtype, device=align.device)
    for b, s in enumerate(states):
        out[:, b, align[b]] = s.to(align.device)
    return out


# ----------------------------------------------------------------------------------------------------- loss

def autocast(device):
    """bf16 autocast on CUDA; plain float32 on CPU."""
    return torch.autocast("cuda", torch.bfloat16) if str(device).startswith("cuda") else torch.autocast("cpu",
                                                                                                       enabled=False)


def supervised_loss(logits, labels):
    """L_sup: next-token cross-entropy on the target tokens (labels -100 elsewhere)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def losses(backbone, args, student, teacher):
    """The loss parts of Eq 17 for one micro-batch: {"anchor": L_anchor, "sup": L_sup, "loss": total}."""
    with autocast(student["input_ids"].device):
        out, hidden = M.layer_outputs(backbone.model, **data.model_inputs(student))
    parts = {"sup": supervised_loss(out.logits, student["labels"])}
    if args.anchor == "none":
        parts["loss"] = parts["sup"]
        return parts
    hidden = torch.stack(hidden)
    anchor = (hyperbolic_anchor_loss(hidden, teacher, student["align"], args.kappa) if args.anchor == "hyperbolic"
              else euclidean_anchor_loss(hidden, teacher, student["align"]))
    return {"anchor": anchor, **parts, "loss": anchor + args.lam * parts["sup"]}


def micro_batch(backbone, args, kind, queries, icds, device, cache):
    """Student batch (query + target) and, for the anchor, the teacher's states laid at its aligned positions."""
    pieces = [data.encode_query(backbone.processor, backbone.family, kind, q) for q in queries]
    rows = [data.join(data.encode_prefix(backbone.processor, backbone.family, kind, []), p) for p in pieces]
    student = to(data.collate(rows, backbone.processor, backbone.family), device)
    if args.anchor == "none":
        return student, None
    states = teacher_states(backbone, args, kind, queries, icds, pieces, device, cache)
    return student, stack_teacher(states, student["align"])


@torch.no_grad()
def heldout_loss(backbone, args, kind, heldout, device):
    """The supervised loss of the held-out queries: what picks the best epoch."""
    total, count = 0.0, 0
    for i in range(0, len(heldout), args.batch_size):
        queries = heldout[i:i + args.batch_size]
        rows = [data.encode(backbone.processor, backbone.family, kind, [], q) for q in queries]
        batch = to(data.collate(rows, backbone.processor, backbone.family), device)
        with autocast(device):
            total += supervised_loss(backbone.model(**data.model_inputs(batch)).logits, batch["labels"]).item() * len(queries)
        count += len(queries)
    return total / max(count, 1)


# ------------------------------------------------------------------------------------------------ checkpoints

def checkpoint(args, backbone, optimizer, scheduler, progress):
    """Everything a resumed run needs, written to <out>/last.pt."""
    state = {
        "adapter": M.adapters(backbone.model).state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "progress": progress, "args": vars(args),
        "rng": torch.get_rng_state()}
    M.atomic_write(os.path.join(args.out, "last.pt"), lambda tmp: torch.save(state, tmp))


RESUME_MUST_MATCH = ("model", "task", "method", "shots", "n_train", "n_heldout", "epochs", "batch_size",
                     "grad_accum", "lr", "weight_decay", "warmup", "rank", "virtual_tokens", "kappa", "lam", "anchor",
                     "seed")


def restore(args, backbone, optimizer, scheduler):
    """Load <out>/last.pt into the run; refuse if it was made with other settings."""
    path = os.path.join(args.out, "last.pt")
    if not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path}")
    state = torch.load(path, weights_only=False)
    differ = [f"--{k.replace('_', '-')} {state['args'][k]} (now {getattr(args, k)})" for k in RESUME_MUST_MATCH
              if state["args"][k] != getattr(args, k)]
    if differ:
        raise SystemExit(f"--resume: {path} was made with " + ", ".join(differ))
    M.adapters(backbone.model).load_state_dict(state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["progress"]


# ------------------------------------------------------------------------------------------------------- loop

def cosine_with_warmup(optimizer, total, warmup):
    """Linear warm-up over the first `warmup` fraction of steps, then cosine decay to 0 (Section 4.1)."""
    w = max(1, round(warmup * total))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / w if s < w else
                                             0.5 * (1 + math.cos(math.pi * (s - w) / max(1, total - w))))


def check_finite(parts, step):
    """Stop on a NaN or inf loss, naming the step and the loss part (the last checkpoint stays as it was)."""
    for name, value in parts.items():
        if not torch.isfinite(value):
            raise FloatingPointError(f"step {step}: loss part {name!r} is {value.item()}; stopping. The last good "
                                     "checkpoint is untouched; try a lower --lr or --kappa")


def train(args):
    """Run the distillation; returns the final adapter's parameters (a dict of tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    backbone = M.load_backbone(args.model, device=device)
    kind = data.TASKS[args.task].kind
    queries, heldout, pool, shots = split_pool(args, backbone.family)
    icds = dict(zip((q.id for q in queries), data.demonstrations([q.id for q in queries], pool, shots, args.seed)))
    sizes = {"rank": args.rank} | ({"n": args.virtual_tokens} if args.method == "hificl" else {})
    params = M.attach(backbone.model, args.method, **sizes).parameters()
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    batches_per_epoch = math.ceil(len(queries) / args.batch_size)
    steps_per_epoch = math.ceil(batches_per_epoch / args.grad_accum)
    scheduler = cosine_with_warmup(optimizer, steps_per_epoch * args.epochs, args.warmup)
    os.makedirs(args.teacher_cache, exist_ok=True)
    progress = {"step": 0, "best": math.inf, "history": []}
    if args.resume:
        progress = restore(args, backbone, optimizer, scheduler)
    cache = {"id": fingerprint(backbone), "hits": 0, "misses": 0}
    bar = tqdm(total=steps_per_epoch * args.epochs, initial=progress["step"], desc="train", dynamic_ncols=True)
    try:
        for epoch in range(progress["step"] // steps_per_epoch, args.epochs):
            order = epoch_order(len(queries), args.batch_size, args.seed, epoch)
            for s in range(progress["step"] % steps_per_epoch, steps_per_epoch):
                if args.max_steps is not None and progress["step"] >= args.max_steps:
                    return finish(args, backbone, optimizer, scheduler, progress, bar, cache)
                parts = {}
                for idx in order[s * args.grad_accum:(s + 1) * args.grad_accum]:
                    qs = [queries[i] for i in idx]
                    student, teacher = micro_batch(backbone, args, kind, qs, [icds[q.id] for q in qs], device, cache)
                    part = losses(backbone, args, student, teacher)
                    check_finite(part, progress["step"] + 1)
                    (part["loss"] / args.grad_accum).backward()
                    parts = {k: parts.get(k, 0) + v.item() / args.grad_accum for k, v in part.items()}
                torch.nn.utils.clip_grad_norm_(M.adapters(backbone.model).parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                progress["step"] += 1
                bar.update()
                bar.set_postfix({k: f"{v:.4g}" for k, v in parts.items()} | {"lr": f"{scheduler.get_last_lr()[0]:.2g}"})
                if progress["step"] % args.save_every == 0:
                    checkpoint(args, backbone, optimizer, scheduler, progress)
            end_of_epoch(args, backbone, kind, heldout, device, progress, epoch)
            checkpoint(args, backbone, optimizer, scheduler, progress)
    except KeyboardInterrupt:
        checkpoint(args, backbone, optimizer, scheduler, progress)
        bar.close()
        sys.exit(f"interrupted: saved step {progress['step']} to {args.out}/last.pt; continue with --resume")
    return finish(args, backbone, optimizer, scheduler, progress, bar, cache)


def end_of_epoch(args, backbone, kind, heldout, device, progress, epoch):
    """Score the held-out queries; keep the adapter of the best epoch as <out>/adapter.safetensors."""
    loss = heldout_loss(backbone, args, kind, heldout, device)
    progress["history"].append({"epoch": epoch + 1, "step": progress["step"], "heldout_loss": loss})
    if loss < progress["best"]:
        progress["best"] = loss
        M.save_adapter(os.path.join(args.out, "adapter.safetensors"), backbone)
    tqdm.write(f"epoch {epoch + 1}: held-out loss {loss:.4f} (best {progress['best']:.4f})")


def finish(args, backbone, optimizer, scheduler, progress, bar, cache):
    """Final checkpoint and summary; returns the adapter's parameters."""
    checkpoint(args, backbone, optimizer, scheduler, progress)
    bar.close()
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(progress["history"], f, indent=1)
    print(f"done: {progress['step']} steps; teacher states computed {cache['misses']}, reused {cache['hits']}; "
          f"best adapter: {os.path.join(args.out, 'adapter.safetensors')}")
    return {k: v.detach().clone() for k, v in M.adapters(backbone.model).state_dict().items()}


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


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.benchmark:
        return benchmark(args)
    return train(args)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, FloatingPointError) as e:  # bad input or a diverged run: the message, no traceback
        sys.exit(f"error: {e}")
