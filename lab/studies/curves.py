"""Learning curves on the toy world (Table 1, Table 4, Fig 2-3): the tuning rule, runs over seeds and query
counts with intervals, the figure and its table (evaluate.py --curve).

The paper's comparisons (Table 1's ordering, Table 4, Fig 2) ask which method is better at a given budget. One run
per point cannot say (on the toy world a run either flips the task or not), hence seeds, intervals and two graded
measures (`curve`, `answer_measures`); rates are tuned by the rule of `tune` (below), never on evaluation items."""
import itertools
import json
import math
import os
import re
import shlex
import statistics
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import data
import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.models import backbones
from lab.methods import registry
from lab.run import adapter_files
from lab.scores import results
from lab.scores.metrics import T_975  # Student's t at 0.975, by degrees of freedom

CURVE_QUERIES = (4, 8, 16, 32)  # training queries per run: the x axis (Fig 2: training sample size)

CURVE_SEEDS = 3                  # train.py --seed of each point's runs: query draw, demonstrations, order, init

CURVE_TRAIN_ARGS = "--epochs 16 --n-heldout 8"  # 16 passes: N queries take 4 N steps at batch size 4

ICL_LEVELS = (0, 1, 2, 4, 8)     # n-shot ICL, the horizontal lines of the figure (Fig 2's x axis)


@dataclass
class Settings:
    """The flags of python -m lab curve (lab/cli/modes.py:Evaluation gathers them: a field = a flag, its comment the
    help)."""
    curve: bool = False               # learning curves of every method, its rate tuned (lab/studies/curves.py)
    curve_queries: list[int] = field(default_factory=lambda: list(CURVE_QUERIES))  # training queries per run
    curve_seeds: int = CURVE_SEEDS    # seeds per point
    curve_methods: Optional[list[str]] = None  # only these rows (as named in curve.md; None: all)
    no_tune: bool = False             # train each method at its published rate (PUBLISHED_LR), untuned
    train_args: str = ""              # train.py flags of every run ("": curves.CURVE_TRAIN_ARGS)


