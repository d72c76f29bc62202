"""A table's work (evaluate.py --table N, --figure N): each cell's single commands (tables.py) as jobs, each piece of
work once, in one process that loads the backbone once; resumed by running the same command again; --gpus: one such
process per device taking the next job (with --shard: each job over all of them, one after another); --print-commands:
the jobs as shell lines for any launcher.

Once each: a job is one train.py or evaluate.py command (or a study of lab on an adapter: Tables 6, 9, 10), and
cells that need the same command share its job (Table 4's zero-shot is Table 1's, Table 8's adapter is Table 1's run,
Table 5's CHAIR Table 1's COCO evaluations). Every run of a task reads and writes one teacher
cache, <out>/teacher/<task>, so the teacher's states and answer logits of a (backbone, task, queries, ICDs) are
computed in one pass by the first run that distils from them and read by the others, LIVE (the logits) included. A
finished training is skipped (train.py --proceed), a stopped one continued, an evaluation of the same settings read
(evaluate.py), so the same command after Ctrl-C, kill -9 or a lost node finishes with the table one run gives."""
import contextlib
import hashlib
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.models import backbones, families
from lab.methods import registry
from lab.run import locks
from lab.studies import table_plan, table_print, tables

# evaluate.py's flags a table hands on to each cell's commands where they are not the defaults: to train.py (the
# machine, the images, RICES, the seed), and to evaluate.py (those and the evaluations' own)
TRAIN_FLAGS = ("threads", "workers", "image_splitting", "image_memory", "rices_encoder", "rices_cache", "seed")
EVAL_FLAGS = TRAIN_FLAGS + ("batch_size", "vector_layer", "vector_sets", "vector_heldout", "fv_heads", "fv_trials")
ONLY_WITH = {"rices_encoder": "rices", "rices_cache": "rices", "vector_layer": "--vector", "vector_sets": "--vector",
             "vector_heldout": "--vector", "fv_heads": "fv", "fv_trials": "fv"}  # flags handed on only to the cells
# whose own flags hold the word
TABLE_FLAGS = ("model", "data_root", "out", "n_eval", "train_args", "seed_protocol", "plan", "processor", "table",
               "figure", "print", "print_commands", "gpus", "table_worker", "accelerator", "shard",
               "plan_json", "karpathy_split", "seed_bench")  # evaluate.py's flags a table reads itself
JOB_FLAGS = ("model", "task", "data_root", "out", "teacher_cache", "proceed", "resume", "overwrite", "method",
             "icd_task", "plan", "processor", "benchmark", "build_toy", "build_tries")  # train.py's, set per job


def unreached(args, defaults, table):
    """The evaluate.py flags given (not their defaults) that reach no cell of `table`: one that is neither the table's
    own (TABLE_FLAGS) nor handed on (EVAL_FLAGS), as --shots, which each cell chooses itself; one of ONLY_WITH whose
    word no cell's flags hold; --seed-protocol and --seed-bench where no cell is a SEED task, --karpathy-split where
    none is COCO or Flickr30k."""
    words = {w for c in table.cells.values() for w in c.evaluate}
    kinds = {tasks.spec(c.task).kind for c in table.cells.values()}
    return [name for name in vars(args) if getattr(args, name) != getattr(defaults, name) and (
        name not in TABLE_FLAGS + EVAL_FLAGS or ONLY_WITH.get(name, "") not in ("", *words) or
        name in ("seed_protocol", "seed_bench") and "choice" not in kinds or
        name == "karpathy_split" and "caption" not in kinds)]


def job_flags(train_args, fields):
    """The fields of JOB_FLAGS that the --train-args tokens set, each flag read as argparse reads it (its whole name,
    or a prefix of one name alone among train.py's `fields`): a table's own per job, which --train-args, coming after
    them, would override."""
    flag = lambda name: "--" + name.replace("_", "-")
    found = []
    for token in (t.split("=", 1)[0] for t in train_args if t.startswith("--")):
        named = [n for n in fields if flag(n) == token] or [n for n in fields if flag(n).startswith(token)]
        found += named if len(named) == 1 and named[0] in JOB_FLAGS else []
    return found


