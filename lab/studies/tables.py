"""The paper's tables as data (Tables 1-11, the sweeps of Figures 2, 3a, 3b and Figure 4's gallery): for a backbone
family, each table's rows and columns as the paper lays them out and each cell's single commands (the train.py run it
scores, if any, and the evaluate.py flags that score it, or the study of lab that measures it: Tables 6, 9, 10), and
the paper's published numbers (PAPER, PARAMS), which
tests/lab/studies/test_tables.py checks against the paper's own table text (paper-tables.txt beside this file).
Running, printing and planning a table: table_runs.py, table_print.py, table_plan.py."""
import hashlib
import shlex
from dataclasses import dataclass, field, replace

from lab.datasets import tasks


@dataclass(frozen=True)
class Cell:
    """One number of a table: the task it is scored on, evaluate.py's flags beyond every cell's (--shots 8, --icds
    rices, --vector tv, --icd-task vqav2), and the train.py run whose adapter it scores (its flags beyond every
    run's; None: no adapter) on `train_task` (None: `task`; Table 8: the source task). `study`: lab's mode that
    measures the cell on the adapter instead of evaluate.py (Table 6's benchmark, 9's hyperbolicity, 10's gates);
    `read`: the number of its result the cell shows (None: the evaluation's headline metric; Table 5: its CHAIR
    numbers, counted on the evaluation's predictions; a study's: a path in its result file, "teacher/mean")."""
    task: str
    evaluate: tuple = ()
    train: tuple | None = None
    train_task: str | None = None
    study: str | None = None
    read: str | None = None

    @property
    def trained_on(self):
        """The task the cell's adapter trains on."""
        return self.train_task or self.task


@dataclass(frozen=True)
class Table:
    """A table for one backbone family: its rows and columns in the paper's order, each cell, and the rows that the
    paper does not hold (HiFICL: the project's second method, shown beside Table 1's rows)."""
    name: str
    caption: str
    rows: tuple
    columns: tuple
    cells: dict = field(hash=False)  # (row, column) -> Cell
    extra: tuple = ()
    figure: str | None = None        # a sweep: how its figure plots it ("lines": a line per row over the columns)
    params: bool = False             # a row per method: a # Params column (the adapter's parameters)
    digits: int = 2                  # decimals of its numbers (the paper's: Tables 6 and 9 write three)


@dataclass(frozen=True)
class Job:
    """One command of a table: train.py's or evaluate.py's run with lab's flags (`python -m lab train`, `python -m lab
    evaluate`) or a study of lab (script "benchmark", "gates", "hyperbolicity": `python -m lab gates`, with
    evaluate's flags), and the jobs that must be done before it (the training whose adapter it scores; the first run
    that computes the teacher it distils from)."""
    script: str
    argv: tuple
    after: tuple = ()

    def line(self):
        """The job as one idempotent shell line, run from the project's root."""
        return shlex.join(["python", "-m", "lab", self.script.removesuffix(".py"), *self.argv])

    def args(self, parsers):
        """The job's flags parsed by its command's parser (parsers: lab's train's, evaluate's), before it runs: an
        adapter that is not trained yet is named, not checked."""
        if self.script == "train.py":
            return parsers[0](list(self.argv))
        argv, adapter = list(self.argv), {}
        for name in ("checkpoint", "checkpoint_task"):  # the adapter and, for a transfer, its task
            if f"--{name.replace('_', '-')}" in argv:
                k = argv.index(f"--{name.replace('_', '-')}")
                adapter[name] = argv.pop(k + 1)
                argv.pop(k)
        return replace(parsers[1](argv), **adapter)

    def key(self):
        """A short name of the job (its claim and done marks under --gpus)."""
        return hashlib.sha256(self.line().encode()).hexdigest()[:16]


# --------------------------------------------------------------------- the paper's numbers (paper-tables.txt)

FAMILY_NAMES = {"idefics": "Idefics-9b", "idefics2": "Idefics2-8b", "llava-interleave": "LLaVA-Interleave-7B",
                "llava-onevision": "LLaVA-OneVision (Qwen2-7B)"}

TASK_NAMES = {"vqav2": "VQAv2", "ok-vqa": "OK-VQA", "coco": "COCO", "flickr30k": "Flickr30k", "mme": "MME",
              "seed": "SEED"}


