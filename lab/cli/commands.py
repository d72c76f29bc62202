"""python -m lab <mode> [flags]: every mode beside the paper's two scripts, each with its own --help. A mode takes
the flags of train.py or of evaluate.py that it reads, the harness's and its study's among them (lab/cli/modes.py
parses and runs them); `table` and `figure` take their number first, `plan` what it plans."""
import sys
import typing
from dataclasses import dataclass, field

from lab.cli import flags, modes
from lab.studies import table_runs


@dataclass(frozen=True)
class Mode:
    """One mode: what it does (a line of python -m lab --help), whose flags it takes (train.py's or evaluate.py's
    side, lab/cli/modes.py) and which of them, its own values, what runs it ((args, argv, command) -> result), and
    the field its number fills (table N, figure N)."""
    what: str
    side: str
    shown: tuple
    run: object
    preset: dict = field(default_factory=dict)
    number: str = None


E = modes.names(modes.evaluate.Config)  # evaluate.py's flags with the harness's
MODES = {
    ("train",): Mode("one training run, every flag: train.py's and the harness's (RICES, caches, --proceed)",
                     "train", modes.TRAIN, modes.train_run),
    ("evaluate",): Mode("one evaluation, every flag: evaluate.py's, the harness's, task and function vectors",
                        "evaluate", modes.EVALUATE, modes.evaluate_run),
    ("table",): Mode("a paper table (1-11; HiFICL's hificl-1, hificl-ablation; robustness) for --model, every cell "
                     "run once, beside the paper's numbers",
                     "evaluate", modes.TABLE, modes.table, number="table"),
    ("figure",): Mode("a figure (sweeps 2, 3a, 3b; 4's gallery page) as a table of cells, and its figure", "evaluate",
                      modes.TABLE, modes.table, number="figure"),
    ("plan", "train"): Mode("the cost of a training run before it runs, no weight read (a table's: table N --plan)",
                            "train", (*modes.TRAIN, "plan", "processor", "accelerator", "plan_json"),
                            modes.plan_run, {"plan": flags.HERE}),
    ("plan", "evaluate"): Mode("the cost of an evaluation before it runs, no weight read", "evaluate",
                               (*E, "plan", "processor", "accelerator", "plan_json"),
                               modes.plan_run, {"plan": flags.HERE}),
    ("curve",): Mode("learning curves of every method on the toy world, each one's rate tuned", "evaluate",
                     (*E, "curve_queries", "curve_seeds", "curve_methods", "no_tune", "train_args"), modes.study,
                     {"curve": True}),
    ("benchmark",): Mode("Table 6: FLOPs, latency and memory of 0-shot, the adapters and n-shot ICL", "evaluate",
                         (*E, *modes.BENCH, "bench_shots"), modes.study, {"benchmark": True}),
    ("benchmark-attention",): Mode("one attention layer: latency and peak memory of SDPA and of each method",
                                   "evaluate", (*E, *modes.BENCH), modes.study, {"benchmark_attention": True}),
    ("gates",): Mode("Table 10: a Hyper-ICL checkpoint's gates and Corr(g, Delta A)", "evaluate", tuple(E),
                     modes.study, {"gates": True}),
    ("hyperbolicity",): Mode("Table 9: delta-hyperbolicity of the teacher's and the student's states", "evaluate",
                             tuple(E), modes.study, {"hyperbolicity": True}),
    ("build-toy",): Mode("meta-train a toy-idefics2 of your own (lab/models/toy_backbone.py)", "train",
                         (*modes.TRAIN, "build_tries"), modes.build_toy, {"build_toy": True}),
    ("benchmark-teacher",): Mode("time a training run with and without the teacher cache", "train", modes.TRAIN,
                                 modes.benchmark_teacher, {"benchmark": True}),
}


SWITCHES = {"--" + name.replace("_", "-"): mode for name, mode in flags.MODE_OF.items()} | {"--benchmark": "benchmark"}


def overview():
    """python -m lab --help: the modes, one a line."""
    rows = [(" ".join(words) + (" N" if mode.number else ""), mode.what) for words, mode in MODES.items()]
    return ("usage: python -m lab <mode> [flags]   (a mode's flags: python -m lab <mode> --help)\n\n"
            "The paper's training and evaluation are python train.py and python evaluate.py; lab's modes:\n"
            + "\n".join(f"  {name:<22}{what}" for name, what in rows))


def refuse(message):
    """Exit 2 with one line."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def numbers(name):
    """The numbers of table N or figure N (table_runs.Settings' choices)."""
    return typing.get_args(typing.get_args(table_runs.Settings.__annotations__[name])[0])


def main(argv=None):
    """python -m lab <mode> [flags]: the mode's flags parsed and checked (parse), then the mode run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(overview())
        if not argv:
            refuse("name a mode (above)")
        return None
    mode, args, rest, command = parse(argv)
    return mode.run(args, rest, command)


def parse(argv):
    """(the Mode, its parsed flags, the flags after its words, its words: ["python", "-m", "lab", "table", "1"]) of
    python -m lab's argv; one line and exit 2 for an unknown mode or a missing number."""
    matched = [words for words in MODES if tuple(argv[:len(words)]) == words]
    if not matched:
        after = [" ".join(w) for w in MODES if w[0] == argv[0]]
        refuse(f"{argv[0]} takes what it plans: {' or '.join(after)}" if after else
               f"unknown mode {argv[0]!r}; the modes: {', '.join(' '.join(w) for w in MODES)} (python -m lab --help)")
    words = matched[0]
    mode, rest, command = MODES[words], argv[len(words):], ["python", "-m", "lab", *words]
    if switch := next((a.split("=", 1)[0] for a in rest if a.split("=", 1)[0] in SWITCHES), None):  # --table 2 would
        refuse(f"{switch} was a flag and is a mode now: python -m lab {SWITCHES[switch]} ...")  # be --table-worker 2
    preset = dict(mode.preset)
    if mode.number and rest[:1] not in (["-h"], ["--help"]):
        if not rest or rest[0] not in numbers(mode.number):
            refuse(f"{' '.join(command)} takes its number first, one of {', '.join(numbers(mode.number))} "
                   f"(got {rest[0] if rest else 'none'!r})")
        preset[mode.number] = rest.pop(0)
        command.append(preset[mode.number])
    prog = " ".join(command) + (" N" if mode.number and mode.number not in preset else "")
    parse_flags = modes.parse_train if mode.side == "train" else modes.parse_evaluate
    return mode, parse_flags(rest, mode.shown, preset, prog), rest, command