def handed_on(args, defaults, names, cell_flags):
    """--flag value for each of `names` where args differs from the evaluate.py defaults, and where it applies to the
    cell of `cell_flags` (ONLY_WITH: the RICES, vector and FV flags only to their cells)."""
    out = []
    for name in names:
        value = getattr(args, name)
        if value != getattr(defaults, name) and ONLY_WITH.get(name, "") in ("", *cell_flags):
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def eval_size(n_eval, task):
    """The evaluation's --n-eval flags: the paper's items (VQAv2's 10,000, drawn with --seed; the other tasks'
    whole splits), at most --n-eval."""
    paper = tables.PAPER_ITEMS["vqav2"] if task == "vqav2" else None
    n = min(v for v in (paper, n_eval) if v) if paper or n_eval else None
    return ([] if n is None else ["--n-eval", str(n)]) + (["--eval-draw", "seeded"] if task == "vqav2" else [])


def study_size(study, n_eval, task):
    """A study's --n-eval flags: Tables 9's and 10's analyses on tables.ANALYSIS_ITEMS queries (VQAv2's drawn with
    --seed), at most --n-eval; Table 6's benchmark on the first query alone (none)."""
    if study == "benchmark":
        return []
    n = min(tables.ANALYSIS_ITEMS, n_eval or tables.ANALYSIS_ITEMS)
    return ["--n-eval", str(n)] + (["--eval-draw", "seeded"] if task == "vqav2" else [])


def run_name(flags):
    """A training's folder name: its method, then its other flags ("hyper-icl-anchor-none", "mimic")."""
    named = dict(zip(flags[::2], flags[1::2]))  # a cell's train.py flags come in pairs
    method = named.pop("--method", "hyper-icl")
    return "-".join([method, *(part for flag, value in named.items() for part in (flag.removeprefix("--"), value))])


def table_jobs(args, defaults, train_parse, table):
    """The jobs of a table's cells in the order the table reads (each training before its evaluation), once each:
    {cell: its evaluation job} and the list of jobs. train_parse: train.py's parse_args (each run's anchor and
    teacher)."""
    root = ["--model", args.model] + (["--data-root", args.data_root] if args.data_root else [])
    jobs, teachers, of_cell = {}, {}, {}
    for key, cell in table.cells.items():
        after, folder, evaluate = (), os.path.join(args.out, "eval", tasks.file_name(cell.task)), list(cell.evaluate)
        if cell.train is not None:
            task = tasks.file_name(cell.trained_on)
            folder = os.path.join(args.out, "train", task, run_name(cell.train))
            argv = (*root, "--task", cell.trained_on, "--out", folder, "--teacher-cache",
                    os.path.join(args.out, "teacher", task), "--proceed",
                    *handed_on(args, defaults, TRAIN_FLAGS, cell.train),
                    *shlex.split(args.train_args), *cell.train)
            cfg = train_parse(list(argv))
            teacher = registry.ANCHORS[cfg.anchor].teacher and (  # what the teacher's cached tensors depend on
                cfg.task, cfg.shots, cfg.icds, cfg.icd_task, cfg.seed, cfg.n_train, cfg.n_heldout)
            first = teachers.setdefault(teacher, argv) if teacher else argv  # the run that computes it
            jobs.setdefault(argv, tables.Job("train.py", argv, () if first == argv else (first,)))
            transfer = ["--checkpoint-task", cell.trained_on] if cell.trained_on != cell.task else []  # Table 8's
            after, evaluate = (argv,), ["--checkpoint", os.path.join(folder, "adapter.safetensors"), *transfer,
                                        *evaluate]
        if cell.study:  # Tables 6, 9, 10: lab's study of the adapter, its result file in the run's folder
            argv = (*root, "--task", cell.task, "--out", folder, *study_size(cell.study, args.n_eval, cell.task),
                    *handed_on(args, defaults, EVAL_FLAGS, ()), *evaluate)
            of_cell[key] = jobs.setdefault((cell.study, argv), tables.Job(cell.study, argv, after))
            continue
        kind = tasks.spec(cell.task).kind  # SEED's protocol; COCO's and Flickr30k's split where not Karpathy's val
        protocol = ["--seed-protocol", args.seed_protocol] if kind == "choice" else \
            [*tables.unless("--split", args.karpathy_split, "val")] if kind == "caption" else []
        argv = (*root, "--task", cell.task, "--out", folder, *eval_size(args.n_eval, cell.task),
                *handed_on(args, defaults, EVAL_FLAGS, evaluate), *protocol, *evaluate)
        of_cell[key] = jobs.setdefault(argv, tables.Job("evaluate.py", argv, after))
    trainings = [j for j in jobs.values() if j.script == "train.py"]  # first: one backbone state for all of them
    return of_cell, trainings + [j for j in jobs.values() if j.script != "train.py"]