def grid(columns, rows):
    """{(row, column): value} of {row: its values in the order of `columns`}."""
    return {(r, c): v for r, values in rows.items() for c, v in zip(columns, values, strict=True)}


T1, T2, T3 = ("vqav2", "ok-vqa", "coco"), ("flickr30k", "mme", "seed"), ("4", "8", "16", "32", "48", "64")
T4 = ("Zero-shot", "L_sup", "L_sup + L_L2-anchor", "L_H-anchor", "L_sup + L_H-anchor")
T8 = ("Zero-shot", "8-shot ICL", "Hyper-ICL")

PAPER = {  # table -> backbone family -> {(row, column): the published number}
    "1": {"idefics": grid(T1, {
              "Zero-shot": (29.25, 30.54, 63.06), "32-shot ICL": (56.18, 48.48, 105.89),
              "RICES": (58.07, 51.11, 110.64), "FV": (30.21, 31.02, 74.01), "TV": (43.68, 32.68, 84.72),
              "LoRA": (55.60, 47.06, 97.75), "LIVE": (53.71, 46.05, 112.76), "MimIC": (59.64, 52.05, 114.89),
              "Hyper-ICL": (62.08, 55.31, 117.44)}),
          "idefics2": grid(T1, {
              "Zero-shot": (55.39, 43.08, 40.00), "8-shot ICL": (66.20, 57.68, 122.51),
              "RICES": (66.44, 55.73, 111.44), "FV": (36.47, 34.58, 75.24), "TV": (47.12, 38.27, 87.61),
              "LoRA": (66.54, 55.05, 116.69), "LIVE": (67.60, 54.86, 126.04), "MimIC": (69.29, 58.74, 132.87),
              "Hyper-ICL": (71.17, 62.24, 135.66)})},
    "2": {"idefics": grid(T2, {"Zero-shot": (49.17, 55.36, 27.56), "ICL": (63.41, 52.11, 28.30),
                               "Hyper-ICL": (75.96, 65.46, 31.87)}),
          "idefics2": grid(T2, {"Zero-shot": (53.04, 74.80, 12.91), "ICL": (84.57, 71.10, 47.90),
                                "Hyper-ICL": (93.79, 82.13, 48.31)})},
    "3": {"idefics": grid(T3, {"VQAv2 ICL": (53.72, 54.24, 55.70, 56.18, 56.67, 56.71),
                               "VQAv2 Hyper-ICL": (57.87, 58.81, 59.73, 62.08, 62.61, 62.90),
                               "OK-VQA ICL": (46.11, 46.79, 47.70, 48.48, 48.68, 48.60),
                               "OK-VQA Hyper-ICL": (50.21, 51.79, 53.22, 55.31, 55.53, 55.26)})},
    "4": {"idefics": grid(T4, {"vqav2": (29.25, 57.11, 59.64, 60.53, 62.08),
                               "ok-vqa": (30.54, 49.23, 53.76, 53.78, 55.31)})},
    "7": {"llava-interleave": grid(T1[:2], {"Zero-shot": (13.02, 5.10), "8-shot ICL": (68.19, 43.84),
                                            "MimIC": (74.40, 52.29), "Hyper-ICL": (76.51, 56.77)}),
          "llava-onevision": grid(T1[:2], {"Zero-shot": (71.75, 48.19), "8-shot ICL": (78.70, 66.59),
                                           "MimIC": (81.22, 69.43), "Hyper-ICL": (82.24, 75.32)})},
    "8": {"idefics2": grid(T8, {"coco -> flickr30k": (53.04, 73.26, 87.42),
                                "vqav2 -> ok-vqa": (43.08, 51.43, 59.11)})},
    "11": {"idefics": grid(T1[:2], {"Intervention on O": (58.42, 50.18), "Hyper-ICL": (62.08, 55.31)})},
}

T5 = ("Z-Shot", "32-ICL", "TV", "FV", "LoRA", "LIVE", "MimIC", "Hyper-ICL")
T6 = ("Hyper-ICL", "0-Shot", "8-shot", "16-shot", "32-shot")
T9 = ("Teacher hidden states", "Student hidden states + Euclidean anchor", "Student hidden states + Hyperbolic anchor")
T10 = ("Early-layer mean g", "Late-layer mean g", "Avg. per-layer std g", "Corr(g, Delta A)")

