"""python -m lab (lab/cli/commands.py, modes.py): every old flag of train.py and evaluate.py keeps its name, default
and help in its new home (parsers-before.json: main's parsers, dumped before the move); the modes, each with its own
--help; a flag that moved, given to an old script, exits 2 with one line naming the new command; hostile uses of the
new command line."""
import dataclasses
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

import evaluate
import train
from helpers import lab, lab_args, QUIET, ROOT
from lab.cli import commands, flags, modes
from lab.run import prefetch
from lab.studies import table_runs

BEFORE = json.load(open(os.path.join(os.path.dirname(__file__), "parsers-before.json"), encoding="utf-8"))
COMPUTED = {"--workers": repr(prefetch.default_workers()),  # defaults of this machine, not of the dump's
            "--rices-cache": repr(os.path.expanduser("~/.cache/hyper-icl/rices"))}
SWITCHES = {"train.py": {"--benchmark": "benchmark-teacher", "--build-toy": "build-toy"},  # old flag: its mode now
            "evaluate.py": {"--table": "table", "--figure": "figure", "--curve": "curve", "--benchmark": "benchmark",
                            "--benchmark-attention": "benchmark-attention", "--gates": "gates",
                            "--hyperbolicity": "hyperbolicity"}}


def entries(parser):
    """{flag: what parsers-before.json records of it} of an argparse parser."""
    return {a.option_strings[0]: {"default": repr(a.default), "help": a.help, "nargs": a.nargs,
                                  "choices": list(map(str, a.choices)) if a.choices else None,
                                  "action": type(a).__name__}
            for a in parser._actions if a.option_strings and a.dest != "help"}


