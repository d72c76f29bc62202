"""Evaluation: generate, score, the paper's evaluation (Table 1, Table 2); every other mode is `python -m lab`.

How a score is made (Section 4.1): the items of --task's evaluation split are batched as left-padded prompts
(data.prompt_batch), the query alone (zero-shot, an adapter) or [ICDs; query] (n-shot ICL); the backbone decodes
greedily (generate), each answer is cut at its first line (postprocess) and score() applies the official metric
(lab/scores/metrics.py); --chair adds CHAIR (Table 5). The default job: 0-shot, N-shot ICL and the adapter.

    python evaluate.py                                   the default job: toy-idefics2 on toy-icl-colour
    python evaluate.py --model idefics2 --task vqav2 --data-root D --checkpoint runs/.../adapter.safetensors
    python evaluate.py --model idefics2 --task seed --data-root D --shots 2 --seed-protocol likelihood
    python -m lab --help                                 the tables, figures, vectors, Table 6, the analyses, plans
"""
import contextlib
import functools
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

import torch
from tqdm import tqdm

import data as D
import model as M
from lab.datasets import predict_args, readers, rices, tasks
from lab.models import backbones, families
from lab.run import adapter_files, locks, prefetch, shard, torchrun
from lab.scores import chair, reports, results, seed_likelihood
from lab.cli import eval_cli, harness
from lab.scores.metrics import cider_d, multiple_choice_accuracy, vqa_accuracy
from lab.datasets.tasks import load_task  # a task's items by split, for predict() from Python (README)


@dataclass
class Config(harness.EvalSettings):
    """The evaluation's settings; each field an evaluate.py flag, as in train.py's Config (lab/cli/flags.py). The
    harness's (lab/cli/harness.py) are inherited with their defaults: flags of `python -m lab evaluate` only."""
    # what is evaluated, on what
    model: str = "toy-idefics2"       # backbone, as train.py's --model
    task: str = "toy-icl-colour"      # benchmark (data.TASKS) or a task of one's own, as train.py's --task
    checkpoint: Optional[str] = None  # adapter; None: runs/<model>-<task>-hyper-icl/'s if it exists and no --shots
    checkpoint_task: Optional[str] = None  # --checkpoint's task where it is not --task's (Table 8), else refused
    shots: Optional[int] = None       # ICDs per query (0: zero-shot; N: N-shot Direct-ICD; the teacher's for --gates)
    icds: Literal["random", "rices"] = "random"  # how ICDs are chosen: random, or rices (lab/datasets/rices.py)
    split: Literal[(*D.SPLITS, *readers.TEST_SPLITS)] = "val"  # VQAv2's test-dev, test: the server's file (lab/scores)
    n_eval: Optional[int] = None      # the first N items (None: all); MME, SEED: about N, stratified by --seed
    eval_draw: Literal["first", "seeded"] = "first"  # --n-eval's items: the first N, or N drawn with --seed (in order)
    seed: int = 0                     # the demonstration draw
    seed_protocol: Optional[Literal["generate", "likelihood"]] = None  # SEED: None: generate; likelihood: official
    new_tokens: Optional[int] = None  # tokens generated per query (None: --task's; --benchmark --random-weights mid: 8)
    chair: Optional[Literal["chair.py", "corrected"]] = None  # also CHAIR and Recall, chair.py's count or corrected
    force: bool = False               # load a --checkpoint of another backbone of the same shape (with a warning)
    again: bool = False               # evaluate even where --out holds a result of these settings (else it is read)
    # the machine and the files
    data_root: Optional[str] = None   # datasets in their official layout (docs/real-models.md; toy-icl-*: none)
    out: Optional[str] = None         # results (None: the checkpoint's folder, else runs/eval-<model>-<task>)
    batch_size: int = 8               # queries per generate call
    workers: int = field(default_factory=prefetch.default_workers)  # DataLoader workers, as train.py's
    threads: Optional[int] = None     # CPU threads for torch (None: one for the tiny and toy backbones on CPU)
    image_splitting: Literal[families.IMAGE_SPLITTING] = "checkpoint"  # Idefics2's image crops, as train.py's


# --------------------------------- generate and score (Section 4.1: greedy decoding, left-padded prompts of data.py)

_ANSWER_END = re.compile(r"\n|Question|Short answer|Caption")