class Shared:
    """load_backbone for every job of one process, which loads the backbone once. A training draws its adapter's
    first values from torch's generators after the load, and a load may draw from them (the toy backbone's init) or
    seed them (a tiny twin's builder), so before a training the generators are set where a fresh load from their
    present state leaves them: recorded at the load for that state, exact (a state not seen loads again; an
    evaluation that loads first does so from the state train.py seeds, --seed's, so its trainings need no other).
    Every job gets the backbone without an adapter, on the device train.py trains on (the accelerator, if any)."""

    def __init__(self, seed=0):
        self.backbone, self.key, self.after, self.loads, self.jobs, self.seed = None, None, {}, 0, 0, seed

    @staticmethod
    def state():
        """torch's generators: CPU and, where there is one, CUDA."""
        return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []

    @staticmethod
    def digest(state):
        return hashlib.sha256(b"".join(t.numpy().tobytes() for t in [state[0], *state[1]])).hexdigest()

    def load(self, name, image_splitting, image_memory):
        before = self.digest(self.state())
        self.backbone = backbones.load_backbone(name, "cuda" if torch.cuda.is_available() else "cpu",
                                                image_splitting=image_splitting, image_memory=image_memory)
        self.key, self.loads = (name, image_splitting, image_memory), self.loads + 1
        self.after[before] = self.state()

    def training(self, name, device=None, image_splitting="checkpoint", image_memory=None):
        """train.train's `load`."""
        before = self.digest(self.state())
        if self.key != (name, image_splitting, image_memory) or before not in self.after:
            self.load(name, image_splitting, image_memory)
        cpu, cuda = self.after[before]
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        return self.backbone

    def evaluation(self, name, image_splitting="checkpoint", image_memory=None):
        """evaluate.main's `load` (an evaluation draws nothing at random)."""
        if self.key != (name, image_splitting, image_memory):
            with torch.random.fork_rng():
                torch.manual_seed(self.seed)
                self.load(name, image_splitting, image_memory)
        return self.backbone

    def clean(self):
        """The backbone without the adapter a job attached."""
        if self.backbone is not None and hasattr(self.backbone.model, "icl_settings"):
            M.detach(self.backbone.model)


def run_jobs(jobs, mains, claims=None, seed=0):
    """Run the jobs in order in this process (mains: {"train.py": train.main, "evaluate.py": evaluate.main, and each
    study's main: "benchmark", "gates", "hyperbolicity"}), the
    backbone loaded once (Shared; seed: the runs' --seed). claims: under --gpus, the folder where the processes
    claim jobs and mark them done: a job waits for the jobs before it and is left to the process that holds it.
    Returns the Shared loader."""
    shared, done = Shared(seed), set()
    while len(done) < len(jobs):
        done |= {(j.script, j.argv) for j in jobs if claims and marked(claims, j)}
        for job in [j for j in jobs if (j.script, j.argv) not in done and
                    all(("train.py", a) in done for a in j.after)]:
            with claimed(claims, job) as mine:
                if mine:
                    print(f"[{len(done) + 1}/{len(jobs)}] {job.line()}", flush=True)
                    shared.jobs += 1
                    try:
                        mains[job.script](list(job.argv), load=shared.training if job.script == "train.py" else
                                          shared.evaluation)
                    except ValueError as e:
                        raise in_table(job, e) from e
                    finally:
                        shared.clean()
                    if claims:
                        files.write_json(os.path.join(claims, job.key() + ".done"), job.line())
            if mine:
                done.add((job.script, job.argv))
                break
        else:  # every job that may start is another process's, or waits for one
            time.sleep(1)
    return shared


