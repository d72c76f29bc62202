"""What `python -m lab`'s modes parse and run (lab/cli/commands.py names them): the scripts' runs with every flag
(train, evaluate: the harness's too, and the vectors'), the paper's tables and figures, every cell once (table,
figure: lab/studies/table_runs.py), the plan of a run or an evaluation (plan), learning curves (curve), Table 6's
cost (benchmark, benchmark-attention), the gate and delta-hyperbolicity analyses (gates, hyperbolicity), a toy
backbone of one's own (build-toy) and the teacher cache's speed-up (benchmark-teacher). The one place besides
commands.py that imports train.py and evaluate.py: it hands their functions to the studies."""
import contextlib
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import evaluate
import train
from lab.disk import files
from lab.datasets import tasks
from lab.models import backbones, families, published, toy_backbone
from lab.run import locks, torchrun
from lab.scores import reports
from lab.studies import analyses, curves, efficiency, run_plan, table_print, table_runs, vectors
from lab.cli import eval_cli, flags, study_flags, train_cli


@dataclass
class TrainModes(run_plan.Settings):
    """train.py's other modes' own flags (plan train with its times' accelerator, benchmark-teacher, build-toy)."""
    plan: Optional[Literal["cuda", "cpu"]] = None  # print the run's plan on cuda or cpu (no value: here), exit
    processor: Optional[str] = None    # --plan: a local folder of the checkpoint's processor
    benchmark: bool = False            # time the run with and without teacher reuse
    build_toy: bool = False            # meta-train a toy-idefics2 to --out instead (lab/models/toy_backbone.py)
    build_tries: int = 3               # its seeds to try (--seed, --seed + 1, ...)


@dataclass
class Training(train.Config, TrainModes):
    """Every flag of lab's training side: train.py's Config with the harness's and the modes' fields."""


@dataclass
class EvalPlan(run_plan.Settings):
    """evaluate.py's plan flags (plan evaluate; a table's and a figure's --plan), its times' accelerator."""
    plan: Optional[Literal["cuda", "cpu"]] = None  # print the evaluation's plan and exit, as train.py's
    processor: Optional[str] = None   # --plan: a local folder of the checkpoint's processor


@dataclass
class Evaluation(evaluate.Config, efficiency.Settings, analyses.Settings, curves.Settings, table_runs.Settings,
                 vectors.Settings, EvalPlan):
    """Every flag of lab's evaluation side: evaluate.py's Config with the harness's and each study's Settings."""


names = lambda *classes: [f.name for cls in classes for f in dataclasses.fields(cls)]
TRAIN = [n for n in names(Training) if n not in names(TrainModes)]  # python -m lab train's flags
EVALUATE = names(evaluate.Config, vectors.Settings)                 # python -m lab evaluate's flags
TABLE = [*EVALUATE, "print", "print_commands", "gpus", "table_worker", "train_args", "karpathy_split", "seed_bench",
         *names(EvalPlan)]
BENCH = ["random_weights", "attention_tokens", "rounds"]


def parse_train(argv=None, shown=tuple(TRAIN), preset=None, prog="python -m lab train"):
    """lab's train flags (train.py's with the harness's; shown: those that are flags), checked as train.py checks
    its own (lab/cli/train_cli.py); preset: a mode's own values; each method's own rank and anchor filled."""
    return train_cli.parse_args(argv, train.__doc__, Training(), shown, preset, prog=prog).filled()


def parse_evaluate(argv=None, shown=tuple(EVALUATE), preset=None, prog="python -m lab evaluate"):
    """lab's evaluate flags (evaluate.py's with the harness's, the vectors' and, as `shown` says, a study's),
    checked as evaluate.py checks its own (lab/cli/eval_cli.py) and the studies' (lab/cli/study_flags.py)."""
    studies = lambda p, args, defaults: study_flags.check_studies(p, args, defaults, parse_train)
    return eval_cli.parse_args(argv, evaluate.__doc__, Evaluation(), shown, preset, studies=studies, prog=prog)


def train_main(argv=None, load=None):
    """python -m lab train [flags]: train.py's run with every flag (a table's and a curve's trainings)."""
    return train.launch(parse_train(argv), load)


def train_run(args, argv=None, command=None):
    """python -m lab train: train.py's run of the parsed flags."""
    return train.launch(args)


def evaluate_main(argv=None, load=None):
    """python -m lab evaluate [flags] (evaluate_run)."""
    return evaluate_run(parse_evaluate(argv), load=load)


def evaluate_run(args, argv=None, command=None, load=None):
    """python -m lab evaluate: evaluate.py's evaluation with every flag; --vector: a task or function vector's
    (lab/studies/vectors.py), computed once and read back."""
    return evaluate.launch(args, load, vector_of if args.vector else None)