PAPER |= {  # Tables 5, 6, 9, 10 (Table 9's mean +- std as two columns) and Figure 3a's values in the text (Section 4.3)
    "5": {"idefics": grid(T5, {"CHAIRs": (5.93, 16.78, 8.88, 28.26, 17.42, 8.65, 8.51, 8.29),
                               "CHAIRi": (5.58, 9.77, 7.50, 25.44, 11.55, 6.05, 5.74, 5.63),
                               "Recall": (30.72, 42.59, 36.22, 27.69, 42.93, 42.84, 43.30, 44.04)})},
    "6": {"idefics2": grid(T6, {"FLOPs (T)": (0.955, 0.935, 6.375, 12.341, 23.364),
                                "Runtime (ms)": (59.32, 56.69, 158.21, 266.13, 468.55)})},
    "9": {"idefics2": grid(("mean", "std"), dict(zip(T9, ((0.228, 0.014), (0.314, 0.023), (0.247, 0.016)))))},
    "10": {"idefics": grid(T10, {"vqav2": (0.38, 0.46, 0.17, 0.41), "ok-vqa": (0.43, 0.62, 0.23, 0.56)})},
    "figure-3a": {"idefics": grid(("2", "4", "8"), {"Hyper-ICL": (60.9, 62.1, 62.2)})},
}

PARAMS = {  # Table 1's # Params (M), per backbone family and row
    "idefics": {"LoRA": 25.0, "LIVE": 0.13, "MimIC": 0.26, "Hyper-ICL": 1.18},
    "idefics2": {"LoRA": 17.6, "LIVE": 0.13, "MimIC": 0.26, "Hyper-ICL": 1.18}}

PAPER_ITEMS = {  # items the paper scores a task on (Section 4.1): VQAv2's 10,000 validation questions; the full
    # OK-VQA val and Karpathy val splits (NOTES); MME and SEED-Bench less the 1,000 training queries drawn from them:
    # MME's 2,374 questions, SEED-Bench-2's 24,000 (the paper's count), SEED-Bench-1's 14,233 image questions
    "vqav2": 10_000, "ok-vqa": 5_046, "coco": 5_000, "flickr30k": 1_014, "mme": 1_374, "seed2": 23_000,
    "seed": 13_233}

NOTES = {  # a table's footnote where a row (by name) or a cell's task runs other than the paper's words, and why
    # (docs/tables.md, "The paper's settings")
    "LoRA": "LoRA: peft on every module named q/k/v/o_proj (MimIC's public LoRA settings, its "
            "src/config/peft/lora.yaml): the vision encoder's attention but its out_proj, the perceiver's, the "
            "decoder's. They give Table 1's 25.0 M (Idefics-9b) and 17.6 M (Idefics2) exactly; the paper's words, "
            "\"all attention layers in both the vision and language encoders\", would give 25.5 M on Idefics-9b "
            "(out_proj in, the perceiver out; 17.6 M on Idefics2).",
    "coco": "COCO: Karpathy's val split (5,000 images), the one MimIC's code evaluates (src/dataset_utils/caption.py: "
            "the Karpathy file's \"val\") for the paper's protocol, \"the full validation splits for OK-VQA and "
            "COCO\" (LIVE's code reads COCO 2017's val, also 5,000 images); --karpathy-split test: Karpathy's test.",
    "flickr30k": "Flickr30k: Karpathy's val split (1,014 images), as MimIC's code reads it (the paper names none); "
                 "--karpathy-split test: Karpathy's test (1,000).",
    "mme": "MME: every question outside the training pool (tasks.pool_fraction: the images of the paper's 1,000 "
           "training queries + 32 held out, split by image and subtask; 1,340 of 2,374), unless --n-eval caps it. "
           "The paper draws its training queries from MME itself; scoring them would score an adapter on its "
           "training data, and MimIC's code (src/dataset_utils/mme.py) evaluates only the questions it does not "
           "train on: the paper's count is 2,374 less its 1,000.",
    "seed2": "SEED: SEED-Bench-2, the benchmark of the paper's citation (Li et al., 2024a: \"24K multiple-choice "
             "questions\"; the paper's \"24,000\"), its single-image part (dimensions 1-16, levels L1-L2; the "
             "rest needs several images, a video or an image output), every question outside the training pool "
             "(as MME's) unless --n-eval caps it. --seed-bench 1: SEED-Bench-1's 14,233 image questions, what MimIC's "
             "code reads (testbed/data/seed_bench).",
    "seed": "SEED: SEED-Bench-1's 14,233 image questions (--seed-bench 1, what MimIC's code reads), every question "
            "outside the training pool (as MME's); the paper's \"24,000 multiple-choice questions\" is SEED-Bench-2, "
            "the default.",
}

