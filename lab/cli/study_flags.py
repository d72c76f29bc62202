"""The checks of the studies' flags, for `python -m lab`'s modes (eval_cli.parse_args calls check_studies with the
flags of evaluate.py it checks itself): --curve's, --train-args (parsed by train.py's parser), --table's and
--figure's."""
import contextlib
import dataclasses
import io
import shlex
import sys

import torch

from lab.datasets import rices
from lab.models import families
from lab.studies import curves, table_runs, tables


def check_studies(p, args, defaults, train_parse):
    """A parser error for each study flag that cannot work, before any job: --curve-methods and --curve-seeds,
    --train-args split and parsed by train.py's parser (train_parse; --curve fills in its own), then check_table."""
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
                    else "--train-args asks for train.py's help: see python -m lab train --help, and give its flags")
    check_table(p, args, defaults, trained if args.table or args.figure else None)


def check_table(p, args, defaults, trained):
    """The checks of --table and --figure (their own flags only with one of them: APPLIES), before any job: --gpus
    names devices this process sees (as CUDA numbers them), each once (gpu_numbers; written back as a list), and
    with --print-commands comes with --shard; --shard comes with --gpus; no flag that reaches no cell (one a cell
    chooses itself, as --shots: table_runs.unreached), and a note for one handed on to rows the table lacks
    (--seed-protocol or --seed-bench without SEED, --karpathy-split without COCO or Flickr30k); no --train-args flag
    the table sets for each job (--task, --out, --method: table_runs.JOB_FLAGS; trained: train.py's Config of
    --train-args); an encoder for a RICES row (rices.encoder_missing)."""
    if not (args.table or args.figure):
        return
    if args.gpus is not None:  # "": an empty shell variable, not one process
        args.gpus = ",".join(map(str, gpu_numbers(p, args.gpus)))
        count = torch.cuda.device_count()
        if not (args.plan or args.print or args.print_commands or args.table_worker) and \
                max(map(int, args.gpus.split(","))) >= count:
            p.error(f"--gpus {args.gpus}: this machine has {count} CUDA device(s) visible" +
                    (f" (0 to {count - 1})" if count else "") + "; name those (--plan takes any, to plan for them)")
        if args.print_commands and not args.shard:
            p.error("--print-commands with --gpus takes --shard (each job's torchrun line over those devices); "
                    "without --gpus its lines run on any one device")
    elif args.shard and not args.print:
        p.error("--shard in a table takes --gpus, as --gpus 0-3: each job runs over those devices at once")
    layout = tables.layout(args.table or f"figure-{args.figure}", families.family_of(args.model),
                           seed_bench=args.seed_bench)
    for name in table_runs.unreached(args, defaults, layout):
        if name not in table_runs.EVAL_FLAGS + ("seed_protocol", "seed_bench", "karpathy_split"):
            p.error(f"--{name.replace('_', '-')} reaches no cell of {layout.name}: its cells choose their own or take "
                    "none (lab/studies/tables.py)")
        print(f"note: --{name.replace('_', '-')} reaches no cell of {layout.name} (none of its rows takes it)",
              file=sys.stderr)  # a flag handed on to other tables' rows: one command line may serve several tables
    for name in table_runs.job_flags(shlex.split(args.train_args), [f.name for f in dataclasses.fields(trained)]):
        p.error(f"--train-args --{name.replace('_', '-')}: the table sets it for each job (lab/studies/tables.py); "
                "drop it")
    missing = rices.encoder_missing(families.record_of(args.model), args.rices_encoder)
    if missing and any("rices" in c.evaluate for c in layout.cells.values()):
        p.error(f"{layout.name}'s RICES row: {missing}")


def gpu_numbers(p, gpus):
    """The device numbers of --gpus: numbers and ranges separated by commas (0,1,2,3; 0-3; 0-1,4-5), each once, in
    the order given; a parser error naming what is wrong."""
    numbers = []
    for part in gpus.split(","):
        ends = part.split("-")
        if not all(e.isascii() and e.isdigit() for e in ends) or len(ends) > 2:  # "²" is a digit to isdigit() alone
            p.error(f"--gpus takes device numbers separated by commas, as 0,1,2,3 (got {gpus!r}), or a range, as 0-3")
        if int(ends[0]) > int(ends[-1]):
            p.error(f"--gpus {gpus}: the range {part} runs downward; name it from its first device up, as "
                    f"{ends[-1]}-{ends[0]}")
        numbers += range(int(ends[0]), int(ends[-1]) + 1)
    if len(set(numbers)) < len(numbers):
        p.error(f"--gpus {gpus} names a device twice; one process a device")
    return numbers