def in_table(job, error):
    """A training job's refusal (a run of other settings in its folder) with the advice a table can follow: it gives
    each run its --out and --proceed and takes no --overwrite, so the run's folder is moved or removed instead."""
    if job.script != "train.py":
        return error
    out = job.argv[job.argv.index("--out") + 1]
    return ValueError(f"{error}. From a table, which sets each run's --out and --proceed and takes no --overwrite: "
                      f"move or remove {out} to train that run again, or give the table another --out")


def marked(claims, job):
    """Whether `job` is done in this --gpus run."""
    return os.path.exists(os.path.join(claims, job.key() + ".done"))


@contextlib.contextmanager
def claimed(claims, job):
    """Hold `job` for this process (True), or not if another process holds it (False); always without --gpus."""
    if claims is None:
        yield True
        return
    try:
        with locks.locked(os.path.join(claims, job.key())):
            yield not marked(claims, job)
    except ValueError:  # held by another process
        yield False


def on_devices(gpus, out, argv, command):
    """--gpus: one process per device (CUDA_VISIBLE_DEVICES: the device of that number among those this process
    sees, as a scheduler's CUDA_VISIBLE_DEVICES lists them), each running `command` (its words: python -m lab table
    N) with argv and --table-worker (which
    makes it a worker), taking the next job not claimed by another (run_jobs); waits for all. The claims of this run
    live in <out>/claims/<this process's id>, so a rerun after a stop runs every job again (each one skips what is
    done)."""
    claims = worker_claims(out, os.getpid())
    os.makedirs(claims, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, *command[1:], *argv, "--table-worker", claims],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": visible_device(int(device))})
             for device in gpus.split(",")]
    failed = [p for p in procs if p.wait() != 0]
    if failed:
        raise ValueError(f"{len(failed)} of the --gpus processes failed (their output is above); run the same command "
                         "again to continue")


SHARDED = ("train.py", "evaluate.py")  # the jobs --shard runs over every device; a study runs on the first alone


def sharded_launch(job, gpus):
    """The job under --gpus with --shard: (CUDA_VISIBLE_DEVICES, its words): a training or evaluation over all the
    devices at once (torchrun, one process a device, --shard), a study unsharded in one process on the first."""
    visible = [visible_device(int(d)) for d in gpus.split(",")]
    if job.script not in SHARDED:
        return visible[0], shlex.split(job.line())
    return ",".join(visible), ["torchrun", "--standalone", f"--nproc_per_node={len(visible)}",
                               *shlex.split(job.line())[1:], "--shard"]


def sharded_line(job, gpus):
    """sharded_launch as one shell line: CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun ... --shard."""
    visible, words = sharded_launch(job, gpus)
    return f"CUDA_VISIBLE_DEVICES={visible} {shlex.join(words)}"


def on_all_devices(jobs, gpus):
    """--gpus with --shard: each job in turn (dependency order) over all the devices (sharded_launch), in a process of
    its own, this Python's torchrun and python; a failed job stops the table, named (each finished job is skipped by
    its own command, so the same table command continues)."""
    for k, job in enumerate(jobs):
        visible, words = sharded_launch(job, gpus)
        print(f"[{k + 1}/{len(jobs)}] {sharded_line(job, gpus)}", flush=True)
        launcher = ["-m", "torch.distributed.run"] if words[0] == "torchrun" else []
        done = subprocess.run([sys.executable, *launcher, *words[1:]], env={**os.environ,
                                                                             "CUDA_VISIBLE_DEVICES": visible})
        if done.returncode != 0:
            raise ValueError(f"job {k + 1} of {len(jobs)} failed (exit {done.returncode}; its output is above): "
                             f"{sharded_line(job, gpus)}; run the same command again to continue")