def vector_of(backbone, args):
    """The setting of --vector and its steering on `backbone` with its facts (evaluate.launch's `vector`)."""
    print(f"no adapter: {args.vector} evaluation")
    steering, facts = vectors.load_vector(backbone, args)
    return args.vector, (vectors.steer(backbone.model, **steering), facts)


def table(args, argv, command):
    """table N, figure N: every cell once (lab/studies/table_runs.py), the trainings, evaluations and studies run in
    this process so that the backbone loads once for all of them (table_runs.Shared)."""
    studies = {name: study_main(name) for name in ("benchmark", "gates", "hyperbolicity")}
    return table_runs.run_table(args, argv, {"train.py": train_main, "evaluate.py": evaluate_main, **studies},
                                (parse_train, parse_evaluate), command)


def study_main(name):
    """A table's job of the study `name` (benchmark, gates, hyperbolicity): (argv, load) -> its result, read back
    from its result file where one of the same settings is there (table_print.study_found), else measured."""
    def main(argv=None, load=None):
        args = parse_evaluate(argv, (*names(evaluate.Config), *BENCH, "bench_shots"), {name: True},
                              f"python -m lab {name}")
        path, _ = table_print.study_found(name, args)
        if path:
            print(f"{name}: {path} holds its result (remove it to measure again)")
            return None
        return study(args, load=load)
    return main


def study(args, argv=None, command=None, load=None):
    """curve, benchmark, benchmark-attention, gates, hyperbolicity: run the study the flags ask for, --out locked
    (not the attention benchmark's, which writes nothing). Under torchrun each process runs it whole (the first
    writes). load: what loads the backbone (a table's runner's: table_runs.Shared; None: loaded)."""
    one_for_curves = 1 if args.curve and not torch.cuda.is_available() else None
    backbones.choose_threads(args.model, args.threads or one_for_curves)
    lock = contextlib.nullcontext() if args.benchmark_attention else locks.locked(args.out)  # one run in --out
    with torchrun.process_group(), lock:
        files.remove_stale_tmp(args.out)
        if args.curve:
            scored = lambda backbone, flags, items, setting: evaluate.evaluate(backbone, parse_evaluate(flags), items,
                                                                                 setting)
            return curves.curve(args, train_main, train.run_teacher, scored=scored, paper_lam=train.Config.lam)
        if args.gates or args.hyperbolicity:
            items = tasks.eval_items(args)
            if items == []:
                raise ValueError(f"{args.task} has no {args.split} items to evaluate")
            backbone = loaded(args, load)
            return analyses.analysis(backbone, args, items, reports.adapted(backbone, args))
        efficiency.keep_freed_memory()
        if args.benchmark_attention:
            return efficiency.attention_benchmark(efficiency.attention_model(args.model, args.random_weights),
                                              args.attention_tokens, args.rounds)
        backbone = published.random_backbone(args.model, args.random_weights) if args.random_weights else \
            loaded(args, load)
        if args.checkpoint:
            reports.adapted(backbone, args)
        return efficiency.benchmark(backbone, args, evaluate.generate)


def loaded(args, load=None):
    """The backbone of --model with --image-splitting and --image-memory (load: what loads it, None:
    backbones.load_backbone), its images' note printed."""
    backbone = (load or backbones.load_backbone)(args.model, image_splitting=args.image_splitting,
                                                 image_memory=args.image_memory * 1e9)
    if backbone.images:
        print(backbone.images)
    return backbone


def build_toy(cfg, argv=None, command=None):
    """build-toy: a toy-idefics2 that learns in context, meta-trained to --out (an existing file needs --overwrite)."""
    check_build_out(cfg.out, cfg.overwrite)
    return toy_backbone.build_toy(cfg.out, {**toy_backbone.TOY_RECIPE, "seed": cfg.seed}, cfg.build_tries,
                                  cfg.threads or 1)


def benchmark(args):
    """Time the same run with and without teacher reuse; print both and the ratio (not a test: a measurement)."""
    times = {}
    for reuse in (False, True):
        with tempfile.TemporaryDirectory() as out:
            run = dataclasses.replace(args, out=out, teacher_cache=os.path.join(out, "teacher"),
                                      no_teacher_cache=not reuse, benchmark=False)
            start = time.perf_counter()
            train.train(run)
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


def plan_run(args, argv=None, command=None):
    """plan train, plan evaluate: the cost of a run or an evaluation before it runs (lab/studies/run_plan.py)."""
    return run_plan.plan(args) if isinstance(args, Training) else run_plan.plan(args, queries=tasks.eval_items(args))


def benchmark_teacher(args, argv=None, command=None):
    """benchmark-teacher: benchmark on this machine's threads."""
    backbones.choose_threads(args.model, args.threads)
    return benchmark(args)