# ------------------------------------------------------------------------------------------- the tables' cells

TRAINED = {"LoRA": ("--method", "lora"), "LIVE": ("--method", "live"), "MimIC": ("--method", "mimic"),
           "Hyper-ICL": (), "HiFICL": ("--method", "hificl")}  # Table 1's learnable rows: train.py flags

FIGURE_METHODS = ("LoRA", "LIVE", "MimIC", "Hyper-ICL")  # Figure 2's lines; Table 5's and Figure 4's adapters

FIGURE_SIZES = (0.1, 0.25, 0.5, 1.0)  # Figure 2's training sizes, shares of the runs' --n-train (the paper's 1,000;
# the figure's axis values are not in its text)

RANKS, GATES = ("2", "4", "8"), {"Hyper-ICL": "hyper-icl", "static, layer-wise": "static-layer",
                                 "static, layer & head-wise": "static-layer-head"}  # Figure 3a

KAPPAS, LAMBDAS = ("0.01", "0.1", "1"), ("0.25", "0.5", "1")  # Figure 3b (the paper's lambdas are not in its text)

ANALYSIS_ITEMS = 1000  # queries Tables 9 and 10 analyse (Appendix C: 1,000 VQAv2 samples; Table 10's subsets: as many)


def unless(flag, value, default):
    """(flag, value), or () where value is the default: a run of default settings is named and shared as one."""
    return () if str(value) == str(default) else (flag, str(value))


SEED_BENCH = {"2": "seed2", "1": "seed"}  # --seed-bench: the task of a SEED column (NOTES)


def layout(name, family, n_train=1000, seed_bench="2"):
    """The Table `name` ("1", ..., "11", "figure-2", "figure-3a", "figure-3b", "figure-4", HiFICL's, robustness) for
    a backbone family; n_train: the runs' training queries (Figure 2's sizes are shares of it); seed_bench: which
    SEED-Bench its SEED cells run (SEED_BENCH)."""
    if name not in LAYOUTS:
        raise ValueError(f"no table {name!r}; choose from {', '.join(LAYOUTS)}")
    table = LAYOUTS[name](family, n_train)
    return replace(table, cells={key: replace(cell, task=SEED_BENCH[seed_bench]) if cell.task == "seed" else cell
                                 for key, cell in table.cells.items()})


def icl(task, family, source=None):
    """The n-shot ICL cell of a task, at the paper's shots for it (tasks.default_shots; ICDs from `source`'s training
    split: Table 8)."""
    shots = ("--shots", str(tasks.default_shots(source or task, family)))
    return Cell(task, shots + (("--icd-task", source) if source else ()))


def table_1(family, n_train):
    n = tasks.default_shots("vqav2", family)
    rows = {"Zero-shot": lambda t: Cell(t, ("--shots", "0")), f"{n}-shot ICL": lambda t: icl(t, family),
            "RICES": lambda t: Cell(t, ("--shots", str(tasks.default_shots(t, family)), "--icds", "rices")),
            "FV": lambda t: Cell(t, ("--vector", "fv")), "TV": lambda t: Cell(t, ("--vector", "tv")),
            **{m: (lambda t, m=m: Cell(t, train=trained(m, t))) for m in TRAINED}}
    return Table("Table 1", "Results of VQAv2, OK-VQA, and COCO", tuple(rows), T1,
                 {(r, t): make(t) for r, make in rows.items() for t in T1}, extra=("HiFICL",), params=True)


def table_2(family, n_train):
    rows = {"Zero-shot": lambda t: Cell(t, ("--shots", "0")), "ICL": lambda t: icl(t, family),
            "Hyper-ICL": lambda t: Cell(t, train=())}
    return Table("Table 2", "Results evaluated on more challenging tasks", tuple(rows), T2,
                 {(r, t): make(t) for r, make in rows.items() for t in T2}, params=True)


def table_3(family, n_train):
    cells = {}
    for task in T1[:2]:
        default = tasks.default_shots(task, family)
        for n in T3:
            cells[f"{TASK_NAMES[task]} ICL", n] = Cell(task, ("--shots", n))
            cells[f"{TASK_NAMES[task]} Hyper-ICL", n] = Cell(task, train=unless("--shots", n, default))
    return Table("Table 3", "Effect of the number of demonstrations", tuple(dict.fromkeys(r for r, _ in cells)),
                 T3, cells, figure="lines")


