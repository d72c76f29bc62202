"""evaluate.py's command line: the checks of its flags (the fields of evaluate.py's Config)."""
import contextlib
import dataclasses
import io
import os
import shlex
import sys

import torch

from lab.datasets import readers, rices, tasks
from lab.models import families
from lab.run import checkpoints
from lab.scores import results
from lab.studies import curves, table_runs, tables
from lab.cli import flags


BENCH, CURVE = "with --benchmark or --benchmark-attention", "with --curve"
APPLIES = {  # flag: (where it applies, whether it does with these flags); flags.check_applies
    "seed_protocol": ("to the SEED-Bench tasks (multiple choice) and a table's SEED cells",
                      lambda a: a.table or a.figure or tasks.spec(a.task).kind == "choice"),
    "chair": ("to COCO captions, against COCO's instance annotations (--task coco)", lambda a: a.task == "coco"),
    "random_weights": (BENCH, lambda a: a.benchmark or a.benchmark_attention),
    "force": ("to a --checkpoint", lambda a: a.checkpoint is not None),
    "checkpoint_task": ("to a --checkpoint", lambda a: a.checkpoint is not None),
    "processor": ("with --plan", lambda a: a.plan is not None),
    "rices_encoder": ("with --icds rices or a table's RICES row", lambda a: a.icds == "rices" or a.table or a.figure),
    "eval_draw": ("with --n-eval, on a task whose items are taken in order (MME and SEED draw theirs stratified)",
                  lambda a: a.n_eval is not None and tasks.spec(a.task).kind not in ("yes-no", "choice")),
    "new_tokens": ("where answers are generated (not --seed-protocol likelihood, --benchmark-attention, --gates, "
                   "--hyperbolicity)", lambda a: not (a.seed_protocol == "likelihood" or a.benchmark_attention or
                                                      a.gates or a.hyperbolicity)),
    "attention_tokens": (BENCH, lambda a: a.benchmark or a.benchmark_attention),
    "rounds": (BENCH, lambda a: a.benchmark or a.benchmark_attention),
    "bench_shots": ("with --benchmark", lambda a: a.benchmark),
    **{name: (CURVE, lambda a: a.curve) for name in ("curve_queries", "curve_seeds", "curve_methods", "no_tune")},
    "train_args": ("with --curve, --table or --figure", lambda a: a.curve or a.table or a.figure),
    **{name: ("with --vector or a table's TV and FV rows (--table, --figure)", lambda a: a.vector is not None or
              a.table or a.figure) for name in ("vector_layer", "vector_sets", "vector_heldout")},
    **{name: ("with --vector fv or a table's FV row (--table, --figure)", lambda a: a.vector == "fv" or a.table or
              a.figure) for name in ("fv_heads", "fv_trials")},
    **{name: ("with --table or --figure", lambda a: a.table or a.figure) for name in ("print", "print_commands", "gpus",
                                                                                     "table_worker")},
}