def postprocess(text):
    """The answer in a generated continuation (decoded without special tokens): cut at the first newline or the next
    prompt piece ("Question", "Short answer", "Caption": data.PROMPTS), stripped; the rest is left to the metrics."""
    return _ANSWER_END.split(text.lstrip(), maxsplit=1)[0].rstrip()


@torch.no_grad()
def generate(backbone, inputs, max_new_tokens, min_new_tokens=0):
    """Greedy decoding; stops at backbones.stop_ids. Returns the new tokens only: [B, <= max_new_tokens]."""
    stop = {} if backbone.processor is None else dict(  # None: synthetic prompts (--random-weights), the config's eos
        pad_token_id=backbone.processor.tokenizer.pad_token_id, eos_token_id=backbones.stop_ids(backbone))
    out = backbone.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                  min_new_tokens=min_new_tokens, **stop)
    return out[:, inputs["input_ids"].shape[1]:]


def load_backbone(name, checkpoint=None, **options):
    """The backbone `name` (lab/models/backbones.py:load_backbone, which takes `options`) with the adapter saved at
    `checkpoint` attached (lab/run/adapter_files.py:load_adapter; None: none): what predict() answers with."""
    backbone = backbones.load_backbone(name, **options)
    if checkpoint is not None:
        adapter_files.load_adapter(checkpoint, backbone)
    return backbone