def table_4(family, n_train):
    objectives = dict(zip(T4[1:], (("--anchor", "none"), ("--anchor", "euclidean"), ("--lam", "0"), ())))
    cells = {(t, "Zero-shot"): Cell(t, ("--shots", "0")) for t in T1[:2]}
    cells |= {(t, o): Cell(t, train=f) for t in T1[:2] for o, f in objectives.items()}
    return Table("Table 4", "Ablation of Hyper-ICL training objectives", T1[:2], T4, cells)


def table_7(family, n_train):
    rows = {"Zero-shot": lambda t: Cell(t, ("--shots", "0")), f"{tasks.default_shots('vqav2', family)}-shot ICL":
            lambda t: icl(t, family), "MimIC": lambda t: Cell(t, train=TRAINED["MimIC"]),
            "Hyper-ICL": lambda t: Cell(t, train=())}
    return Table("Table 7", "Results evaluated on additional MLLMs", tuple(rows), T1[:2],
                 {(r, t): make(t) for r, make in rows.items() for t in T1[:2]}, params=True)


def table_8(family, n_train):
    cells = {}
    for source, target in (("coco", "flickr30k"), ("vqav2", "ok-vqa")):
        row = f"{source} -> {target}"
        cells |= {(row, "Zero-shot"): Cell(target, ("--shots", "0")),
                  (row, "8-shot ICL"): icl(target, family, source),
                  (row, "Hyper-ICL"): Cell(target, train=(), train_task=source)}
    return Table("Table 8", "Held-out benchmark transfer (train -> test)", ("coco -> flickr30k", "vqav2 -> ok-vqa"),
                 T8, cells)


def table_11(family, n_train):
    rows = {"Intervention on O": ("--method", "output-level"), "Hyper-ICL": ()}
    return Table("Table 11", "The module on the attention output O vs on the logits (Hyper-ICL)", tuple(rows),
                 T1[:2], {(r, t): Cell(t, train=f) for r, f in rows.items() for t in T1[:2]}, params=True)


def table_figure_2(family, n_train):
    sizes = tuple(dict.fromkeys(max(1, round(share * n_train)) for share in FIGURE_SIZES))
    cells = {}
    for task in T1[:2]:
        for n in sizes:
            cells |= {(f"{TASK_NAMES[task]} {m}", str(n)): Cell(task, train=TRAINED[m] + unless("--n-train", n,
                                                                                                  n_train))
                      for m in FIGURE_METHODS}
            cells[f"{TASK_NAMES[task]} {tasks.default_shots(task, family)}-shot ICL", str(n)] = icl(task, family)
    return Table("Figure 2", "Accuracy against training queries (ICL: the same at every size)",
                 tuple(dict.fromkeys(r for r, _ in cells)), tuple(map(str, sizes)), cells, figure="lines")


def table_figure_3a(family, n_train):
    cells = {(g, r): Cell("vqav2", train=unless("--method", m, "hyper-icl") + unless("--rank", r, 4))
             for g, m in GATES.items() for r in RANKS}
    return Table("Figure 3a", "Rank r and static gates (VQAv2)", tuple(GATES), RANKS, cells, figure="lines")


def table_figure_3b(family, n_train):
    cells = {(k, lam): Cell("vqav2", train=unless("--kappa", k, "0.1") + unless("--lam", lam, "0.5"))
             for k in KAPPAS for lam in LAMBDAS}
    return Table("Figure 3b", "Curvature kappa (rows) and lambda (columns) (VQAv2)", KAPPAS, LAMBDAS, cells,
                 figure="lines")


def table_5(family, n_train):
    """CHAIR on COCO: each column's cell is Table 1's COCO evaluation, its predictions counted by CHAIR."""
    n = tasks.default_shots("coco", family)
    methods = {"Z-Shot": Cell("coco", ("--shots", "0")), f"{n}-ICL": icl("coco", family),
               "TV": Cell("coco", ("--vector", "tv")), "FV": Cell("coco", ("--vector", "fv")),
               **{m: Cell("coco", train=TRAINED[m]) for m in FIGURE_METHODS}}
    metrics = {"CHAIRs": "chair_s", "CHAIRi": "chair_i", "Recall": "recall"}
    return Table("Table 5", "Caption hallucination on COCO (CHAIR of Table 1's COCO predictions, x 100)",
                 tuple(metrics), tuple(methods), {(r, c): replace(cell, read=k) for r, k in metrics.items()
                                                  for c, cell in methods.items()})