def parsers(monkeypatch, capsys):
    """{"train.py": [...], "evaluate.py": [...]}: the parsers of each side, the script's own first, then every mode's
    of that side (each asked for its --help)."""
    made, real = [], flags.parser
    monkeypatch.setattr(flags, "parser", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    sides = {"train.py": [], "evaluate.py": []}
    calls = [(f"{s.__name__}.py", lambda s=s: s.parse_args(["--help"])) for s in (train, evaluate)]
    calls += [(mode.side + ".py", lambda words=words: commands.parse([*words, "--help"]))
              for words, mode in commands.MODES.items()]
    for side, call in calls:
        with pytest.raises(SystemExit) as e:
            call()
        assert e.value.code == 0
        sides[side].append(made[-1])
    capsys.readouterr()
    return sides


def test_every_old_flag_keeps_its_name_default_and_help_in_its_new_home(monkeypatch, capsys):
    """The union of the scripts' and lab's parsers, side by side, holds each flag of main's two parsers with the same
    default, help, choices (new ones may be added), nargs and action, the same in every parser that has it; the old
    mode switches are modes."""
    for side, found in parsers(monkeypatch, capsys).items():
        union = {}
        for parser in found:
            for flag, entry in entries(parser).items():
                assert union.setdefault(flag, entry) == entry, (side, flag)  # one flag, one meaning, every mode
        for flag, old in BEFORE[side].items():
            if flag in SWITCHES[side]:
                assert (SWITCHES[side][flag],) in commands.MODES and flag not in union, flag
                continue
            assert flag in union, (side, flag)
            now = dict(union[flag], default=COMPUTED.get(flag, union[flag]["default"]))
            if old["choices"] and now["choices"]:  # choices added since (a new method), none taken away
                assert set(old["choices"]) <= set(now["choices"]), (side, flag)
                now["choices"] = old["choices"]
            assert now == dict(old, default=COMPUTED.get(flag, old["default"])), (side, flag)
        assert len(entries(found[0])) <= 30  # the script's own --help


def test_lab_only_lists_exactly_the_flags_the_scripts_gave_away(monkeypatch, capsys):
    """flags.LAB_ONLY (which the scripts read to name the new command) is every flag of lab's parsers and old mode
    switches that the script lacks, beside the harness's fields: a flag added to a study cannot be left out."""
    for side, found in parsers(monkeypatch, capsys).items():
        own = set(entries(found[0]))
        lab_flags = {f for p in found[1:] for f in entries(p)} | set(SWITCHES[side])
        script = train if side == "train.py" else evaluate
        harness = {f.name for f in dataclasses.fields(script.Config)} - set(script.Config.__annotations__)
        listed = {"--" + n.replace("_", "-") for n in (*flags.LAB_ONLY[side], *harness)}
        assert listed == lab_flags - own, side


def refusal(script, argv, capsys):
    """The exit code and the one stderr line of `script` (train.py, evaluate.py) given argv, parsed in this process."""
    with pytest.raises(SystemExit) as e:
        (train if script == "train.py" else evaluate).parse_args(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return e.value.code, err.strip()


def test_a_moved_mode_flag_names_the_new_command_with_the_other_flags_shell_quoted(capsys):
    argv = ["--model", "tiny-idefics2", "--table", "1", "--train-args", "--n-train 4 --epochs 1"]
    assert refusal("evaluate.py", argv, capsys) == (2, "error: --table is lab's now: python -m lab table 1 --model "
                                                       "tiny-idefics2 --train-args '--n-train 4 --epochs 1'")
    assert refusal("evaluate.py", ["--figure=3a", "--print"], capsys) == (
        2, "error: --figure is lab's now: python -m lab figure 3a --print")


def test_a_moved_harness_flag_names_the_scripts_own_command_under_lab(capsys):
    code, line = refusal("train.py", ["--teacher-cache", "my cache", "--lr", "1e-3"], capsys)
    assert code == 2 and line == \
        "error: --teacher-cache is lab's now: python -m lab train --teacher-cache 'my cache' --lr 1e-3"
    assert refusal("evaluate.py", ["--vector", "tv", "--shots", "2"], capsys)[1] == \
        "error: --vector is lab's now: python -m lab evaluate --vector tv --shots 2"


def test_train_py_modes_name_theirs_plan_keeping_its_value(capsys):
    assert refusal("train.py", ["--plan", "cuda", "--model", "idefics2"], capsys)[1] == \
        "error: --plan is lab's now: python -m lab plan train --plan cuda --model idefics2"
    assert refusal("train.py", ["--benchmark", "--epochs", "2"], capsys)[1] == \
        "error: --benchmark is lab's now: python -m lab benchmark-teacher --epochs 2"
    assert refusal("train.py", ["--seed", "3", "--build-toy", "--build-tries", "2"], capsys)[1] == \
        "error: --build-toy is lab's now: python -m lab build-toy --seed 3 --build-tries 2"
    assert refusal("evaluate.py", ["--plan", "--curve"], capsys)[1] == \
        "error: --curve is lab's now: python -m lab curve --plan"  # a mode before --plan
    assert refusal("train.py", ["--processor", "d"], capsys)[1] == \
        "error: --processor is lab's now: python -m lab plan train --processor d"  # a mode's own flag: its mode
    assert refusal("evaluate.py", ["--gpus", "0,1"], capsys)[1] == \
        "error: --gpus is lab's now: python -m lab table N --gpus 0,1"


def test_the_old_script_refuses_from_the_shell_with_exit_2_and_one_line(tmp_path):
    done = subprocess.run([sys.executable, "evaluate.py", "--gates", "--checkpoint", "a b.safetensors"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: --gates is lab's now: python -m lab gates --checkpoint 'a b.safetensors'\n"


def test_lab_without_a_mode_lists_the_modes_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        lab([])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err == "error: name a mode (above)\n"
    assert all(" ".join(words) in out for words in commands.MODES)


def test_lab_help_lists_every_mode_once_and_exits_0(capsys):
    assert lab(["--help"]) is None
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == [words[0] for words in commands.MODES]  # plan twice: plan train, plan evaluate


def test_an_unknown_mode_is_refused_naming_the_modes(capsys):
    with pytest.raises(SystemExit) as e:
        lab(["tabel", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: unknown mode 'tabel'; the modes: train, evaluate, table")


def test_each_mode_has_its_own_help_named_by_its_command(capsys):
    for words, mode in commands.MODES.items():
        with pytest.raises(SystemExit) as e:
            lab([*words, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith("usage: python -m lab " + " ".join(words)), words
        assert ("--proceed" in out) == (mode.side == "train")  # each side's flags, the harness's included


def test_a_table_number_is_checked_before_anything(capsys):
    for argv, got in ((["table"], "'none'"), (["table", "12"], "'12'"), (["table", "--model", "x"], "'--model'"),
                      (["figure", "5"], "'5'")):
        with pytest.raises(SystemExit) as e:
            lab(argv)
        numbers = ", ".join(commands.numbers(argv[0]))
        assert e.value.code == 2 and capsys.readouterr().err == \
            f"error: python -m lab {argv[0]} takes its number first, one of {numbers} (got {got})\n"


def test_plan_alone_asks_what_it_plans(capsys):
    with pytest.raises(SystemExit) as e:
        lab(["plan", "--model", "idefics2"])
    assert e.value.code == 2 and capsys.readouterr().err == \
        "error: plan takes what it plans: plan train or plan evaluate\n"


def test_a_flag_of_another_mode_or_a_typo_is_unrecognised(capsys):
    for argv, flag in ((["gates", "--curve-seeds", "2"], "--curve-seeds"), (["train", "--n-trian", "4"], "--n-trian"),
                       (["evaluate", "--gpus", "0"], "--gpus")):
        with pytest.raises(SystemExit) as e:
            lab_args(argv)
        assert e.value.code == 2 and f"error: unrecognized arguments: {flag}" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as e:  # before: --table 2 taken as --table-worker 2 (argparse's abbreviations)
        lab_args(["table", "1", *QUIET, "--table", "2"])
    assert capsys.readouterr().err == "error: --table was a flag and is a mode now: python -m lab table ...\n"


def test_a_modes_own_value_gives_way_to_the_users(capsys):
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert lab_args(["plan", "train"]).plan == here and lab_args(["plan", "train", "--plan", "cuda"]).plan == "cuda"
    assert lab_args(["plan", "evaluate", "--plan", "cpu", "--shots", "0"]).plan == "cpu"
    assert lab_args(["table", "3", *QUIET]).table == "3" and lab_args(["train", "--proceed"]).proceed


def test_print_commands_writes_lab_commands_that_parse(tmp_path, capsys):
    lines = lab(["table", "7", *QUIET, "--out", str(tmp_path), "--print-commands"])
    words = [shlex.split(line) for line in lines]
    assert {tuple(w[:4]) for w in words[:-1]} == {("python", "-m", "lab", "train"), ("python", "-m", "lab", "evaluate")}
    assert words[-1] == ["python", "-m", "lab", "table", "7", *QUIET, "--out", str(tmp_path), "--print"]
    for w in words[:-1]:  # each job's line, as its own command parses it (the adapter it names not trained yet)
        parse = modes.parse_train if w[3] == "train" else modes.parse_evaluate
        assert parse(w[4:w.index("--checkpoint")] if "--checkpoint" in w else w[4:]).task == w[w.index("--task") + 1]
    assert lab_args(words[-1][3:]).print


def test_gpus_workers_run_the_table_under_lab(tmp_path, monkeypatch, capsys):
    started = []

    class Process:  # the workers, recorded instead of started
        def __init__(self, argv, env):
            started.append(argv)

        def wait(self):
            return 0
    monkeypatch.setattr(subprocess, "Popen", Process)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(table_runs.table_print, "write", lambda *a: None)
    lab(["table", "7", *QUIET, "--out", str(tmp_path), "--gpus", "0,1"])
    assert len(started) == 2 and all(a[:5] == [sys.executable, "-m", "lab", "table", "7"] for a in started)
    assert all(a[-2] == "--table-worker" and a[5:-2] == [*QUIET, "--out", str(tmp_path), "--gpus", "0,1"]
               for a in started)


def test_lab_runs_from_another_folder_and_the_scripts_import_no_study():
    """One fresh interpreter, in the project's parent folder: train and evaluate imported reach no study and not lab's
    command line; then `python -m lab build-toy --help` (runpy, as -m runs it) prints its usage."""
    code = ("import runpy, sys, train, evaluate; print(sorted(m for m in sys.modules if m.startswith('lab.studies') "
            "or m in ('lab.cli.modes', 'lab.cli.commands', 'lab.cli.study_flags'))); "
            "sys.argv = ['lab', 'build-toy', '--help']; runpy.run_module('lab', run_name='__main__', alter_sys=True)")
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(ROOT), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    imported, usage = done.stdout.split("\n", 1)
    assert done.returncode == 0 and imported == "[]", done.stderr[-2000:]
    assert usage.startswith("usage: python -m lab build-toy")
