"""evaluate.py's other modes, dispatched here: the paper's tables and figures, every cell once (--table, --figure:
lab/studies/table_runs.py), the plan of an evaluation (--plan), learning curves (--curve), Table 6's cost
(--benchmark, --benchmark-attention), the gate and delta-hyperbolicity analyses (--gates, --hyperbolicity). Each study
reads its own Settings (evaluate.py's Config gathers them); what a mode runs of the two scripts, evaluate.py hands in
(Scripts): a wing never imports them."""
import contextlib
from dataclasses import dataclass

import torch

from lab.disk import files
from lab.datasets import tasks
from lab.models import backbones, published
from lab.run import checkpoints, torchrun
from lab.studies import analyses, curves, plan, table6, table_runs

MODES = ("table", "figure", "plan", "curve", "benchmark", "benchmark_attention", "gates", "hyperbolicity")


@dataclass(frozen=True)
class Scripts:
    """What the modes run of the two scripts, handed in by evaluate.py: its main, parse_args, generate, evaluate and
    adapted (--checkpoint's adapter attached, the setting named), its path (--gpus starts it once per device), and
    trainer() -> train.py, asked for only by the modes that train (--table, --figure, --curve), whose trainings run in
    this process so that the backbone loads once for all of them (table_runs.Shared)."""
    main: object
    parse_args: object
    generate: object
    evaluate: object
    adapted: object
    path: str
    trainer: object


def chosen(args):
    """Whether the flags ask for one of the other modes (else: the paper's evaluation, in evaluate.py)."""
    return any(getattr(args, mode) for mode in MODES)


def run(args, argv, load, scripts):
    """Run the mode the flags ask for. argv: the command's flags (a table's --gpus and --print-commands repeat
    them); load: what loads the backbone (evaluate.main's); scripts: Scripts. Under torchrun each process runs the
    mode whole (the first writes)."""
    if args.table or args.figure:  # before any folder is made or weights load
        train = scripts.trainer()
        return table_runs.run_table(args, argv, {"train.py": train.main, "evaluate.py": scripts.main},
                                    (train.parse_args, scripts.parse_args), scripts.path)
    if args.plan:
        return plan.plan(args, queries=tasks.eval_items(args))
    one_for_curves = 1 if args.curve and not torch.cuda.is_available() else None
    backbones.choose_threads(args.model, args.threads or one_for_curves)
    lock = contextlib.nullcontext() if args.benchmark_attention else checkpoints.locked(args.out)  # one run in --out
    with torchrun.process_group(), lock:
        files.remove_stale_tmp(args.out)
        if args.curve:
            train = scripts.trainer()
            scored = lambda backbone, flags, items, setting: scripts.evaluate(backbone, scripts.parse_args(flags),
                                                                                items, setting)
            return curves.curve(args, train.main, train.run_teacher, scored=scored, paper_lam=train.Config.lam)
        if args.gates or args.hyperbolicity:
            items = tasks.eval_items(args)
            if items == []:
                raise ValueError(f"{args.task} has no {args.split} items to evaluate")
            backbone = loaded(args, load)
            return analyses.analysis(backbone, args, items, scripts.adapted(backbone, args))
        table6.keep_freed_memory()
        if args.benchmark_attention:
            return table6.attention_benchmark(table6.attention_model(args.model, args.random_weights),
                                              args.attention_tokens, args.rounds)
        backbone = published.random_backbone(args.model, args.random_weights) if args.random_weights else \
            loaded(args, load)
        if args.checkpoint:
            scripts.adapted(backbone, args)
        return table6.benchmark(backbone, args, scripts.generate)


def loaded(args, load):
    """The backbone of --model with --image-splitting and --image-memory (load: what loads it; None:
    backbones.load_backbone), its images' note printed."""
    backbone = (load or backbones.load_backbone)(args.model, image_splitting=args.image_splitting,
                                                 image_memory=args.image_memory * 1e9)
    if backbone.images:
        print(backbone.images)
    return backbone