def table_6(family, n_train):
    """FLOPs and latency of one VQAv2 query to its first token (lab's benchmark on Table 1's VQAv2 adapter)."""
    settings = {"Hyper-ICL": "hyper-icl", "0-Shot": "zero-shot", "8-shot": "8-shot", "16-shot": "16-shot",
                "32-shot": "32-shot"}
    metrics = {"FLOPs (T)": "prefill_tflops", "Runtime (ms)": "prefill_ms"}
    cells = {(r, c): Cell("vqav2", train=(), study="benchmark", read=f"rows/{s}/{k}") for r, k in metrics.items()
             for c, s in settings.items()}
    return Table("Table 6", "Inference FLOPs and runtime of a VQAv2 query to its first token (lab's benchmark)",
                 tuple(metrics), tuple(settings), cells, digits=3)


def table_9(family, n_train):
    """Relative delta-hyperbolicity of the teacher's and two students' states (Table 1's and Table 4's runs)."""
    runs = {T9[0]: ((), "teacher"), T9[1]: (("--anchor", "euclidean"), "student"), T9[2]: ((), "student")}
    return Table("Table 9", "Relative delta-hyperbolicity of the middle layers' query states on VQAv2, mean and std "
                 "over queries", T9, ("mean", "std"),
                 {(r, c): Cell("vqav2", train=f, study="hyperbolicity", read=f"{who}/{c}")
                  for r, (f, who) in runs.items() for c in ("mean", "std")}, digits=3)


def table_10(family, n_train):
    """The gates of Table 1's Hyper-ICL adapters on VQAv2 and OK-VQA."""
    reads = dict(zip(T10, ("early_mean", "late_mean", "per_layer_std", "corr_g_delta_attention")))
    return Table("Table 10", "The query-adaptive gates g: early-layer (first quarter) and late-layer (last quarter) "
                 "mean, per-layer std, Pearson Corr(g, Delta A)", T1[:2], T10,
                 {(t, c): Cell(t, train=(), study="gates", read=k) for t in T1[:2] for c, k in reads.items()})


def table_figure_4(family, n_train):
    """Figure 4's queries: Table 1's VQA cells of n-shot ICL and the adapters, their answers shown side by side."""
    rows = {f"{tasks.default_shots('vqav2', family)}-shot ICL": lambda t: icl(t, family),
            **{m: (lambda t, f=TRAINED[m]: Cell(t, train=f)) for m in FIGURE_METHODS}}
    return Table("Figure 4", "VQA answers of n-shot ICL and the adapters (the gallery: figure-4.html)", tuple(rows),
                 T1[:2], {(r, t): make(t) for r, make in rows.items() for t in T1[:2]}, figure="gallery")


LAYOUTS = {"1": table_1, "2": table_2, "3": table_3, "4": table_4, "7": table_7, "8": table_8, "11": table_11,
           "figure-2": table_figure_2, "figure-3a": table_figure_3a, "figure-3b": table_figure_3b}
LAYOUTS |= {"5": table_5, "6": table_6, "9": table_9, "10": table_10, "figure-4": table_figure_4}


def published(name, family, row, column):
    """The paper's number of a cell (None where the paper has none: another backbone, a row of ours); HiFICL's
    paper's in its tables and in Table 1's HiFICL row (from_hificl)."""
    if from_hificl(name, row):
        return HIFICL_PAPER[BESIDE.get((name, row), name)].get(family, {}).get((row, column))
    return PAPER.get(name, {}).get(family, {}).get((row, column))


# ------------------------------------- HiFICL's tables (hificl-tables.txt) and the robustness study, as data

HIFICL_PAPER = {  # HiFICL's paper (arXiv 2603.12760): table -> backbone family -> {(row, column): its number}, its
    # COCO CIDEr x 100 as this project prints it (its text writes 1.3315)
    "hificl-1": {"llava-interleave": grid(T1, {
                     "8-shot ICL": (68.19, 43.84, 120.85), "LoRA": (70.12, 48.19, 106.65),
                     "MimIC": (74.40, 52.29, 131.69), "HiFICL": (74.66, 54.19, 133.15)}),
                 "idefics2": grid(T1, {"MimIC": (69.29, 58.74, 128.27), "HiFICL": (72.08, 59.56, 129.51)})},
    "hificl-ablation": {"idefics2": grid(T1, {
        "HiFICL": (72.08, 59.56, 129.51), "+ teacher alignment": (70.09, 59.13, 128.44),
        "K without low-rank": (70.58, 55.72, 126.52), "V without low-rank": (69.31, 56.86, 126.18),
        "alpha = 1": (70.14, 58.51, 128.08)})}}