def predict(backbone, task, items, icds=None, batch_size=8, likelihood=False, workers=0, new_tokens=None):
    """Answers (or captions) for items, icds[i] before item i (n-shot ICL) or none (zero-shot / adapter), at most
    new_tokens each (None: the task's); with `likelihood` (SEED-Bench's official protocol) the letter of the option
    of highest log p(option) (lab/scores/seed_likelihood.py). `workers` DataLoader workers prepare the batches while
    the model decodes; under torchrun each process answers every N-th batch and all return every answer, in order.
    Arguments that would misalign answers and items are refused first (lab/datasets/predict_args.py)."""
    predict_args.check_predict(task, items, icds, batch_size, likelihood, new_tokens)
    kind, new_tokens = tasks.spec(task).kind, new_tokens or tasks.spec(task).max_new_tokens
    rank, tok, answers = torchrun.rank_and_world()[0], backbone.processor.tokenizer, {}
    starts = range(0, len(items), batch_size)
    mine = shard.share(starts, backbone.model)
    specs = [(items[i:i + batch_size], icds[i:i + batch_size] if icds else None) for i in mine]
    rows = prefetch.option_rows if likelihood else prefetch.prompt_rows
    build = functools.partial(rows, backbone.processor, backbone.family, kind)
    batches = prefetch.prepared(build, specs, workers, backbone.model.device)
    for i, batch in tqdm(zip(mine, batches), total=len(mine), desc=f"{backbone.name} {task}", unit="batch",
                         disable=rank != 0):
        if likelihood:
            scores = seed_likelihood.option_scores(backbone, batch, len(batch["labels"]) // len(D.SEED_LETTERS))
            answers[i] = [D.SEED_LETTERS[k] for k in scores.argmax(-1).tolist()]
        else:
            tokens = generate(backbone, D.model_inputs(batch, backbone.model.device), new_tokens)
            answers[i] = [postprocess(t) for t in tok.batch_decode(tokens, skip_special_tokens=True)]
    answers = torchrun.gathered(answers)
    return [p for i in starts for p in answers[i]]


def score(kind, items, predictions):
    """The reported metric: VQA accuracy x 100 (vqaEval.py), CIDEr (CIDEr-D, pycocoevalcap) x 100 (Table 1), or the
    accuracy in percent of MME (yes/no, parsed as its calculation.py) and SEED-Bench (option letters) (Table 2)."""
    if kind in ("yes-no", "choice"):
        return "accuracy", 100 * multiple_choice_accuracy(predictions, [it.target for it in items])
    if kind == "vqa":
        return "vqa_accuracy", 100 * sum(vqa_accuracy(p, it.answers) for it, p in zip(items, predictions)) / len(items)
    cider, _ = cider_d({it.id: p for it, p in zip(items, predictions)}, {it.id: list(it.answers) for it in items})
    return "cider", 100 * cider


def evaluate(backbone, args, items, setting, vector=None):
    """Evaluate one setting (Table 1's rows: zero-shot, n-shot ICL with random or RICES ICDs, an adapter; `vector`:
    (its steering context, its facts), a task or function vector of `python -m lab evaluate --vector`) on the items.
    Writes <out>/<result_name>.predictions.jsonl and .metrics.json, prints one line and returns the metrics; a result
    of these settings is read back, one of others under that name refused first (lab/scores/reports.py)."""
    kind, icds, (steering, vector_info) = tasks.spec(args.task).kind, None, vector or (None, {})
    params = args.checkpoint and sum(p.numel() for p in M.adapter_modules(backbone.model).parameters())  # # Params
    stem, metrics, done = reports.begin(backbone, args, setting, items, kind, vector_info, params)
    if done:
        return done
    if args.shots and not steering:  # Direct-ICD baseline: demonstrations from the training split
        icds = rices.choose_demonstrations(backbone, args, items, tasks.icd_support(args), args.shots)
    with steering or contextlib.nullcontext():  # TV / FV: the vector patched in
        predictions = predict(backbone, args.task, items, icds, args.batch_size, args.seed_protocol == "likelihood",
                              args.workers, args.new_tokens)
    if readers.server_split(args.task, args.split):  # no answers to score: the test server's file (test_server)
        return reports.server_file(args, kind, items, predictions, setting, stem, metrics)
    scored = dict([score(kind, items, predictions)])
    scored |= chair.chair_metrics(items, predictions, args.chair) if args.chair else {}
    return reports.written(args, kind, items, predictions, setting, stem, metrics, scored)


def evaluate_with_baselines(backbone, args, items, setting):
    """The default job's evaluation: zero-shot and the paper's N-shot ICL (no adapter), then the adapter if there is
    one; prints them side by side (reports.side_by_side) and returns the adapter's metrics (zero-shot's without an
    adapter)."""
    shots = reports.icl_shots(backbone, args)
    with M.without_adapter(backbone.model):
        done = [evaluate(backbone, replace(args, shots=n), items, f"{n}-shot") for n in (0, shots)]
    if args.checkpoint:
        done.append(evaluate(backbone, args, items, setting))
    reports.side_by_side(args, items, done)  # one line; it says so where N-shot ICL is at chance
    return done[-1] if args.checkpoint else done[0]


# ----------------------------------------------------------------------------------------------------- command line


def parse_args(argv=None):
    """evaluate.py's flags (lab/cli/eval_cli.py), the fields Config itself writes, their defaults a Config's. A flag of
    lab's (a harness setting, a study's, another mode) names its new command."""
    return eval_cli.parse_args(argv, __doc__, Config(), shown=Config.__annotations__, script=True)


def main(argv=None, load=None):
    """python evaluate.py [flags]: the evaluation of an adapter or n-shot ICL on --task's items; without --checkpoint
    or --shots the default job (0-shot, the paper's N-shot ICL and the default run's adapter, side by side). The
    other modes are lab's (`python -m lab --help`). load: as launch's."""
    return launch(parse_args(argv), load)


def launch(args, load=None, vector=None):
    """The evaluation of the parsed flags `args` (under torchrun the processes share the items). load: as train.py's;
    vector(backbone, args) -> (setting, (steering, facts)): a task or function vector's (`python -m lab evaluate
    --vector`)."""
    backbones.choose_threads(args.model, args.threads)
    with torchrun.process_group(), locks.locked(args.out, shared=True):  # evaluations share --out
        items = tasks.eval_items(args)
        if items == []:
            raise ValueError(f"{args.task} has no {args.split} items to evaluate")
        backbone = shard.loading(load, args.model, args.shard)(args.model, image_splitting=args.image_splitting,
                                                               image_memory=args.image_memory * 1e9)
        if backbone.images:
            print(backbone.images)
        if vector:
            setting, steered = vector(backbone, args)
            return evaluate(backbone, args, items, setting, steered)
        setting, default = reports.adapted(backbone, args), results.default_checkpoint(args.model, args.task)
        if args.shots is None and args.checkpoint in (None, default) and args.split in D.SPLITS:
            return evaluate_with_baselines(backbone, args, items, setting)  # the default job
        return evaluate(backbone, args, items, setting)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # bad input (unknown backbone, missing data, mismatched checkpoint)
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: every result file is written whole or not at all (lab/disk/files.py)
        print("interrupted (Ctrl-C): no result of the setting being evaluated was written", file=sys.stderr)
        raise SystemExit(130) from None
