"""train.py's command line: the checks of its flags (the fields of train.py's Config; `python -m lab train` and its
other modes check theirs here too)."""
import dataclasses
import os
import sys

from lab.datasets import rices, tasks
from lab.models import families, toy_backbone
from lab.methods import registry
from lab.run import resume
from lab.cli import flags


ANCHORS, METHODS = registry.ANCHORS, registry.METHODS
# the methods that take a size (has=False: that do not), the anchors that read a flag: as the where of APPLIES
taking = lambda size, has=True: " or ".join(m for m, own in METHODS.items() if (size in own.sizes) == has)
reading = lambda flag: " or ".join(a for a, own in ANCHORS.items() if flag in own.reads)
APPLIES = {  # flag: (where it applies, whether it does with these flags); flags.check_applies
    "temperature": (f"with --anchor {reading('temperature')} (LIVE's KL)",
                    lambda a: "temperature" in ANCHORS[a.anchor].reads),
    "kappa": (f"with --anchor {reading('kappa')}", lambda a: "kappa" in ANCHORS[a.anchor].reads),
    "virtual_tokens": (f"to --method {taking('n')}", lambda a: "n" in METHODS[a.method].sizes),
    "rank": (f"to a method with a rank (not {taking('rank', has=False)})", lambda a: "rank" in METHODS[a.method].sizes),
    "anchor_norm": ("with an anchor (not --anchor none, the loss of hificl and lora)",
                    lambda a: ANCHORS[a.anchor].loss is not None),
    "teacher_cache": ("without --no-teacher-cache", lambda a: not a.no_teacher_cache),
    "no_teacher_cache": ("where a teacher runs (an --anchor other than none)",
                         lambda a: ANCHORS[a.anchor].teacher is not None),
    "rices_encoder": ("with --icds rices", lambda a: a.icds == "rices"),
}


def parse_args(argv, doc, defaults, shown=None, preset=None, script=False, prog=None):
    """train.py's flags, one a field of `defaults` (train.py's Config, or lab's with the modes' fields:
    lab/cli/flags.py:parser); returns that Config with the parsed values, checked, and --out and --teacher-cache
    filled in. shown: the fields that are flags (None: all); preset: {field: value} where the flags leave the default
    (a mode's own); script: train.py's own parser, which names lab's command for a flag that moved there; prog:
    the command's name in the help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if script:
        flags.refuse_moved(argv, "train.py", [f.name for f in dataclasses.fields(defaults) if f.name not in shown])
    p = flags.parser(doc, defaults, exclusive=[("resume", "overwrite", "proceed")], shown=shown, prog=prog)
    args = dataclasses.replace(defaults, **vars(p.parse_args(argv)))
    args = dataclasses.replace(args, **{k: v for k, v in (preset or {}).items() if getattr(args, k) == getattr(
        defaults, k)})
    flags.check_at_least(p, args, {"rank": 1, "virtual_tokens": 1, "n_train": 1, "n_heldout": 1, "epochs": 1,
                                   "batch_size": 1, "grad_accum": 1, "save_every": 1, "max_steps": 1, "shots": 0,
                                   "build_tries": 1, "threads": (1, flags.MAX_THREADS), "seed": (0, flags.MAX_SEED),
                                   "workers": (0, flags.MAX_WORKERS)})
    if not 0 <= args.warmup < 1:
        p.error(f"--warmup must be a fraction of the steps in [0, 1) (got {args.warmup})")
    flags.check_floats(p, args)
    check_world(p, args.batch_size, args.n_train)
    if wrong := tasks.check_icd_task(args.task, args.icd_task):
        p.error(wrong)
    if args.icds == "rices" and (missing := rices.encoder_missing(families.record_of(args.model), args.rices_encoder)):
        p.error(missing)
    flags.check_image_memory(p, args.image_memory)
    flags.check_applies(p, args, defaults, APPLIES, args.filled())
    building = getattr(args, "build_toy", False)  # python -m lab build-toy: --out is a file
    args.out = args.out or (toy_backbone.TOY_BUILD_OUT if building else
                            resume.default_out(args.model, args.task, args.method))
    args.teacher_cache = args.teacher_cache or os.path.join(args.out, "teacher")
    flags.check_folders(p, {"--out": None if building else args.out, "--teacher-cache": args.teacher_cache,
                            "--rices-cache": args.rices_cache})
    return args


def check_world(p, batch_size, n_train):
    """Under torchrun (WORLD_SIZE), a parser error naming --batch-size before any backbone loads when a micro-batch
    would leave a process without a query: every micro-batch of --batch-size queries (the last one --n-train's
    remainder) must give each of the N processes at least one (torchrun.data_parallel checks the queries there are)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    smallest = min(batch_size, n_train % batch_size or batch_size)
    if smallest < world:
        p.error(f"torchrun's {world} processes need at least {world} queries in every micro-batch; --batch-size "
                f"{batch_size} with --n-train {n_train} gives {smallest}: give --batch-size {world} (or a "
                "multiple of it that divides --n-train)")
