"""evaluate.py's command line: the checks of its flags (the fields of evaluate.py's Config; `python -m lab evaluate`
and the modes that take evaluate.py's flags check theirs here too, the studies' own in lab/cli/study_flags.py)."""
import dataclasses
import os
import sys
from types import SimpleNamespace

import torch

from lab.datasets import readers, rices, tasks
from lab.models import families
from lab.run import adapter_files
from lab.scores import results
from lab.cli import flags


APPLIES = {  # flag: (where it applies, whether it does with these flags); flags.check_applies
    "seed_protocol": ("to the SEED-Bench tasks (multiple choice) and a table's SEED cells",
                      lambda a: a.table or a.figure or tasks.spec(a.task).kind == "choice"),
    "chair": ("to COCO captions, against COCO's instance annotations (--task coco)", lambda a: a.task == "coco"),
    "force": ("to a --checkpoint", lambda a: a.checkpoint is not None),
    "checkpoint_task": ("to a --checkpoint", lambda a: a.checkpoint is not None),
    "processor": ("with --plan", lambda a: a.plan is not None),
    "rices_encoder": ("with --icds rices or a table's RICES row", lambda a: a.icds == "rices" or a.table or a.figure),
    "eval_draw": ("with --n-eval, on a task whose items are taken in order (MME and SEED draw theirs stratified)",
                  lambda a: a.n_eval is not None and tasks.spec(a.task).kind not in ("yes-no", "choice")),
    "new_tokens": ("where answers are generated (not --seed-protocol likelihood, --benchmark-attention, --gates, "
                   "--hyperbolicity)", lambda a: not (a.seed_protocol == "likelihood" or a.benchmark_attention or
                                                      a.gates or a.hyperbolicity)),
    **{name: ("with --vector or a table's TV and FV rows (--table, --figure)", lambda a: a.vector is not None or
              a.table or a.figure) for name in ("vector_layer", "vector_sets", "vector_heldout")},
    **{name: ("with --vector fv or a table's FV row (--table, --figure)", lambda a: a.vector == "fv" or a.table or
              a.figure) for name in ("fv_heads", "fv_trials")},
}


def parse_args(argv, doc, defaults, shown=None, preset=None, script=False, studies=None, prog=None):
    """evaluate.py's flags, one a field of `defaults` (evaluate.py's Config, or lab's with the studies' Settings:
    lab/cli/flags.py:parser); returns that Config with the parsed values, checked, and the default checkpoint and the
    output folder filled in. shown: the fields that are flags (None: all); preset: {field: value} where the flags
    leave the default (a mode's own: table="1"); script: evaluate.py's own parser, which names lab's command for a
    flag that moved there; studies(p, args, defaults): the checks of the studies' flags (lab/cli/study_flags.py);
    prog: the command's name in the help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if script:
        flags.refuse_moved(argv, "evaluate.py", [f.name for f in dataclasses.fields(defaults) if f.name not in shown])
    p = flags.parser(doc, defaults, exclusive=[("print", "print_commands")], shown=shown, prog=prog)
    # `--train-args VALUE` as `--train-args=VALUE`: a value starting with '-' ("--resume") is the flag's, not a flag
    for k in range(len(argv) - 1):
        if argv[k] == "--train-args":
            argv[k:k + 2] = [f"--train-args={argv[k + 1]}", None]
    args = dataclasses.replace(defaults, **vars(p.parse_args([a for a in argv if a is not None])))
    args = dataclasses.replace(args, **{k: v for k, v in (preset or {}).items() if getattr(args, k) == getattr(
        defaults, k)})
    a = modes(args)
    flags.check_at_least(p, args, {"n_eval": 1, "batch_size": 1, "shots": 0, "vector_layer": 0,
                                   "vector_sets": 1, "vector_heldout": 1, "fv_heads": 1, "fv_trials": 1,
                                   "new_tokens": 1, "attention_tokens": 1, "threads": (1, flags.MAX_THREADS),
                                   "bench_shots": 0, "curve_queries": 1, "seed": (0, flags.MAX_SEED),
                                   "workers": (0, flags.MAX_WORKERS), "rounds": (1, flags.MAX_ROUNDS)})
    flags.check_image_memory(p, args.image_memory)
    if args.split in readers.TEST_SPLITS and args.task != "vqav2" and \
            not (args.split == "test" and (tasks.own_task.is_own(args.task) or args.task in readers.KARPATHY_IDS)):
        p.error(f"--split {args.split} is VQAv2's test server split (--task vqav2), Karpathy's test split (coco, "
                f"flickr30k) or a folder task's test.jsonl, not {args.task}'s")
    if readers.server_split(args.task, args.split) and (a.curve or a.gates or a.hyperbolicity):
        p.error(f"--split {args.split} has no answers: it is for an evaluation (the test server's file), not "
                "--curve, --gates or --hyperbolicity")
    if args.icd_task and not args.shots:
        p.error("--icd-task draws the ICDs of n-shot ICL: give their number with --shots N")
    if wrong := tasks.check_icd_task(args.task, args.icd_task):
        p.error(wrong)
    if args.icds == "rices" and not args.shots:
        p.error("--icds rices chooses demonstrations: give their number with --shots N")
    if args.icds == "rices" and (missing := rices.encoder_missing(families.record_of(args.model), args.rices_encoder)):
        p.error(missing)
    if a.random_weights == "published" and a.benchmark and not torch.cuda.is_available():
        p.error("--random-weights published runs a real-size backbone and needs a CUDA GPU")
    if studies:
        studies(p, args, defaults)
    default = results.default_checkpoint(args.model, args.task)
    if a.vector and (args.checkpoint or a.benchmark or a.gates or a.hyperbolicity):
        p.error("--vector evaluates the backbone with a task or function vector alone (no checkpoint or analysis)")
    chosen = args.checkpoint is None and args.shots is None and not (a.benchmark or a.vector or a.table or
                                                                     a.figure) and os.path.isfile(default)
    args.checkpoint = default if chosen else args.checkpoint
    if args.checkpoint and not os.path.isfile(args.checkpoint) and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such file")
    if args.checkpoint and os.path.isfile(args.checkpoint):
        try:  # an adapter of another task, or trained beside another split of this one
            adapter_files.check_task(args.checkpoint, args.task, not (a.gates or a.hyperbolicity),
                                   args.checkpoint_task)
        except ValueError as e:
            p.error(str(e))
    if a.gates and args.checkpoint is None:
        p.error(f"--gates needs a Hyper-ICL checkpoint (--checkpoint; {default} does not exist)")
    name = os.path.basename(args.model.rstrip("/")) + (f"-random-weights-{a.random_weights}"
                                                       if a.random_weights else "")
    task = tasks.file_name(args.task)
    args.out = args.out or (f"runs/curve-{name}-{task}" if a.curve else f"runs/tables/{name}" if a.table or
                            a.figure else os.path.dirname(args.checkpoint) or "." if args.checkpoint else
                            f"runs/eval-{name}-{task}")
    flags.check_folders(p, {"--out": args.out, "--rices-cache": args.rices_cache})
    flags.check_applies(p, args, defaults, APPLIES, modes(args))
    args.seed_protocol = args.seed_protocol or "generate"
    return args


def modes(args):
    """The flags `args` holds, read with the modes' and the studies' (flags.LAB_ONLY) None where its Config lacks them
    (evaluate.py's own): what the checks test, one way for the script and for lab."""
    return SimpleNamespace(**(dict.fromkeys(flags.LAB_ONLY["evaluate.py"]) | vars(args)))
