"""The flags of train.py and evaluate.py, made from their Config, the checks of numeric flags and folders, and the
one-line pointer from a flag the scripts gave to `python -m lab` to its new command."""
import argparse
import dataclasses
import functools
import inspect
import math
import os
import shlex
import sys
import textwrap
import tokenize
import typing

import torch

from lab.datasets import tasks


MAX_INT = 2**63 - 1    # every count flag: what a 64-bit integer (torch's sizes, seeds, steps) holds

MAX_SEED = 2**32 - 1   # --seed: torch's generators take 64 bits, and epoch_order seeds with seed x 100,003 + epoch

MAX_THREADS = max(1024, os.cpu_count() or 1)

MAX_WORKERS = 4 * (os.cpu_count() or 1)  # --workers: processes past this only cost memory (2**62 asked for all of it)

MAX_ROUNDS = 1000  # --rounds: a round of --benchmark takes seconds to minutes; 10**12 of them would never finish

FLOAT32 = torch.finfo(torch.float32)  # the rates and weights scale float32 tensors (the adapter's, AdamW's)

# {name: (must be > 0, else >= 0; power)}: each scales float32 tensors (the adapter's, AdamW's, the losses), so
# value^power must be finite in float32 and, if not 0, not below its smallest normal number (T^2 scales LIVE's KL)
FLOAT_FLAGS = {"lr": (True, 1), "weight_decay": (False, 1), "clip": (True, 1), "kappa": (True, 1), "lam": (False, 1),
               "temperature": (True, 2)}


def check_floats(p, args):
    """A parser error naming the flag for each of FLOAT_FLAGS that is not finite, out of its sign, or whose power
    leaves float32's range: inf for --lr would stop the run at step 1 after loading everything."""
    for name, (positive, power) in FLOAT_FLAGS.items():
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        most, least, why = FLOAT32.max ** (1 / power), FLOAT32.tiny ** (1 / power), \
            " (T^2 scales the KL)" if power == 2 else ""
        if not math.isfinite(value) or abs(value) > most:
            p.error(f"{flag} must be a finite number of float32's range, at most {most:.4g}{why} (got {value})")
        if not (value > 0 if positive else value >= 0):
            p.error(f"{flag} must be {'>' if positive else '>='} 0 (got {value})")
        if 0 < value < least:
            p.error(f"{flag} must be at least {least:.4g}" + (", whose square is" if power == 2 else ",") +
                    f" float32's smallest normal number{why} (got {value})")


MAX_IMAGE_MEMORY = MAX_INT / 1e9  # --image-memory, GB: its bytes must be a 64-bit count (1e300 GB is inf bytes)


def check_image_memory(p, gb):
    """A parser error naming --image-memory unless it is a finite number of GB > 0 whose bytes a 64-bit integer
    holds (the chunks of chunks.chunk_images are counted in bytes: 1e300 GB made them NaN after the model loaded)."""
    if not 0 < gb <= MAX_IMAGE_MEMORY:
        p.error(f"--image-memory must be a finite number of GB > 0, at most {MAX_IMAGE_MEMORY:.4g} (got {gb})")


def check_at_least(p, args, bounds):
    """A parser error for each flag of {name: least or (least, most)} given outside [least, most] (most: MAX_INT
    unless given; a list flag: any of its values), naming the flag. A name the Config lacks (a mode's, on a script)
    is passed over."""
    for name, bound in ((k, b) for k, b in bounds.items() if hasattr(args, k)):
        (least, most), value = bound if isinstance(bound, tuple) else (bound, MAX_INT), getattr(args, name)
        values = [v for v in (value if isinstance(value, list) else [value]) if v is not None]
        if any(v < least for v in values):
            p.error(f"--{name.replace('_', '-')} must be at least {least} (got {value})")
        if any(v > most for v in values):
            p.error(f"--{name.replace('_', '-')} must be at most {most:,} (got {value})")