HIFICL_PARAMS = {"llava-interleave": {"LoRA": 19.7, "MimIC": 17.0, "HiFICL": 2.2},  # its tables' # Params (M)
                 "idefics2": {"MimIC": 0.26, "HiFICL": 2.2}}

BESIDE = {("1", "HiFICL"): "hificl-1"}  # a row of the Hyper-ICL paper's tables shown with HiFICL's published number

HIFICL_RANKS = {"vqav2": 8, "ok-vqa": 16, "coco": 8}  # HiFICL's r per task (RANK_NOTE)
RANK_NOTE = "HiFICL at its paper's best rank per task: 8 on VQAv2, 16 on OK-VQA; 8 on COCO, for which it names none"
NOTES["HiFICL"] = f"HiFICL: {RANK_NOTE} (its paper's Section 4.1; lab/studies/tables.py:HIFICL_RANKS)."

HIFICL_ABLATION = {"HiFICL": "hificl", "+ teacher alignment": "hificl-teacher", "K without low-rank": "hificl-full-k",
                   "V without low-rank": "hificl-full-v", "alpha = 1": "hificl-linear"}  # its rows: the methods

ROBUST = ("Hyper-ICL", "MimIC", "HiFICL", "LIVE", "LoRA")  # the robustness table's rows: the trained methods


def from_hificl(name, row):
    """Whether a cell's published number is HiFICL's paper's (its tables; Table 1's HiFICL row)."""
    return name in HIFICL_PAPER or (name, row) in BESIDE


def hificl(task, method="hificl"):
    """train.py's flags of HiFICL or one of its ablations on a task: the method at its paper's rank for the task
    (HIFICL_RANKS; the registry's 8 unnamed, so that a run of default settings is shared)."""
    return ("--method", method) + unless("--rank", HIFICL_RANKS[task], 8)


def trained(row, task):
    """A learnable row's train.py flags on a task (TRAINED; HiFICL's at its rank for the task)."""
    return hificl(task) if row == "HiFICL" else TRAINED[row]


def table_hificl_1(family, n_train):
    rows = {"8-shot ICL": lambda t: Cell(t, ("--shots", "8")),
            **{m: (lambda t, m=m: Cell(t, train=trained(m, t))) for m in ("LoRA", "MimIC", "HiFICL")}}
    return Table("HiFICL Table 1", f"HiFICL's main results, {RANK_NOTE}", tuple(rows), T1,
                 {(r, t): make(t) for r, make in rows.items() for t in T1}, params=True)


def table_hificl_ablation(family, n_train):
    return Table("HiFICL ablation", f"HiFICL's components, {RANK_NOTE}", tuple(HIFICL_ABLATION), T1,
                 {(r, t): Cell(t, train=hificl(t, m)) for r, m in HIFICL_ABLATION.items() for t in T1}, params=True)


def table_robustness(family, n_train):
    """Each trained method with the backbone's n ICDs back in its prompt (the adapter plugged): a task's 0-shot
    column is the adapter alone (Table 1's cell), its n-shot column the same adapter after n demonstrations."""
    cells = {}
    for t in T1:
        n = tasks.default_shots(t, family)
        for m in ROBUST:
            cells[m, f"{TASK_NAMES[t]} 0-shot"] = Cell(t, train=trained(m, t))
            cells[m, f"{TASK_NAMES[t]} {n}-shot"] = Cell(t, ("--shots", str(n)), trained(m, t))
    return Table("Robustness", "Each adapter alone and with the backbone's n ICDs back in its prompt", ROBUST,
                 tuple(dict.fromkeys(c for _, c in cells)), cells, params=True)


EXTRA_TABLES = ("hificl-1", "hificl-ablation", "robustness")  # tables beside the paper's: python -m lab table NAME
LAYOUTS |= dict(zip(EXTRA_TABLES, (table_hificl_1, table_hificl_ablation, table_robustness)))