def parse_args(argv, doc, defaults, train_parse):
    """evaluate.py's flags, one a field of `defaults` (evaluate.py's Config: lab/cli/flags.py:parser); returns that
    Config with the parsed values, checked, and the default checkpoint and the output folder filled in. train_parse:
    train.py's parse_args, which checks --train-args."""
    p = flags.parser(doc, defaults, exclusive=[("benchmark", "benchmark_attention", "gates", "hyperbolicity", "curve",
                                                "table", "figure"), ("print", "print_commands", "gpus")])
    # `--train-args VALUE` as `--train-args=VALUE`: a value starting with '-' ("--resume") is the flag's, not a flag
    argv = list(sys.argv[1:] if argv is None else argv)
    for k in range(len(argv) - 1):
        if argv[k] == "--train-args":
            argv[k:k + 2] = [f"--train-args={argv[k + 1]}", None]
    args = dataclasses.replace(defaults, **vars(p.parse_args([a for a in argv if a is not None])))
    flags.check_at_least(p, args, {"n_eval": 1, "batch_size": 1, "shots": 0, "vector_layer": 0,
                                   "vector_sets": 1, "vector_heldout": 1, "fv_heads": 1, "fv_trials": 1,
                                   "new_tokens": 1, "attention_tokens": 1, "threads": (1, flags.MAX_THREADS),
                                   "bench_shots": 0, "curve_queries": 1, "seed": (0, flags.MAX_SEED),
                                   "workers": (0, flags.MAX_WORKERS), "rounds": (1, flags.MAX_ROUNDS)})
    flags.check_image_memory(p, args.image_memory)
    if args.curve:
        args.train_args = args.train_args or curves.CURVE_TRAIN_ARGS
        unknown = set(args.curve_methods or []) - {name for name, _ in curves.curve_runs()}
        if unknown:
            p.error(f"--curve-methods: unknown {sorted(unknown)}; choose from {[n for n, _ in curves.curve_runs()]}")
        if not 2 <= args.curve_seeds <= len(curves.T_975) + 1:
            p.error(f"--curve-seeds must be in [2, {len(curves.T_975) + 1}] for an interval (got {args.curve_seeds})")
    if args.curve or args.table or args.figure:
        try:  # split as a shell does and parsed by train.py's parser (with what curve adds) now, before any work
            with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
                trained = train_parse(["--model", args.model, "--task", args.task, *shlex.split(args.train_args),
                                       "--proceed"])
        except ValueError as e:
            p.error(f"--train-args {args.train_args!r} cannot be split into flags ({e})")
        except SystemExit:  # an error (its last line), or -h's help (on stdout, none on stderr)
            said = err.getvalue().strip().splitlines()
            p.error(f"--train-args {args.train_args!r}: train.py says: " + said[-1].split(" error: ", 1)[-1] if said
                    else "--train-args asks for train.py's help: see python train.py --help, and give its flags")
    if args.split in readers.TEST_SPLITS and args.task != "vqav2" and \
            not (args.split == "test" and tasks.own_task.is_own(args.task)):
        p.error(f"--split {args.split} is VQAv2's test server split (--task vqav2) or a folder task's test.jsonl, "
                f"not {args.task}'s")
    if readers.server_split(args.task, args.split) and (args.curve or args.gates or args.hyperbolicity):
        p.error(f"--split {args.split} has no answers: it is for an evaluation (the test server's file), not "
                "--curve, --gates or --hyperbolicity")
    if args.icd_task and not args.shots:
        p.error("--icd-task draws the ICDs of n-shot ICL: give their number with --shots N")
    if wrong := tasks.check_icd_task(args.task, args.icd_task):
        p.error(wrong)
    if args.icds == "rices" and not args.shots:
        p.error("--icds rices chooses demonstrations: give their number with --shots N")
    if args.icds == "rices" and (missing := rices.encoder_missing(families.family_of(args.model), args.rices_encoder)):
        p.error(missing)
    if args.random_weights == "published" and args.benchmark and not torch.cuda.is_available():
        p.error("--random-weights published runs a real-size backbone and needs a CUDA GPU")
    check_table(p, args, defaults, trained if args.table or args.figure else None)
    default = results.default_checkpoint(args.model, args.task)
    if args.vector and (args.checkpoint or args.benchmark or args.gates or args.hyperbolicity):
        p.error("--vector evaluates the backbone with a task or function vector alone (no checkpoint or analysis)")
    chosen = args.checkpoint is None and args.shots is None and not (args.benchmark or args.vector or args.table or
                                                                     args.figure) and os.path.isfile(default)
    args.checkpoint = default if chosen else args.checkpoint
    if args.checkpoint and not os.path.isfile(args.checkpoint) and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such file")
    if args.checkpoint and os.path.isfile(args.checkpoint):
        try:  # an adapter of another task, or trained beside another split of this one
            checkpoints.check_task(args.checkpoint, args.task, not (args.gates or args.hyperbolicity),
                                   args.checkpoint_task)
        except ValueError as e:
            p.error(str(e))
    if args.gates and args.checkpoint is None:
        p.error(f"--gates needs a Hyper-ICL checkpoint (--checkpoint; {default} does not exist)")
    name = os.path.basename(args.model.rstrip("/")) + (f"-random-weights-{args.random_weights}"
                                                       if args.random_weights else "")
    task = tasks.file_name(args.task)
    args.out = args.out or (f"runs/curve-{name}-{task}" if args.curve else f"runs/tables/{name}" if args.table or
                            args.figure else os.path.dirname(args.checkpoint) or "." if args.checkpoint else
                            f"runs/eval-{name}-{task}")
    flags.check_folders(p, {"--out": args.out, "--rices-cache": args.rices_cache})
    flags.check_applies(p, args, defaults, APPLIES)
    args.seed_protocol = args.seed_protocol or "generate"
    return args


def check_table(p, args, defaults, trained):
    """The checks of --table and --figure (their own flags only with one of them: APPLIES), before any job: --gpus
    names devices this process sees (as CUDA numbers them), each once; no flag that reaches no cell (one a cell
    chooses itself, as --shots: table_runs.unreached), and a note for one handed on to rows the table lacks
    (--seed-protocol without SEED); no --train-args flag the table sets for each job (--task, --out, --method:
    table_runs.JOB_FLAGS; trained: train.py's Config of --train-args); an encoder for a RICES row
    (rices.encoder_missing)."""
    if not (args.table or args.figure):
        return
    if args.gpus is not None:  # "": an empty shell variable, not one process
        devices = args.gpus.split(",")
        if not all(d.isascii() and d.isdigit() for d in devices):  # "²" is a digit to isdigit(), not to int()
            p.error(f"--gpus takes device numbers separated by commas, as 0,1,2,3 (got {args.gpus!r})")
        if len(set(map(int, devices))) < len(devices):
            p.error(f"--gpus {args.gpus} names a device twice; one process a device")
        count = torch.cuda.device_count()
        if not args.plan and not args.table_worker and max(map(int, devices)) >= count:
            p.error(f"--gpus {args.gpus}: this machine has {count} CUDA device(s) visible" +
                    (f" (0 to {count - 1})" if count else "") + "; name those (--plan takes any, to plan for them)")
    layout = tables.layout(args.table or f"figure-{args.figure}", families.family_of(args.model))
    for name in table_runs.unreached(args, defaults, layout):
        if name not in table_runs.EVAL_FLAGS + ("seed_protocol",):
            p.error(f"--{name.replace('_', '-')} reaches no cell of {layout.name}: its cells choose their own or take "
                    "none (lab/studies/tables.py)")
        print(f"note: --{name.replace('_', '-')} reaches no cell of {layout.name} (none of its rows takes it)",
              file=sys.stderr)  # a flag handed on to other tables' rows: one command line may serve several tables
    for name in table_runs.job_flags(shlex.split(args.train_args), [f.name for f in dataclasses.fields(trained)]):
        p.error(f"--train-args --{name.replace('_', '-')}: the table sets it for each job (lab/studies/tables.py); "
                "drop it")
    missing = rices.encoder_missing(families.family_of(args.model), args.rices_encoder)
    if missing and any("rices" in c.evaluate for c in layout.cells.values()):
        p.error(f"{layout.name}'s RICES row: {missing}")