def mean_interval(values):
    """(mean, low, high): the mean of independent runs and its two-sided 95% Student-t interval, mean +- t s / sqrt(n)
    with t = t(0.975, n - 1) from T_975 (n <= 31) and s the sample standard deviation; one run: (mean, nan, nan)."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    if n - 1 > len(T_975):
        raise ValueError(f"mean_interval: at most {len(T_975) + 1} runs (got {n})")
    half = T_975[n - 2] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


@torch.no_grad()
def answer_measures(backbone, kind, items, teacher, batch_size=8):
    """The graded measures of the zero-shot model as it is (with its adapter, if attached), teacher-forced on each
    item's target: the mean over items of log p(target) (summed over its tokens), and the mean over target tokens of
    KL(teacher || model), `teacher` holding one [n_tokens, V] row of the 8-shot backbone's logits per item
    (train.run_teacher with output="logits")."""
    logp, kl, tokens, device = 0.0, 0.0, 0, backbone.model.device
    for i in range(0, len(items), batch_size):
        pieces = data.query_pieces(backbone.processor, backbone.family, kind, items[i:i + batch_size])
        batch = backbones.to_device(data.student_batch(backbone.processor, backbone.family, kind, pieces), device)
        logits, labels = M.target_logits(backbone.model, batch)
        log_p = F.log_softmax(logits.float(), -1)                                          # [B, K, V]
        answer = M.answer_positions(labels)                                            # [B, K]: predicts a target
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)                                 # the token each predicts
        for b in range(len(pieces)):
            student, t = log_p[b, answer[b]], F.log_softmax(teacher[i + b].float(), -1)    # [n_b, V] each
            logp += student.gather(-1, targets[b, answer[b]][:, None]).sum().item()
            kl += (t.exp() * (t - student.cpu())).sum().item()
            tokens += len(student)
    return {"answer_logprob": logp / len(items), "teacher_kl": kl / tokens}


def method_of(flags):
    """The --method a row's train.py flags name (train.py's default: hyper-icl)."""
    return flags[flags.index("--method") + 1] if "--method" in flags else "hyper-icl"


# A fair tuning rule. Each method's learning rate is swept around its published one, PUBLISHED_LR x 10^k for
# k = -1, 0, 1, widened a decade at a time while the best rate is at an edge (at most TUNE_DECADES from the published
# one). Then LIVE's and MimIC's weight of the cross-entropy beside their own loss (lambda) among TUNE_LAMBDAS at that
# rate. A run's score is its best epoch's supervised loss (-log p per answer token) on TUNE["n_heldout"] queries held
# out of the *training* split (tasks.split_pool: never trained on in that run, never an evaluation image), at
# TUNE["n_train"] training queries and a seed no curve run uses. Hyper-ICL's variants (Table 4, lambda, kappa) train
# at Hyper-ICL's rate. Published rates: each method's record (lab/methods/registry.py). Their cross-entropy weights
# (LIVE's hard_loss_weight, MimIC's ce_loss_weight) are 0.5, the paper's lambda.
PUBLISHED_LR = {m: own.lr for m, own in registry.METHODS.items()}

TUNE_DECADES = 3

TUNE_LAMBDAS = {"mimic": (0.5, 5.0), "live": (0.5, 5.0)}

TUNE = dict(n_train=16, n_heldout=32, seed=100)


def rate_flags(lr, lam=None):
    """train.py flags for a learning rate and, if given, lambda."""
    return ["--lr", f"{lr:g}"] + ([] if lam is None else ["--lam", f"{lam:g}"])


def tune_flags(lr, lam=None):
    """train.py flags of a tuning run (added after --curve's --train-args, before the method)."""
    return rate_flags(lr, lam) + ["--n-train", str(TUNE["n_train"]), "--n-heldout", str(TUNE["n_heldout"]),
                                  "--seed", str(TUNE["seed"])]


def tune(out, flags, methods, train_main, paper_lam):
    """Each method's {"lr", "lam"} by the rule above; also every tuning run's score (<out>/tune.json). flags: the
    train.py flags every run shares (before tune_flags and the method); train_main: train.py's main; paper_lam: its
    default lambda."""
    runs, chosen = [], {}
    for method in methods:
        def score(lr, lam=None):
            run = os.path.join(out, "tune", method, f"lr{lr:g}" + ("" if lam is None else f"-lam{lam:g}"))
            train_main(flags + tune_flags(lr, lam) + [
                "--method", method, "--out", run, "--proceed", "--teacher-cache", os.path.join(out, "teacher")])
            with open(os.path.join(run, "history.json")) as f:
                runs.append({"method": method, "lr": lr, "lam": lam,
                             "heldout_loss": min(h["heldout_loss"] for h in json.load(f))})
            return runs[-1]["heldout_loss"]
        scores = {k: score(PUBLISHED_LR[method] * 10.0 ** k) for k in (-1, 0, 1)}
        best = lambda: min(scores, key=lambda k: (scores[k], abs(k)))  # ties go to the published rate's side
        while best() in (min(scores), max(scores)) and 0 < abs(best()) < TUNE_DECADES:  # at an edge: widen
            k = best() + (1 if best() > 0 else -1)
            scores[k] = score(PUBLISHED_LR[method] * 10.0 ** k)
        chosen[method] = {"lr": PUBLISHED_LR[method] * 10.0 ** best(), "lam": None}
        if method in TUNE_LAMBDAS:  # train.py's default lambda was scored with the rate
            lams = {lam: scores[best()] if lam == paper_lam else score(chosen[method]["lr"], lam)
                    for lam in TUNE_LAMBDAS[method]}
            chosen[method]["lam"] = min(lams, key=lams.get)
    files.write_json(os.path.join(out, "tune.json"), {"chosen": chosen, "runs": runs, "rule": TUNE}, indent=2)
    return chosen, runs


def row_flags(flags, chosen):
    """A row's train.py flags with its method's tuned rate (and lambda) first, so the row's own flags override."""
    tuned = chosen.get(method_of(flags))
    return flags if tuned is None else rate_flags(**tuned) + flags


def curve_runs(names=None):
    """The rows of --curve: every method (lab/methods/registry.py), Hyper-ICL's anchor ablations (Table 4), lambda
    and kappa beside the paper's 0.5 and 0.1 (Fig 3b), and the anchor divided by its first-step value; only `names`,
    if given."""
    rows = [(m, ["--method", m]) for m in registry.METHODS]
    rows += [("hyper-icl, euclidean anchor", ["--anchor", "euclidean"]), ("hyper-icl, CE only", ["--anchor", "none"]),
             ("hyper-icl, anchor only", ["--lam", "0"])]                                  # Table 4
    rows += [(f"hyper-icl, lambda {lam}", ["--lam", lam]) for lam in ("5", "50")]           # Fig 3b: lambda
    rows += [(f"hyper-icl, kappa {kappa}", ["--kappa", kappa]) for kappa in ("0.01", "1")]  # Fig 3b: kappa
    rows += [("hyper-icl, anchor / first step", ["--anchor-norm", "first"])]              # not in the paper
    return [r for r in rows if names is None or r[0] in names]


def curve(args, train_main, run_teacher, scored, paper_lam):
    """--curve: tune each method's rate (`tune`; --no-tune: the published ones), then train every row of curve_runs on
    each of --curve-queries training queries with --curve-seeds seeds, score each run on the same evaluation items
    (accuracy, answer log-probability, KL from the 8-shot teacher) and write <out>/curve.md (mean [95% interval] per row
    and budget), curve.json (every run), curve.png and tune.json. One thread on CPU unless --threads (main): faster
    than two on a tiny model (docs/efficiency.md, "Threads on a CPU"), and deterministic. Stopped, the same command
    continues it: each run trains with train.py --proceed (a finished one is skipped, a stopped one resumed) and each
    evaluation of the same settings is read. Handed in by evaluate.py: train_main (train.py's main), run_teacher
    (train.run_teacher), scored(backbone, flags, items, setting) (evaluate.py's evaluation of its flags) and
    paper_lam (train.py's default lambda)."""
    settings = curve_settings(args)
    results.check_replaceable(os.path.join(args.out, "curve.json"), settings)  # before hours of training
    items, backbone = tasks.eval_items(args), backbones.load_backbone(args.model)
    kind, shots = tasks.spec(args.task).kind, tasks.default_shots(args.task, backbone.family)
    # the teacher: the backbone's answer logits with `shots` random ICDs from the training split (seed 0), per item
    icds = data.demonstrations([it.id for it in items], tasks.load_task(args.task, "train", args.data_root), shots, 0)
    pieces, teacher = data.query_pieces(backbone.processor, backbone.family, kind, items), []
    for i in tqdm(range(0, len(items), args.batch_size), desc=f"{shots}-shot teacher", unit="batch"):
        s = slice(i, i + args.batch_size)
        batch = data.teacher_batch(backbone.processor, backbone.family, kind, pieces[s], icds[s])
        teacher += [t.cpu() for t in run_teacher(backbone, batch, output="logits")]
    common = ["--model", args.model, "--task", args.task] + (["--data-root", args.data_root] if args.data_root else [])
    scoring = common + ["--split", args.split, "--batch-size", str(args.batch_size), "--seed", "0"] + \
        (["--n-eval", str(args.n_eval)] if args.n_eval else [])
    icl_flags = lambda n: scoring + ["--shots", str(n), "--out", os.path.join(args.out, "icl")]
    levels = {f"{n}-shot ICL": scored(backbone, icl_flags(n), items, f"{n}-shot") for n in sorted({*ICL_LEVELS, shots})}
    levels = {k: {"accuracy": m[results.headline_metric(m)]} for k, m in levels.items()}
    levels["0-shot ICL"] |= answer_measures(backbone, kind, items, teacher, args.batch_size)
    rows = curve_runs(args.curve_methods)
    methods = list(dict.fromkeys(method_of(flags) for _, flags in rows))
    training = common + shlex.split(args.train_args)  # every run's train.py flags, before its own
    chosen = {} if args.no_tune else tune(args.out, training, methods, train_main, paper_lam)[0]
    runs, plan = [], list(itertools.product(rows, args.curve_queries, range(args.curve_seeds)))
    for (name, flags), n, seed in tqdm(plan, desc="learning curves", unit="run"):
        out = os.path.join(args.out, re.sub(r"[^a-z0-9.]+", "-", name.lower()), f"n{n}-seed{seed}")
        row = row_flags(flags, chosen)
        adapter = train_main(training + row + ["--n-train", str(n), "--seed", str(seed), "--out", out, "--proceed",
                                               "--teacher-cache", os.path.join(args.out, "teacher")])
        checkpoint = os.path.join(out, "adapter.safetensors")
        method = adapter_files.load_adapter(checkpoint, backbone)["method"]
        m = scored(backbone, scoring + ["--checkpoint", checkpoint, "--out", out], items, method)
        runs.append({"setting": name, "queries": n, "seed": seed, "accuracy": m[results.headline_metric(m)],
                     "params": sum(t.numel() for t in adapter.values()), "flags": shlex.join(row),
                     **answer_measures(backbone, kind, items, teacher, args.batch_size)})
        M.detach(backbone.model)
    write_curve(args, runs, levels, len(items), chosen, settings)
    return runs, levels


def curve_settings(args):
    """What changes a --curve's result, as curve.json records it."""
    return {"model": args.model, "task": args.task, "split": args.split, "n_eval": args.n_eval,
            "data_root": args.data_root and os.path.abspath(args.data_root), "curve_queries": args.curve_queries,
            "curve_seeds": args.curve_seeds, "curve_methods": args.curve_methods, "no_tune": args.no_tune,
            "train_args": args.train_args}


CURVE_RANGE = {"accuracy": (0, 100), "answer_logprob": (None, 0), "teacher_kl": (0, None)}  # where each can lie

CURVE_MEASURES = {"accuracy": "accuracy x 100", "answer_logprob": "log p(reference answer)",
                  "teacher_kl": "KL(8-shot teacher || model) per answer token"}


def write_curve(args, runs, levels, n_items, chosen, recorded):
    """curve.md: each row's flags and size, then per measure a table of mean [95% interval] per row and budget;
    curve.json (with the `recorded` settings, curve_settings); curve.png: each measure against the training queries,
    a band per row, the ICL levels as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    budgets = sorted({r["queries"] for r in runs})
    stats = {(s, n, k): mean_interval([r[k] for r in runs if r["setting"] == s and r["queries"] == n])
             for s in settings for n in budgets for k in CURVE_MEASURES}
    lines = [f"{args.model} on {args.task}/{args.split}, {n_items} items; mean [95% interval] over "
             f"{args.curve_seeds} seeds per point; train.py {args.train_args} --n-train N, then each row's flags; "
             "learning rates " + ("tuned (tune.json)" if chosen else "as published (--no-tune)"), "",
             "| setting | train.py flags | trainable parameters |", "|---|---|---:|"]
    first = {s: next(r for r in runs if r["setting"] == s) for s in settings}
    lines += [f"| {s} | `{r['flags']}` | {r['params']:,} |" for s, r in first.items()]
    for k, title in CURVE_MEASURES.items():
        lines += ["", f"{title}: " + ", ".join(f"{name} {v[k]:.3g}" for name, v in levels.items() if k in v), "",
                  "| setting | " + " | ".join(f"N = {n}" for n in budgets) + " |", "|---|" + "---:|" * len(budgets)]
        lines += [f"| {s} | " + " | ".join("{:.3g} [{:.3g}, {:.3g}]".format(*stats[s, n, k]) for n in budgets) + " |"
                  for s in settings]
    files.atomic_write(os.path.join(args.out, "curve.md"), lambda f: f.write(("\n".join(lines) + "\n").encode()))
    files.write_json(os.path.join(args.out, "curve.json"),
                     {**recorded, "runs": runs, "levels": levels, "tuned": chosen}, indent=2)
    fig, axes = plt.subplots(1, len(CURVE_MEASURES), figsize=(15, 4.6), dpi=100)
    for ax, (k, title) in zip(axes, CURVE_MEASURES.items()):
        for i, s in enumerate(settings):
            mean, low, high = zip(*(stats[s, n, k] for n in budgets))
            color = plt.cm.tab20(i % 20)
            ax.plot(budgets, mean, "o-", color=color, lw=1.2, label=s)
            ax.fill_between(budgets, *(torch.tensor(b).clamp(*CURVE_RANGE[k]).tolist() for b in (low, high)),
                            color=color, alpha=0.12)  # the interval, cut at the measure's range
        for name, v in levels.items():
            if k in v:
                ax.axhline(v[k], color="black", ls=":" if name.startswith("0") else "--", lw=1, label=name)
        ax.set(xscale="log", xlabel="training queries (N)", title=title)
        ax.set_xticks(budgets, [str(n) for n in budgets])
        ax.minorticks_off()
    axes[0].legend(fontsize=6, loc="best")
    fig.tight_layout()
    files.atomic_write(os.path.join(args.out, "curve.png"), lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
    print("\n".join(lines) + f"\n-> {args.out}/curve.md, curve.png")