def check_folders(p, folders):
    """A parser error for each of {flag: path} that names an existing file where a folder must be (or made)."""
    for flag, path in folders.items():
        if path and os.path.exists(path) and not os.path.isdir(path):
            p.error(f"{flag} {path} is a file; it must be a folder")


def check_applies(p, args, defaults, applies, view=None):
    """A parser error for each flag of `applies` ({field: (where it applies, test(flags) -> whether it does here)})
    given a value other than its default where it does nothing: one line naming the flag and where it applies, so a
    flag of another method or mode is never taken without a word (a new flag is one entry of its script's table).
    view: the flags the tests read (train.py's, each method's own anchor filled in), else args. A name the Config
    lacks (a mode's, on a script) is passed over."""
    for name, (where, test) in applies.items():
        if hasattr(args, name) and getattr(args, name) != getattr(defaults, name) and not test(view or args):
            p.error(f"--{name.replace('_', '-')} applies {where}; here it would do nothing")


# what a field's type does not say: a name checked by a function, a flag that may go without its value (nargs "?" and
# the value it then takes), a list that may be empty
HERE = "cuda" if torch.cuda.is_available() else "cpu"  # --plan without a value: the run's own device
SPELLING = {"task": dict(type=tasks.task_arg), "icd_task": dict(type=tasks.task_arg),
            "plan": dict(nargs="?", const=HERE), "chair": dict(nargs="?", const="chair.py"),
            "random_weights": dict(nargs="?", const="published"), "bench_shots": dict(nargs="*")}


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default."""


def parser(doc, config, exclusive=(), shown=None, prog=None):
    """The flags of the dataclass instance `config` (train.py's or evaluate.py's Config, or lab's with more), one a
    field: --field-name, the field's value its default, its comment its help (field_help), its type the type
    (Optional unwrapped; bool: a switch; list[X]: one or more X; Literal: the choices) with SPELLING's additions; the
    Config's own fields first, then those it inherits, in the order it names them. shown: the fields that are flags
    (None: all; the others keep their defaults). Each tuple of field names in `exclusive` is a group of flags that
    exclude each other. prog: the command's name in the help (None: the script's file)."""
    p, helps = argparse.ArgumentParser(prog, description=doc, formatter_class=Help), field_help(type(config))
    shown = {f.name for f in dataclasses.fields(config)} if shown is None else set(shown)
    groups = {name: group for names in exclusive if shown & set(names) for group in [p.add_mutually_exclusive_group()]
              for name in names if name in shown}
    order = [name for cls in type(config).__mro__ for name in vars(cls).get("__annotations__", {})]
    for f in sorted(dataclasses.fields(config), key=lambda f: order.index(f.name)):
        if f.name not in shown:
            continue
        kind, (origin, args) = f.type, (typing.get_origin(f.type), typing.get_args(f.type))
        if origin is typing.Union:  # Optional[X]: X
            kind = next(t for t in args if t is not type(None))
            origin, args = typing.get_origin(kind), typing.get_args(kind)
        choices, item = (list(args) if origin is typing.Literal else None), (args[0] if origin is list else kind)
        how = dict(action="store_true") if kind is bool else dict(
            type=None if choices or item is str else item, choices=choices, nargs="+" if origin is list else None)
        groups.get(f.name, p).add_argument("--" + f.name.replace("_", "-"), default=getattr(config, f.name),
                                           help=helps[f.name].replace("%", "%%"), **how | SPELLING.get(f.name, {}))
    return p


# The flags the scripts gave to `python -m lab` (lab/cli/commands.py) beside their Config's harness fields
# (lab/cli/harness.py): the other modes' and the studies' (tests/lab/cli/test_lab_cli.py holds them to lab's parsers).
# A mode's flag names its mode (a value of --table and --figure is the mode's number); any other, the script's own
# command there.
LAB_ONLY = {
    "train.py": ("plan", "processor", "accelerator", "plan_json", "benchmark", "build_toy", "build_tries"),
    "evaluate.py": ("plan", "processor", "accelerator", "plan_json", "benchmark", "benchmark_attention",
                    "random_weights", "bench_shots", "attention_tokens", "rounds", "gates", "hyperbolicity", "curve",
                    "curve_queries", "curve_seeds", "curve_methods", "no_tune", "train_args", "table", "figure",
                    "print", "print_commands", "gpus", "table_worker", "vector", "vector_layer", "vector_sets",
                    "vector_heldout", "fv_heads", "fv_trials", "karpathy_split", "seed_bench")}
MODE_OF = {"table": "table", "figure": "figure", "curve": "curve", "benchmark_attention": "benchmark-attention",
           "gates": "gates", "hyperbolicity": "hyperbolicity", "build_toy": "build-toy"}  # first match wins
WITH_NUMBER = ("table", "figure")  # the flags whose value is the mode's number
OWNER = {**dict.fromkeys(("random_weights", "bench_shots", "attention_tokens", "rounds"), "benchmark"),
         **dict.fromkeys(("curve_queries", "curve_seeds", "curve_methods", "no_tune"), "curve"),
         **dict.fromkeys(("train_args", "print", "print_commands", "gpus", "table_worker", "karpathy_split",
                          "seed_bench"), "table"),
         **dict.fromkeys(("processor", "accelerator", "plan_json"), "plan"),
         "build_tries": "build_toy"}  # a mode's own flag given without the mode: that mode


def refuse_moved(argv, script, harness):
    """Exit 2 with one line naming the new command where argv holds a flag of `script` ("train.py", "evaluate.py")
    that is lab's now: one of LAB_ONLY's or of `harness` (the Config's fields that are not the script's flags). The
    command: the mode the flags ask for (MODE_OF; --benchmark: train.py's benchmark-teacher, evaluate.py's benchmark;
    --plan: plan <script>) or that the first such flag belongs to (OWNER), else the script's own under
    `python -m lab`; then the user's other flags, shell-quoted."""
    moved = {"--" + name.replace("_", "-"): name for name in (*LAB_ONLY[script], *harness)}
    names = [moved[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in moved]
    if not names:
        return
    own, rest = script.removesuffix(".py"), list(argv)
    switch = next((m for m in (*MODE_OF, "benchmark", "plan") if m in names), None)
    name, mode = switch or names[0], switch or OWNER.get(names[0])
    words = {None: [own], "plan": ["plan", own], "benchmark": ["benchmark-teacher" if own == "train" else "benchmark"]
             }.get(mode) or [MODE_OF[mode], *(["N"] if mode in WITH_NUMBER and not switch else [])]
    if switch and switch != "plan":  # the mode's flag goes (--plan stays: plan's own); its number follows the mode
        flag = "--" + switch.replace("_", "-")
        k = next(k for k, a in enumerate(rest) if a.split("=", 1)[0] == flag)
        value = rest.pop(k).partition("=")[2]
        value = value or (rest.pop(k) if switch in WITH_NUMBER and k < len(rest) else "")
        words += [value] if value else []
    print(f"error: --{name.replace('_', '-')} is lab's now: {shlex.join(['python', '-m', 'lab', *words, *rest])}",
          file=sys.stderr)
    raise SystemExit(2)


def field_help(cls):
    """{field: help} of the dataclass `cls` and of the dataclasses it derives from (the harness's settings, lab's
    Configs the studies' Settings): the comment after each field in its source, on the field's one line."""
    bases = [c for c in cls.__mro__[1:] if dataclasses.is_dataclass(c)]
    return {k: v for base in reversed(bases) for k, v in field_help(base).items()} | own_help(cls)


@functools.cache
def own_help(cls):
    """field_help of the fields `cls` itself writes, read from its source once a process (a table parses its jobs'
    flags hundreds of times)."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    tokens = list(tokenize.generate_tokens(iter(line + "\n" for line in lines).__next__))
    names = {a.start[0]: a.string for a, b in zip(tokens, tokens[1:])
             if a.type == tokenize.NAME and a.start[1] == 4 and b.string == ":"}
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    return {name: comments.get(row, "") for row, name in names.items()}
