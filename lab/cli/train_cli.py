"""train.py's command line: every flag (its default a field of train.py's Config), its checks, and --benchmark."""
import argparse
import dataclasses
import os
import tempfile
import time

import data
import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.models import families, toy_backbone
from lab.run import checkpoints
from lab.cli import flags


def parse_args(argv, doc, defaults):
    """train.py's flags, one a field of `defaults` (train.py's Config) with its value as the default (--help lists
    it); returns that Config with the parsed values, checked, and --out and --teacher-cache filled in."""
    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The module docstring as written, and every flag's default."""
    p = argparse.ArgumentParser(description=doc, formatter_class=Help)
    p.add_argument("--model", help="backbone: idefics2, idefics, llava-interleave, llava-onevision, tiny-<one of "
                   "those> (offline twin, random weights), toy-idefics2 (meta-trained to learn in context: the shipped "
                   "reference copy), a toy backbone's file (--build-toy), or a local checkpoint path")
    p.add_argument("--task", type=tasks.task_arg, help=f"task: {', '.join(data.TASKS)} (toy-icl-* need no download "
                   "and can only be solved from demonstrations), or a task of one's own: a .jsonl file, a folder of "
                   "train.jsonl and val.jsonl, or a LLaVA .json (README, \"Your own data\")")
    p.add_argument("--method", choices=list(M.METHODS), help="what is learned: hyper-icl (gated logit bias), "
                   "static-layer / static-layer-head (its gate a learned constant per layer / per layer and head, "
                   "Fig 3a), output-level (the same module on the attention output, Table 11), hificl (virtual "
                   "key-values), mimic (MimIC), live (LIVE), lora (LoRA via peft); each trains with its own loss (see "
                   "--anchor)")
    p.add_argument("--shots", type=int, help="ICDs per query for the teacher (paper: 8 for Idefics2 and the "
                   "LLaVA models, 32 for Idefics; 2 on MME and SEED: data.default_shots)")
    flags.add_icd_flags(p)
    flags.add_plan_flags(p)
    p.add_argument("--n-train", type=int, help="training queries (paper: 1000)")
    p.add_argument("--n-heldout", type=int, help="queries held out of the training pool to pick the best epoch (by "
                   "their loss; the evaluation split is never used)")
    p.add_argument("--epochs", type=int, help="passes over the training queries (paper: best epoch reported, count "
                   "not stated)")
    p.add_argument("--batch-size", type=int, help="queries per micro-batch (paper: not stated)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimiser step")
    p.add_argument("--lr", type=float, help="AdamW learning rate, the same for every method (paper: 5e-3; the "
                   "baselines' own code: MimIC 1e-5 and its LoRA 5e-4 in src/config/peft/, LIVE 1e-3 or 5e-3 in its "
                   "README runs)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (paper: not stated)")
    p.add_argument("--warmup", type=float, help="fraction of steps of linear warm-up before the cosine decay "
                   "(paper: 0.1)")
    p.add_argument("--clip", type=float, help="gradient norm clipping (not in the paper)")
    p.add_argument("--rank", type=int, help="adapter rank r (default 4 for hyper-icl and its variants, 8 for "
                   "hificl, 16 for lora; mimic and live have none)")
    p.add_argument("--virtual-tokens", type=int, help="HiFICL's n virtual key-value pairs")
    p.add_argument("--kappa", type=float, help="curvature magnitude of the Lorentz model (paper: 0.1)")
    p.add_argument("--lam", type=float, help="lambda, weight of the cross-entropy next to the distillation loss, "
                   "which has weight 1 (Eq 17; paper: 0.5; MimIC: ce_loss_weight 0.5 with align_loss_weight 1, "
                   "github.com/Kamichanw/MimIC src/config/peft/mimic.yaml; LIVE: hard_loss_weight 0.5 with the KL at "
                   "weight 1, github.com/ForJadeForest/LIVE-Learnable-In-Context-Vector README and "
                   "icv_src/icv_module.py)")
    p.add_argument("--anchor", choices=["hyperbolic", "euclidean", "mse", "kl", "none"],
                   help="the distillation loss (default: the method's own: hyperbolic for hyper-icl, static-* and "
                   "output-level, mse for mimic, kl for live, none for hificl and lora). hyperbolic: Eq 16; "
                   "euclidean: L2-anchor (Table 4); mse: MimIC's layer-wise MSE of the hidden states at the query "
                   "tokens (MimIC src/shift_model.py); kl: LIVE's T^2 KL(teacher || student) over the vocabulary "
                   "at the answer positions (LIVE icv_src/icv_module.py); none: cross-entropy only")
    p.add_argument("--anchor-norm", choices=["none", "first"], help="none: the paper's Eq 17; first: the "
                   "distillation loss divided by its value at the first step (before any update), so that it starts "
                   "at 1 beside lambda x CE instead of hundreds of times larger (not in the paper)")
    p.add_argument("--temperature", type=float, help="T of --anchor kl (LIVE divides both logits by T and scales "
                   "the KL by T^2; its value is not in LIVE's public files)")
    p.add_argument("--seed", type=int, help="seed of the query split, ICD draw, order and adapter init")
    p.add_argument("--data-root", help="folder with the datasets (layout: see data.py / README)")
    p.add_argument("--out", help="output folder (default runs/<model>-<task>-<method>)")
    p.add_argument("--teacher-cache", help="folder of cached teacher states (default <out>/teacher)")
    p.add_argument("--no-teacher-cache", action="store_true", help="recompute the teacher at every step (epochs x "
                   "queries teacher forwards instead of one per query; no disk)")
    p.add_argument("--save-every", type=int, help="also checkpoint every this many steps")
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
                       f"{toy_backbone.TOY_BUILD_OUT}); use it with --model <that file>")
    build.add_argument("--build-tries", type=int, help="seeds to try before giving up")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: one for the tiny and toy backbones "
                   "on CPU, which more threads only slow down on a busy machine, and for --build-toy, whose bytes "
                   "then repeat on the same machine; else torch's own choice)")
    flags.add_worker_flag(p)
    p.set_defaults(**dataclasses.asdict(defaults))  # over the shared flags' defaults too (lab/cli/flags.py)
    args = dataclasses.replace(defaults, **vars(p.parse_args(argv)))
    flags.check_at_least(p, args, {"rank": 1, "virtual_tokens": 1, "n_train": 1, "n_heldout": 1, "epochs": 1,
                                   "batch_size": 1, "grad_accum": 1, "save_every": 1, "max_steps": 1, "shots": 0,
                                   "build_tries": 1, "threads": (1, flags.MAX_THREADS), "seed": (0, flags.MAX_SEED),
                                   "workers": (0, flags.MAX_WORKERS)})
    if not 0 <= args.warmup < 1:
        p.error(f"--warmup must be a fraction of the steps in [0, 1) (got {args.warmup})")
    flags.check_floats(p, args)
    flags.check_image_memory(p, args)
    args.out = args.out or (toy_backbone.TOY_BUILD_OUT if args.build_toy else
                            checkpoints.default_out(args.model, args.task, args.method))
    args.teacher_cache = args.teacher_cache or os.path.join(args.out, "teacher")
    flags.check_folders(p, {"--out": None if args.build_toy else args.out, "--teacher-cache": args.teacher_cache,
                            "--rices-cache": args.rices_cache})
    return args


def benchmark(args, train):
    """Time the same run with and without teacher reuse; print both and the ratio (not a test: a measurement)."""
    times = {}
    for reuse in (False, True):
        with tempfile.TemporaryDirectory() as out:
            run = dataclasses.replace(args, out=out, teacher_cache=os.path.join(out, "teacher"),
                                      no_teacher_cache=not reuse, benchmark=False)
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
    if not families.is_toy_file(path):
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
        probe = files.tmp_name(path)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write in {folder} ({e.strerror or e}); choose a writable --out") from e
