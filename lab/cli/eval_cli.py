"""evaluate.py's command line: every flag and its checks."""
import argparse
import contextlib
import io
import os
import shlex
import sys

import torch

import data
from lab.datasets import readers, tasks
from lab.scores import chair, results
from lab.studies import curves, table6, vectors
from lab.cli import flags


def parse_args(argv, doc, train_parse):
    """The flags (see --help). Fills in the default checkpoint and the output folder."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="toy-idefics2",
                   help="backbone: idefics2, idefics, llava-interleave, llava-onevision (the paper's checkpoints), "
                        "tiny-<family> (offline twin, random weights), toy-idefics2 (meta-trained to learn in "
                        "context: the shipped reference), a toy backbone's file (train.py --build-toy), or a local "
                        "path (default: %(default)s)")
    p.add_argument("--task", default="toy-icl-colour", type=tasks.task_arg,
                   help=f"benchmark ({', '.join(data.TASKS)}) or a task of one's own: a .jsonl file, a folder of "
                   "train.jsonl and val.jsonl, or a LLaVA .json (README, \"Your own data\"; default: %(default)s)")
    p.add_argument("--checkpoint", help="adapter checkpoint (train.py's <out>/adapter.safetensors; default: "
                   f"{results.default_checkpoint('<model>', '<task>')} if it exists and --shots is not given, else "
                   "none)")
    p.add_argument("--shots", type=int, help="random in-context demonstrations per query from the training split "
                   "(0: zero-shot; N: the paper's N-shot Direct-ICD baseline). For --gates / --hyperbolicity: the "
                   "teacher's ICDs (default: the paper's, data.default_shots: 2 for MME and SEED)")
    flags.add_icd_flags(p)
    flags.add_plan_flags(p)
    flags.add_worker_flag(p)
    p.add_argument("--n-eval", type=int, help="evaluate the first N items of the split (default: all; the paper "
                                              "uses 10,000 VQAv2 val questions, the full OK-VQA val and COCO test); "
                                              "MME and SEED-Bench: about N questions drawn by image, stratified by "
                                              "subtask / dimension and seeded by --seed (tasks.stratified_subset); "
                                              "--split test-dev / test: no server file below the split's size")
    p.add_argument("--batch-size", type=int, default=8, help="queries per generate call (default: %(default)s)")
    p.add_argument("--data-root", help="datasets in their official layout (docs/real-models.md; toy-icl tasks need "
                                       "none)")
    p.add_argument("--split", default="val", choices=[*data.SPLITS, *readers.TEST_SPLITS],
                   help="split to evaluate (default: %(default)s); VQAv2's test-dev and test have no answers: they "
                        "write the test server's file, vqav2_<test-dev2015|test2015>_<setting>_results.json in --out; "
                        "a folder task's test: its test.jsonl")
    p.add_argument("--seed", type=int, default=0, help="seed of the demonstration draw (default: %(default)s)")
    p.add_argument("--seed-protocol", choices=["generate", "likelihood"], help="SEED-Bench: generate the option "
                   "letter (exact match; the form Table 2 appears to use, docs/real-models.md) or rank the four "
                   "options by log-likelihood as the official evaluation does (default: generate)")
    p.add_argument("--out", help="folder for predictions / metrics / analyses (default: the checkpoint's folder, "
                                 "else runs/eval-<model>-<task>)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--benchmark", action="store_true", help="Table 6: prefill and generation FLOPs and latency of "
                      "zero-shot, the adapter (--checkpoint, else every method of model.METHODS, fresh) and "
                      "--bench-shots-shot ICL on one query, relative to zero-shot")
    mode.add_argument("--benchmark-attention", action="store_true", help="one decoder attention layer of the backbone "
                      "(see --random-weights) at --attention-tokens tokens: latency and peak memory of plain SDPA, of "
                      "every method of model.METHODS and of Hyper-ICL's T x T reference, relative to SDPA")
    mode.add_argument("--gates", action="store_true", help="Table 10: gate statistics and Corr(g, Delta A) of a "
                      "Hyper-ICL checkpoint")
    mode.add_argument("--hyperbolicity", action="store_true", help="Table 9: delta-hyperbolicity of teacher and "
                      "student (with --checkpoint) hidden states")
    mode.add_argument("--curve", action="store_true", help="learning curves: each method's learning rate tuned on "
                      "held-out training queries (see --no-tune), then every method of model.METHODS and "
                      "Hyper-ICL's anchor ablations trained on --curve-queries training queries with --curve-seeds "
                      "seeds; mean and 95%% interval of accuracy, answer log-probability and KL from the 8-shot "
                      "teacher per point; writes curve.md, curve.json, curve.png and tune.json")
    p.add_argument("--curve-queries", type=int, nargs="+", default=list(curves.CURVE_QUERIES),
                   help="--curve: training queries per run (default: %(default)s)")
    p.add_argument("--curve-seeds", type=int, default=curves.CURVE_SEEDS,
                   help="--curve: seeds per point (default: %(default)s)")
    p.add_argument("--curve-methods", nargs="+", help="--curve: only these rows (names as in curve.md; default: all)")
    p.add_argument("--no-tune", action="store_true", help="--curve: train every method at its published learning "
                   "rate (PUBLISHED_LR) instead of tuning it on held-out training queries first")
    p.add_argument("--train-args", default="", help="with --curve: train.py flags for every run, before the "
                   f"tuned rate and each row's own (default: '{curves.CURVE_TRAIN_ARGS}')")
    p.add_argument("--vector", choices=["tv", "fv"], help="evaluate zero-shot with a training-free in-context vector "
                   "(Table 1): tv = task vector (Hendel et al. 2023), fv = function vector (Todd et al. 2024), "
                   "computed once from --vector-sets ICL prompts of --shots ICDs (default: the paper's) of the "
                   "training split and saved under <out>/vectors/")
    p.add_argument("--vector-layer", type=int, help="decoder layer (0-based) the vector goes in (default: the one "
                   "with the lowest target loss on --vector-heldout training queries)")
    p.add_argument("--vector-sets", type=int, default=vectors.VECTOR_SETS, help="ICL prompts averaged into the vector "
                   "(default: %(default)s, as Todd et al.'s mean activations)")
    p.add_argument("--vector-heldout", type=int, default=32, help="training queries held out to choose the layer "
                   "(default: %(default)s)")
    p.add_argument("--fv-heads", type=int, default=vectors.FV_HEADS, help="k, heads summed into a function vector "
                   "(default: %(default)s, Todd et al.'s |A|)")
    p.add_argument("--fv-trials", type=int, default=vectors.FV_TRIALS, help="corrupted prompts for each head's average "
                   "indirect effect (default: %(default)s, Todd et al.'s)")
    p.add_argument("--chair", nargs="?", const="chair.py", choices=chair.CHAIR_COUNTS, help="also CHAIR_s, CHAIR_i and "
                   "object Recall (Table 5) of the captions, from coco/annotations/instances_{train,val}2014.json "
                   "under --data-root (coco); counted as the published chair.py counts, its quirks "
                   "included (as in published numbers), or with `--chair corrected` without them (chair_s_corrected, "
                   "...)")
    p.add_argument("--random-weights", nargs="?", const="published", choices=["published", "mid"],
                   help="with --benchmark / --benchmark-attention: a backbone of --model's family with random weights "
                   "and synthetic prompts, no download. 'published' (the default when no size is named): the real "
                   "size (published.PUBLISHED), bf16 on CUDA (--benchmark-attention: one layer of its attention sizes, "
                   "also on CPU); 'mid': 8 decoder layers x 1024, 16 heads, 4 key/value heads (published.mid_model), "
                   f"float32, a {table6.MID_QUERY_TEXT}-token query, meant for CPUs")
    p.add_argument("--new-tokens", type=int, help="--benchmark: tokens generated per query (default: --task's "
                                                  "generation length; 8 with --random-weights mid)")
    p.add_argument("--bench-shots", type=int, nargs="*", default=list(table6.BENCH_SHOTS),
                   help="--benchmark: the n-shot ICL rows (default: %(default)s; none when given without values)")
    p.add_argument("--attention-tokens", type=int, default=2048, help="--benchmark (peak memory of one attention "
                   "layer) and --benchmark-attention: query and key tokens (default: %(default)s)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: one for the tiny and toy backbones "
                   "on CPU, else torch's own choice)")
    p.add_argument("--rounds", type=int, default=table6.ROUNDS, help="benchmarks: rounds of timed runs, each setting "
                   "once per round between two runs of the reference (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="load --checkpoint even if it was trained on another "
                   "backbone (family or weights) of the same shape, with a warning")
    # `--train-args VALUE` as `--train-args=VALUE`: a value starting with '-' ("--resume") is the flag's, not a flag
    argv = list(sys.argv[1:] if argv is None else argv)
    for k in range(len(argv) - 1):
        if argv[k] == "--train-args":
            argv[k:k + 2] = [f"--train-args={argv[k + 1]}", None]
    args = p.parse_args([a for a in argv if a is not None])
    if args.seed_protocol and tasks.spec(args.task).kind != "choice":
        p.error(f"--seed-protocol applies to the SEED-Bench tasks (multiple choice), not {args.task}")
    args.seed_protocol = args.seed_protocol or "generate"
    flags.check_at_least(p, args, {"n_eval": 1, "batch_size": 1, "shots": 0, "rounds": 1, "vector_layer": 0,
                                   "vector_sets": 1, "vector_heldout": 1, "fv_heads": 1, "fv_trials": 1,
                                   "new_tokens": 1, "attention_tokens": 1, "threads": (1, flags.MAX_THREADS),
                                   "bench_shots": 0, "curve_queries": 1, "seed": (0, flags.MAX_SEED),
                                   "workers": (0, flags.MAX_WORKERS)})
    flags.check_image_memory(p, args)
    if args.curve:
        args.train_args = args.train_args or curves.CURVE_TRAIN_ARGS
        unknown = set(args.curve_methods or []) - {name for name, _ in curves.curve_runs()}
        if unknown:
            p.error(f"--curve-methods: unknown {sorted(unknown)}; choose from {[n for n, _ in curves.curve_runs()]}")
        if not 2 <= args.curve_seeds <= len(curves.T_975) + 1:
            p.error(f"--curve-seeds must be in [2, {len(curves.T_975) + 1}] for an interval (got {args.curve_seeds})")
        try:  # split as a shell does and parsed by train.py's parser (with what curve adds) now, before any work
            with contextlib.redirect_stderr(io.StringIO()) as err:
                train_parse(["--model", args.model, "--task", args.task, *shlex.split(args.train_args),
                             "--overwrite"])
        except ValueError as e:
            p.error(f"--train-args {args.train_args!r} cannot be split into flags ({e})")
        except SystemExit:
            p.error(f"--train-args {args.train_args!r}: train.py says: "
                    + err.getvalue().strip().splitlines()[-1].split(" error: ", 1)[-1])
    if args.split in readers.TEST_SPLITS and args.task != "vqav2" and \
            not (args.split == "test" and tasks.own_task.is_own(args.task)):
        p.error(f"--split {args.split} is VQAv2's test server split (--task vqav2) or a folder task's test.jsonl, "
                f"not {args.task}'s")
    if readers.server_split(args.task, args.split) and (args.curve or args.gates or args.hyperbolicity):
        p.error(f"--split {args.split} has no answers: it is for an evaluation (the test server's file), not "
                "--curve, --gates or --hyperbolicity")
    if args.icds == "rices" and not args.shots:
        p.error("--icds rices chooses demonstrations: give their number with --shots N")
    if args.chair and args.task != "coco":
        p.error(f"--chair scores COCO captions against COCO instance annotations (coco), not {args.task}")
    if args.random_weights and not (args.benchmark or args.benchmark_attention):
        p.error("--random-weights only makes sense with --benchmark or --benchmark-attention")
    if args.random_weights == "published" and args.benchmark and not torch.cuda.is_available():
        p.error("--random-weights published runs a real-size backbone and needs a CUDA GPU")
    default = results.default_checkpoint(args.model, args.task)
    if args.vector and (args.checkpoint or args.benchmark or args.gates or args.hyperbolicity):
        p.error("--vector evaluates the backbone with a task or function vector alone (no checkpoint or analysis)")
    if args.checkpoint is None and args.shots is None and not (args.benchmark or args.vector) and \
            os.path.isfile(default):
        args.checkpoint = default
    if args.checkpoint and not os.path.isfile(args.checkpoint) and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such file")
    if args.gates and args.checkpoint is None:
        p.error(f"--gates needs a Hyper-ICL checkpoint (--checkpoint; {default} does not exist)")
    name = os.path.basename(args.model.rstrip("/")) + (f"-random-weights-{args.random_weights}"
                                                       if args.random_weights else "")
    task = tasks.file_name(args.task)
    args.out = args.out or (f"runs/curve-{name}-{task}" if args.curve else os.path.dirname(args.checkpoint)
                            or "." if args.checkpoint else f"runs/eval-{name}-{task}")
    flags.check_folders(p, {"--out": args.out, "--rices-cache": args.rices_cache})
    return args