def worker_claims(out, pid):
    """The claims folder of the --gpus run started by process `pid`: <out>/claims/<host>-<pid>."""
    return os.path.join(out, "claims", f"{files.this_host()}-{pid}")


def visible_device(number):
    """The CUDA_VISIBLE_DEVICES entry of the device CUDA numbers `number` in this process: the number itself, or the
    number-th entry of this process's own CUDA_VISIBLE_DEVICES (a scheduler's "4,5,6,7": 0 is 4)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return str(number) if seen is None else [d.strip() for d in seen.split(",")][number]


def run_table(args, argv, mains, parsers, command):
    """python -m lab table N / figure N: the table's jobs run (or with --print-commands printed, with --plan
    planned), then the table printed beside the paper's numbers (table_print.write; --print: that alone). mains:
    {"train.py": lab's train, "evaluate.py": lab's evaluate} (lab/cli/modes.py); parsers: their parse_args; command:
    the words of this mode, ["python", "-m", "lab", "table", "1"] (--gpus starts it once per device, run from the
    project's root); argv: this command's flags after them."""
    train_parse, eval_parse = parsers
    if args.table_worker and args.table_worker != worker_claims(args.out, os.getppid()):
        raise ValueError(f"--table-worker {args.table_worker}: --gpus gives it to the processes it starts (their "
                         "claims folder); run the table with --gpus 0,1,... instead, or without either in one process")
    name = args.table or f"figure-{args.figure}"
    table = tables.layout(name, families.family_of(args.model), train_parse(shlex.split(args.train_args)).n_train,
                          args.seed_bench)
    of_cell, jobs = table_jobs(args, eval_parse([]), train_parse, table)
    if args.plan:
        return table_plan.plan_table(args, table, jobs, parsers)
    if args.print_commands:
        table_line = [*command, *(a for a in argv if a != "--print-commands"), "--print"]
        lines = [sharded_line(j, args.gpus) if args.shard else j.line() for j in jobs] + [shlex.join(table_line)]
        print("\n".join(lines))
        return lines
    run = not args.print  # --print with --gpus (the line --print-commands ends with) runs nothing
    if run and args.gpus and args.shard:
        on_all_devices(jobs, args.gpus)
    elif run and args.gpus and not args.table_worker:
        on_devices(args.gpus, args.out, argv, command)
    elif run:
        shared = run_jobs(jobs, mains, args.table_worker, args.seed)
        print(f"{table.name}: {shared.jobs} of its {len(jobs)} jobs run in this process, the backbone loaded "
              f"{shared.loads} time(s)")
    return None if args.table_worker else table_print.write(args.model, args.out, name, table, of_cell, parsers,
                                                            args.print)


TABLES = tuple(map(str, range(1, 12))) + tables.EXTRA_TABLES  # table N: the paper's, HiFICL's, the robustness study


@dataclass
class Settings:
    """evaluate.py's flags of --table and --figure (its Config gathers them: a field = a flag, its comment the help):
    folders under --out (None: runs/tables/<model>), the cells' sizes from --n-eval and --train-args, the paper's
    otherwise."""
    table: Optional[Literal[TABLES]] = None  # the paper's table for --model, each cell run once
    figure: Optional[Literal["2", "3a", "3b", "4"]] = None  # a figure's cells as a table, and its figure (4: a page)
    print: bool = False               # print the table from its result files, beside the paper's; run nothing
    print_commands: bool = False      # print each job as one idempotent shell line, in dependency order; run nothing
    gpus: Optional[str] = None        # devices, as 0,1,2,3: one process each, each taking the next job
    table_worker: Optional[str] = None  # --gpus' own: the claims folder of one device's process
    karpathy_split: Literal["val", "test"] = "val"  # COCO's, Flickr30k's split: Karpathy's val (MimIC's code) or test
    seed_bench: Literal["2", "1"] = "2"  # the SEED column: SEED-Bench-2 (the paper's 24,000 questions) or SEED-Bench-1
