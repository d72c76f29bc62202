"""Evaluation: how a score is made, then the paper's other measurements.

How a score is made (Table 1, Table 2): the items of --task's evaluation split (eval_items) are batched as left-padded
prompts (data.prompt_batch), the query alone (zero-shot, an adapter) or [ICDs; query] (n-shot ICL); the backbone decodes
greedily (generate), each answer is cut at its first line (postprocess) and score() applies the official metric: VQA
accuracy (vqaEval.py), CIDEr-D (pycocoevalcap, PTB-tokenised), or the accuracy of MME's yes/no and SEED-Bench's option
letters, which SEED-Bench's likelihood protocol ranks by log p(option) instead (option_logliks). evaluate() writes the
predictions and the metrics.

Sections, in order:
    inference and scoring    generate, predict, option_logliks, score, evaluate             (Section 4.1)
    metrics                  VQA accuracy, CIDEr-D with the PTB tokenizer, MME, SEED-Bench
    CHAIR                    object hallucination in captions, as chair.py counts it        (Table 5)
    in-context vectors       task and function vectors, training-free baselines             (Table 1)
    efficiency               FLOPs and latency of one query, attention memory               (Table 6)
    analyses                 the gate (Appendix D, Table 10), delta-hyperbolicity (Appendix C, Table 9)
    learning curves          every method on the toy world with seeds, intervals, a tuning rule (--curve)
    command line             the flags and main

    python evaluate.py                                   the default job: toy-idefics2 on toy-icl-colour, 0-shot,
                                                         8-shot and the default train.py run's adapter
    python evaluate.py --model idefics2 --task vqav2 --data-root D --checkpoint runs/.../adapter.safetensors
    python evaluate.py --model idefics2 --task vqav2 --data-root D --shots 8     8-shot ICL (random ICDs)
    python evaluate.py --model idefics2 --task seed --data-root D --shots 2 --seed-protocol likelihood
                                                         Table 2: SEED-Bench, 2-shot, official option ranking
    python evaluate.py --benchmark [--model idefics2 --random-weights]           Table 6
    python evaluate.py --gates | --hyperbolicity --checkpoint PATH               Table 10 | Table 9
    python evaluate.py --curve                           every method on the toy world, tuned: learning curves
"""
import argparse
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

import data as D
import lorentz
import model as M
import train


# ------------------ inference and scoring (Section 4.1: greedy decoding, batched, left-padded prompts from data.py)

_ANSWER_END = re.compile(r"\n|Question|Short answer|Caption")


def postprocess(text):
    """The answer in a generated continuation (decoded without special tokens), the one place answers are cleaned
    before scoring: cut at the first newline or at the next prompt piece ("Question", "Short answer", "Caption", as in
    data.PROMPTS) and stripped. Case, punctuation and articles are left to the metrics' own normalisation."""
    return _ANSWER_END.split(text.lstrip(), maxsplit=1)[0].rstrip()


@torch.no_grad()
def generate(backbone, inputs, max_new_tokens, min_new_tokens=0):
    """Greedy decoding; stops at stop_ids. Returns the new tokens only: [B, <= max_new_tokens]."""
    stop = {} if backbone.processor is None else dict(  # None: synthetic prompts (--random-weights), the config's eos
        pad_token_id=backbone.processor.tokenizer.pad_token_id, eos_token_id=stop_ids(backbone))
    out = backbone.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                  min_new_tokens=min_new_tokens, **stop)
    return out[:, inputs["input_ids"].shape[1]:]


def stop_ids(backbone):
    """The ids that end an answer: the checkpoint's generation_config eos ids (one or a list), the tokenizer's eos
    and the family's end token (data.end_token), sorted."""
    tok, listed = backbone.processor.tokenizer, backbone.model.generation_config.eos_token_id
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    end = tok.convert_tokens_to_ids(D.end_token(backbone.processor, backbone.family))
    return sorted({*listed, tok.eos_token_id, end} - {None})


def predict(backbone, task, items, icds=None, batch_size=8, likelihood=False, workers=0):
    """Answers (or captions) for items, icds[i] before item i (n-shot ICL) or none (zero-shot / adapter); with
    `likelihood` (SEED-Bench's official protocol) the letter of the option of highest option_logliks. The batches are
    prepared by `workers` DataLoader workers while the model decodes (data.prepared). Under torchrun each process
    answers every N-th batch; every process returns all answers, in item order."""
    kind, new_tokens = D.TASKS[task].kind, D.TASKS[task].max_new_tokens
    (rank, world), tok, answers = train.rank_and_world(), backbone.processor.tokenizer, {}
    starts = range(0, len(items), batch_size)
    mine = starts[rank::world]
    specs = [(items[i:i + batch_size], icds[i:i + batch_size] if icds else None) for i in mine]
    build = functools.partial(option_rows if likelihood else prompt_rows, backbone.processor, backbone.family, kind)
    batches = D.prepared(build, specs, workers, backbone.model.device)
    for i, batch in tqdm(zip(mine, batches), total=len(mine), desc=f"{backbone.name} {task}", unit="batch",
                         disable=rank != 0):
        if likelihood:
            scores = option_scores(backbone, batch, len(batch["labels"]) // len(D.SEED_LETTERS))
            answers[i] = [D.SEED_LETTERS[k] for k in scores.argmax(-1).tolist()]
        else:
            tokens = generate(backbone, D.model_inputs(batch, backbone.model.device), new_tokens)
            answers[i] = [postprocess(t) for t in tok.batch_decode(tokens, skip_special_tokens=True)]
    answers = train.gathered(answers)
    return [p for i in starts for p in answers[i]]


def prompt_rows(processor, family, kind, spec):
    """The prompt batch of spec = (items, their ICDs or None): data.prompt_batch."""
    return D.prompt_batch(processor, family, kind, *spec)


@torch.no_grad()
def option_logliks(backbone, items, icds=None):
    """SEED-Bench's official likelihood protocol: log p(option) for each item's four options, [len(items), 4].
    As the official code sums each option's per-token losses, end token included, log p(option) is the sum (not
    length-normalised) of the log-probabilities of the option's text tokens and the end token after the query, under
    the official prompt "Question: {q}\nAnswer:" (data.PROMPTS "choice-likelihood"). icds[i] (with their answer's
    text as the answer) precede item i. All 4 x len(items) rows go through one left-padded forward pass."""
    return option_scores(backbone, option_rows(backbone.processor, backbone.family, None, (items, icds)), len(items))


def option_rows(processor, family, kind, spec):
    """The batch of option_logliks for spec = (items, their ICDs or None): four rows an item, one per option, under
    the "choice-likelihood" prompt (`kind` is that one)."""
    items, icds = spec
    kind, rows = "choice-likelihood", []
    for it, ds in zip(items, icds or [[] for _ in items]):
        with_text = [dataclasses.replace(d, target=d.answers[D.SEED_LETTERS.index(d.target)]) for d in ds]
        prefix = D.encode_prefix(processor, family, kind, with_text)
        rows += [D.join(prefix, D.encode_query(processor, family, kind, dataclasses.replace(it, target=o)))
                 for o in it.answers]
    return D.collate(rows, processor, family)


@torch.no_grad()
def option_scores(backbone, batch, n_items):
    """log p(option) [n_items, 4] from an option_rows batch (see option_logliks)."""
    batch = train.to_device(batch, backbone.model.device)
    rows = len(batch["labels"])
    logits, labels = train.target_logits(backbone.model, batch)  # the options' positions only
    logits, labels = logits[:, :-1], labels[:, 1:]
    answer = labels != -100                                   # position t predicts token t + 1
    logp = torch.log_softmax(logits[answer].float(), -1).gather(-1, labels[answer][:, None])[:, 0]
    per_row = torch.zeros(rows, device=logp.device).index_add(0, answer.nonzero()[:, 0], logp)
    return per_row.view(n_items, len(D.SEED_LETTERS)).cpu()


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
    """Evaluate one setting (Table 1 rows: zero-shot, n-shot ICL with random or RICES ICDs, an adapter, a task or
    function vector: `vector` as load_vector returns it) on --n-eval items. Writes <out>/<result_name>.predictions.jsonl
    (id, prediction, references per item) and .metrics.json (the settings, result_settings, and the scores), prints one
    summary line and returns the metrics. A metrics file of other settings under that name is refused first."""
    icds, (steering, vector_info) = None, vector or (None, {})
    kind = D.TASKS[args.task].kind
    stem = os.path.join(args.out, result_name(args, setting, len(items), vector_info))
    metrics = {**result_settings(backbone, args, setting, len(items)), **vector_info}
    if args.checkpoint:  # which adapter: a run --overwrite'n in its folder leaves these metrics naming the old bytes
        with open(args.checkpoint, "rb") as f:
            metrics["checkpoint_sha256"] = hashlib.sha256(f.read()).hexdigest()
    if kind == "choice":
        metrics["protocol"] = args.seed_protocol
    check_replaceable(stem + ".metrics.json", {k: metrics[k] for k in RESULT_SETTINGS if k in metrics})  # first
    if args.shots and not steering:  # Direct-ICD baseline: demonstrations from the training split
        support = D.load_task(args.task, "train", args.data_root)
        icds = D.choose_demonstrations(backbone, args, items, support, args.shots)
    with steer(backbone.model, **steering) if steering else contextlib.nullcontext():  # TV / FV: zero-shot + vector
        predictions = predict(backbone, args.task, items, icds, args.batch_size, args.seed_protocol == "likelihood",
                              args.workers)
    metric, value = score(kind, items, predictions)
    extra = chair_metrics(items, predictions, args.chair) if args.chair else {}
    metrics |= {metric: value, **extra}
    if kind == "yes-no":
        metrics["mme"] = mme_scores(items, predictions)
    elif kind == "choice":
        metrics["seed_bench"] = seed_scores(items, predictions)
    if train.rank_and_world()[0] != 0:  # under torchrun the first process writes
        return metrics
    lines = "".join(json.dumps({"id": it.id, "prediction": p, "references": list(it.answers)}) + "\n"
                    for it, p in zip(items, predictions)).encode()
    try:  # never the old metrics (or MME folder) beside the new predictions, even if killed next
        os.remove(stem + ".metrics.json")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise OSError(f"could not remove the old {stem}.metrics.json ({e.strerror or e})") from e
    if kind == "yes-no":
        D.discard(stem + ".mme")
    D.atomic_write(stem + ".predictions.jsonl", lambda f: f.write(lines))
    if kind == "yes-no":
        write_mme_results(stem + ".mme", items, predictions)
    # last, and naming the predictions it scores: a kill in between leaves old metrics whose hash does not match
    metrics |= {"predictions": os.path.basename(stem) + ".predictions.jsonl",
                "predictions_sha256": hashlib.sha256(lines).hexdigest()}
    D.write_json(stem + ".metrics.json", metrics, indent=2)
    print(f"{args.model} {args.task}/{args.split} {setting}: {metric} {value:.2f}"
          + "".join(f", {k} {v:.2f}" for k, v in extra.items()) + f" on {len(items)} items -> {stem}.metrics.json")
    if kind == "yes-no":
        m = metrics["mme"]
        print(f"MME perception {m['perception']:.2f}, cognition {m['cognition']:.2f}; " +
              ", ".join(f"{k} {v['score']:.1f}" for k, v in m["subtasks"].items()))
    elif kind == "choice":
        print(f"SEED-Bench ({args.seed_protocol}): " +
              ", ".join(f"{k} {v:.1f}" for k, v in metrics["seed_bench"]["dimensions"].items()))
    return metrics


def result_name(args, setting, n, vector_info):
    """The file name (no extension) of an evaluation's results, naming what besides the folder a user varies:
    <task>-<split>-<setting: method or n-shot, -rices>[-<SEED protocol>][-splitting-on|off][-<RICES encoder>]
    [-<vector layer and file key>][-chair[-corrected]][-<checkpoint key: a hash of its path, if it is not the folder's
    adapter.safetensors>]-seed<seed>-n<items>. What else changes a result (the backbone, --data-root, --n-eval) is in
    the metrics, and check_replaceable keeps a file of other settings from being replaced."""
    short = lambda text: hashlib.sha256(str(text).encode()).hexdigest()[:8]
    parts = [args.task, args.split, setting]
    if D.TASKS[args.task].kind == "choice":
        parts.append(args.seed_protocol)
    if args.image_splitting != "checkpoint":
        parts.append("splitting-" + args.image_splitting)
    if args.icds == "rices" and args.shots and args.rices_encoder:
        parts.append("encoder-" + short(args.rices_encoder))
    if vector_info:
        key = os.path.basename(vector_info["vector_file"]).rsplit("-", 1)[-1].split(".")[0]
        parts.append(f"layer{vector_info['vector_layer']}-{key}")
    if args.chair:
        parts.append("chair" if args.chair == "chair.py" else "chair-" + args.chair)
    if args.checkpoint and os.path.abspath(args.checkpoint) != os.path.abspath(os.path.join(args.out,
                                                                                          "adapter.safetensors")):
        parts.append("checkpoint-" + short(os.path.abspath(args.checkpoint)))
    return "-".join(parts + [f"seed{args.seed}", f"n{n}"])


def write_mme_results(folder, items, predictions):
    """One <subtask>.txt per subtask in the official eval_tool's results format (`image<TAB>question<TAB>answer
    <TAB>prediction`, an image's two questions on consecutive lines), so its calculation.py can check mme_scores. The
    folder is written whole or not at all (data.replaced): calculation.py never reads two runs' files mixed."""
    lines = {}
    for it, p in zip(items, predictions):  # " ".join(p.split()): no tab or newline may break the four columns
        row = f"{os.path.basename(it.image_path)}\t{it.question}\t{it.target}\t{' '.join(p.split())}\n"
        lines.setdefault(it.category, []).append(row)

    def write(tmp):
        for subtask, rows in lines.items():
            D.atomic_write(os.path.join(tmp, subtask + ".txt"), lambda f: f.write("".join(rows).encode()))
    D.replaced(folder, write)


def eval_items(args):
    """The items to evaluate: the split, or --n-eval of them (MME and SEED: a seeded subset drawn by image and
    stratified by subtask / dimension, data.stratified_subset; otherwise the first N)."""
    items = D.load_task(args.task, args.split, args.data_root)
    if args.n_eval and D.TASKS[args.task].kind in ("yes-no", "choice"):
        return D.stratified_subset(items, args.n_eval, args.seed)
    return items[:args.n_eval]


def evaluate_with_baselines(backbone, args, items, setting):
    """The default job's evaluation: zero-shot and the paper's N-shot ICL (no adapter), then the adapter if there is
    one; prints them side by side and returns the adapter's metrics (zero-shot's without an adapter). Where N-shot
    ICL is at chance (at most the most frequent answer's share of the items + 5 points; not for CIDEr), the
    line says so: the backbone does not learn in context and no score beside it shows anything."""
    shots = D.default_shots(args.task, backbone.family)
    with M.without_adapter(backbone.model):
        done = [evaluate(backbone, argparse.Namespace(**{**vars(args), "shots": n}), items, f"{n}-shot")
                for n in (0, shots)]
    if args.checkpoint:
        done.append(evaluate(backbone, args, items, setting))
    metric, icl, verdict = headline_metric(done[0]), done[1], ""
    chance = 100 * max(Counter(it.target for it in items).values()) / len(items)
    if metric != "cider" and icl[metric] <= chance + 5:
        verdict = (f": NOT A RESULT: {icl['setting']} ICL is at chance ({icl[metric]:.1f} <= {chance:.1f}, always "
                   "the most frequent answer, + 5): this backbone does not learn in context, so nothing here can be "
                   "distilled")
    print("  ".join(f"{m['setting']} {m[metric]:.1f}" for m in done) + f" ({metric}, {args.task}/{args.split}, "
          f"{len(items)} items)" + verdict)
    return done[-1] if args.checkpoint else done[0]


def headline_metric(metrics):
    """The name of the metric an evaluation reports first: VQA accuracy, CIDEr, or (MME, SEED-Bench) accuracy."""
    return next(k for k in ("vqa_accuracy", "cider", "accuracy") if k in metrics)


# -------------------------------------- metrics, as the official tools compute them (VQA, CIDEr-D, MME, SEED-Bench)

# VQA answer normalisation tables, as in the official vqaEval.py (GT-Vision-Lab/VQA).
# The official contraction table also holds capitalised keys (Im, Ive, Id've, I'dve) and identity
# entries (let's, she's); they can never change a lowercased answer and are left out here.
_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't", "dont": "don't",
    "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd", "howll": "how'll",
    "hows": "how's", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's", "thered": "there'd",
    "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're", "theres": "there's", "theyd": "they'd",
    "theyd've": "they'd've", "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've",
    "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't",
    "whatll": "what'll", "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's",
    "whered": "where'd", "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're",
    "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
            "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
# The official pattern is "(?!<=\d)(\.)(?!\d)": its "(?!<=" is a lookahead for the literal "<=", not a
# lookbehind, so in effect it deletes every '.' that is not followed by a digit ("5." -> "5", "2.5" kept).
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")


def _clean_whitespace(s):
    return s.replace("\n", " ").replace("\t", " ").strip()


def normalize_vqa_answer(ans):
    """Normalise an answer as the official VQA evaluation (vqaEval.py, GT-Vision-Lab/VQA) does:
    newline/tab -> space and strip, then processPunctuation, then processDigitArticle (lowercase,
    number words -> digits, drop a/an/the, restore contractions like dont -> don't)."""
    s = out = _clean_whitespace(ans)
    # processPunctuation: each mark is deleted if it touches a space in the *input* or the input has a digit,digit
    # comma; otherwise it becomes a space. The official call passes re.UNICODE (= 32) as sub's *count* argument, so
    # at most 32 periods are removed.
    for p in _PUNCT:
        delete = p + " " in s or " " + p in s or _COMMA_STRIP.search(s) is not None
        out = out.replace(p, "" if delete else " ")
    words = [_NUMBERS.get(w, w) for w in _PERIOD_STRIP.sub("", out, count=32).lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def vqa_accuracy(prediction, answers):
    """VQA accuracy in [0, 1] of one prediction against the ten human answers, as vqaEval.py computes it: for each human
    answer, min(1, #matches among the other nine / 3), averaged over the ten. Quirk kept: the punctuation/digit/article
    normalisation applies (to answers and prediction) only when the whitespace-cleaned answers are not all identical."""
    prediction = _clean_whitespace(prediction)
    answers = [_clean_whitespace(a) for a in answers]
    if len(set(answers)) > 1:
        prediction = normalize_vqa_answer(prediction)
        answers = [normalize_vqa_answer(a) for a in answers]
    matches = [a == prediction for a in answers]
    total = sum(matches)
    return sum(min(1.0, (total - m) / 3) for m in matches) / len(answers)


# Captions are tokenised as pycocoevalcap does: the Java Stanford PTBTokenizer (CoreNLP 3.4.1, its default options,
# -preserveLines -lowerCase) on the raw caption, then ptbtokenizer.py drops the punctuation tokens below. Lowercasing
# comes after tokenising (some rules look at case), so brackets become "-lrb-", "-rrb-", ... and stay: the official
# drop list names "-LRB-", "-RRB-", "-LCB-", "-RCB-" in upper case, which no lowercased token matches.
_PTB_DROPPED = {"''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"}


def _caseless_words(words):
    """A regex alternation of words, case-insensitive except a first letter written in brackets ("[M]iss")."""
    return "|".join(w[1] + f"(?i:{w[3:]})" if w.startswith("[") else f"(?i:{w})" for w in words.split())


_L, _LD = r"[^\W\d_]", r"[^\W_]"    # a letter; a letter or digit
_APOS, _APOS_ETC = "['\u0092\u2019]", "['`\u0091\u0092\u2018\u2019\u201B]"
_WORD = rf"{_L}{_LD}*(?:[.!?]{_L}{_LD}*)*"
_REDAUX = rf"{_APOS}(?:[msdMSD]|(?i:re|ve|ll))"          # 's 'm 'd 're 've 'll
_SREDAUX = rf"[nN]{_APOS_ETC}[tT]"                          # n't
_ACRO = r"[A-Za-z](?:\.[A-Za-z])*"                        # u.s, a.m, or a single letter
_NUM = r"\d*(?:[.:,]\d+)+|\d+"                             # 2.5, 1,000, 5:30, 2
_THING = rf"(?:[dDoOlL]{_APOS_ETC}{_LD})?{_LD}+"
# PTB's abbreviations, which keep their period: ABBREV1 (usually followed by lower case), ABBREV2 (titles and
# acronyms), ABBREV3 (only before a number).
_ABBREV1 = _caseless_words(
    "Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec Mon Tue Tues Wed Thu Thurs Fri "
    "Ala Ariz [A]z [A]rk Calif Colo Conn Ct Dak [D]el Fla Ga [I]ll Ind Kans Kan Ky [L]a [M]ass Md Mich Minn [M]iss "
    "Mo Mont Neb Nev Okla [O]re [P]a Penn Tenn [T]ex Va Vt [W]ash Wisc Wis Wyo "
    "Inc Cos Co Corp Ltd Plc Rt Bancorp Bhd Assn Univ Intl Sys tel est ext sq Jr Sr Bros Ed.D Ph.D Blvd Rd Esq "
    "etc al seq Bldg") + r"|(?i:pp?t)[ye](?i:s)?"
_ABBREV2 = _caseless_words(
    "Mr Mrs Ms [M]iss Dr Drs Prof Profs Sen Sens Rep Reps Atty Attys Lt Col Gen Messrs Gov Govs Adm Rev Maj Sgt Cpl "
    "Pvt Capt St Ste Ave Pres Lieut Hon Brig Cmdr Comdr Pfc Spc Supt Supts Det Mt Ft Adj Adv Asst Assoc Ens Insp "
    "Mlle Mme Msgr Sfc vs Alex Wm Jos Cie a.k.a cf TREAS Ph Invt Elec Natl Mfg Mtg Dept").replace(".", r"\.") \
    + "|" + _ACRO
_ABBREV3 = _caseless_words("ca fig figs prop no nos art bldg pp op")
_APOWORD = "|".join([
    rf"{_APOS}[nN]{_APOS}?",                                     # rock 'n' roll
    rf"[lLdDjJ]{_APOS}", rf"(?i:dunkin|somethin|ol){_APOS}", rf"{_APOS}(?i:em|till?|cause)", rf"{_APOS}[2-9]0(?i:s)",
    rf"[A-HJ-XZn]{_APOS_ETC}{_L}{{2,}}", rf"{_L}+[aeiouyAEIOUY]{_APOS_ETC}[aeiouA-Z]{_L}*",
    r"(?i:cont'd\.?|'twas|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)", rf"O{_APOS_ETC}o"])
# (token, trailing context, output) in PTBLexer's rule order. At each position the rule whose token + context is
# longest wins, ties going to the earlier rule; the token is emitted (as `output` when given) and lexing resumes
# after it, so the context is read again. Rules whose output the official wrapper drops anyway are merged.
_PTB_RULES = [(re.compile(tok), re.compile(ctx), out) for tok, ctx, out in [
    ("(?i:can)", "(?i:not)", None),                              # cannot -> can not
    ("'(?i:t)", "(?i:was|is)", None),                            # 'twas -> 't was
    ("(?i:gon|wan)", "(?i:na)", None), ("(?i:got)", "(?i:ta)", None), ("(?i:lem|gim)", "(?i:me)", None),
    (_WORD, _REDAUX, None),                                      # dog|'s
    (r"[A-Za-z]*[A-MO-Za-mo-z]", _SREDAUX, None),                # do|n't, ca|n't
    (_WORD, "", None),
    (_APOWORD, "", None),
    (_REDAUX, "[^A-Za-z]|$", None), (_SREDAUX, "[^A-Za-z]|$", None),
    (r"\d{1,2}[-/]\d{1,2}[-/]\d{2,4}", "", None),                # dates
    (rf"[-+]?(?:{_NUM})", "", None),
    (r"(?:\d{1,4}-)?\d{1,4}\\?/\d{1,4}", "", None),               # 1/2, 1-1/2
    (r"[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}", "", None),  # and/or
    (r"[A-Z]*\$|#", "", None),
    (rf"(?:{_ABBREV3})\.", r"\s?\d", None),                      # no. 5
    (rf"(?:{_ABBREV1})\.", r"(?s:.{0,2})", None),                 # etc.
    (rf"(?:{_ABBREV2})\.", "", None),                             # mr., st., u.s.
    (rf"{_APOS}\d\d", r"\s", None),                                # '90
    (rf"{_WORD}\.", "[,;:]", None),
    ('"', "", "``"), (r"</?[A-Za-z][\w:.-]*\s*/?>", "", None), ("<|>", "", None),  # <angle> is one SGML token
    (r"\{", "", "-LCB-"), (r"\}", "", "-RCB-"), (r"\[", "", "-LSB-"), (r"\]", "", "-RSB-"),
    (r"\(", "", "-LRB-"), (r"\)", "", "-RRB-"),
    ("-{3,4}", "", "--"), ("-+", "", None),
    (r"\.{3,5}|(?:\.\s){2,4}\.|\u2026", "", "..."),
    ("@+|#+|_+|\\*+", "", None), ("[,;:]", "", None), ("[?!]+", "", None), (r"\.", "", None), ("[=/]", "", None),
    (r"[A-Za-z0-9][A-Za-z0-9.,]*(?:-(?:[A-Za-z](?:\.[A-Za-z])+\.|[A-Za-z0-9]+))+", "", None),  # x-ray, 2.5-inch
    (rf"{_THING}(?:-{_THING})*", "", None),
    (r"[A-Z]+(?:[+&][A-Z]+)+", "", None),                          # AT&T
    (rf"{_APOS_ETC}|''|[\u201A-\u201F\u0093\u0094\u2039\u203A\u00AB\u00BB]{{1,2}}", "", "''"),
    (r"\S", "", None)]]


def _ptb_tokens(s):
    """The tokens of the Stanford PTBTokenizer rules above, before lowercasing and the wrapper's drop list."""
    i, tokens = 0, []
    while i < len(s):
        if s[i].isspace():
            i += 1
            continue
        best, length = None, 0
        for tok, ctx, out in _PTB_RULES:
            m = tok.match(s, i)
            c = m and ctx.match(s, m.end())
            if c and m.end() > i and c.end() - i > length:
                best, length = (m, out), c.end() - i
        m, out = best
        tokens.append(out or m.group())
        i = m.end()
    return tokens


def tokenize_caption(s):
    """Tokenise a caption as pycocoevalcap's ptbtokenizer.py does: the Stanford PTBTokenizer's rules (_PTB_RULES,
    longest match, re-implemented for what captions contain), lowercased, then the punctuation tokens it drops removed.
    Clitics are split ("dog's" -> dog 's, "don't" -> do n't) only before a non-letter ("'STOP'" is a quoted "stop", not
    's top); abbreviations keep their period; numbers, dates, fractions, hyphenated words and SGML tags stay whole;
    brackets become "-lrb-", "-rrb-", ... and are kept. Left out: PTB's sentence-final acronym rule (a single letter
    with a period before "The", "He", ... loses its period), which can look into the next caption of the official tool's
    input file; URLs, e-mail addresses, phone numbers and SGML tags with attributes; characters no rule covers are kept
    one by one, where PTB drops most of them."""
    return [t for t in (t.lower() for t in _ptb_tokens(s)) if t not in _PTB_DROPPED]


def cider_d(candidates, references, n=4, sigma=6.0):
    """CIDEr-D as pycocoevalcap's CiderScorer (coco-caption, the "CIDEr" of the COCO caption evaluation) computes
    it. candidates: {id: caption}, references: {id: [captions]}; captions are tokenised with tokenize_caption first.
    Document frequency counts each image once per n-gram (over the union of its references), idf is taken against
    log(#images); per n-gram order a clipped tf-idf cosine times exp(-delta^2 / (2 sigma^2)); averaged over
    references and over n = 1..4, x10. The official code measures length in bigrams; word counts give the same length
    difference whenever both captions are non-empty, and otherwise the cosine is 0, so words are used here. Returns
    (corpus score = mean over ids, {id: score})."""
    assert candidates.keys() == references.keys(), "candidates and references must share ids"
    ngrams = lambda w: Counter(tuple(w[i:i + k]) for k in range(1, n + 1) for i in range(len(w) - k + 1))
    refs = {i: [ngrams(tokenize_caption(r)) for r in references[i]] for i in references}
    assert all(refs.values()), "every id needs at least one reference"
    df = Counter(g for counts in refs.values() for g in set().union(*counts))
    log_num_images = math.log(len(refs))

    def features(counts):  # per order {ngram: tf * idf} and its L2 norm; idf = log(#images) - log(max(1, df))
        vec = [{} for _ in range(n)]
        for g, tf in counts.items():
            vec[len(g) - 1][g] = tf * (log_num_images - math.log(max(1.0, df.get(g, 0.0))))
        norm = [math.sqrt(sum(v * v for v in d.values())) for d in vec]
        return vec, norm, sum(tf for g, tf in counts.items() if len(g) == 1)

    scores = {}
    for i, cand in candidates.items():
        vec_c, norm_c, len_c = features(ngrams(tokenize_caption(cand)))
        per_order = [0.0] * n
        for r in refs[i]:  # per n-gram order the clipped cosine, times the Gaussian length penalty
            vec_r, norm_r, len_r = features(r)
            penalty = math.exp(-((len_c - len_r) ** 2) / (2 * sigma ** 2))
            for k, (vc, vr, nc, nr) in enumerate(zip(vec_c, vec_r, norm_c, norm_r)):
                val = sum(min(v, vr.get(g, 0.0)) * vr.get(g, 0.0) for g, v in vc.items())
                per_order[k] += val / (nc * nr) * penalty if nc and nr else 0.0  # at norm 0 the official val is 0
        scores[i] = 10.0 * sum(per_order) / n / len(refs[i])
    return sum(scores.values()) / len(scores), scores


def _yes_no(pred):
    # MME's official calculation.py: exact yes/no, else look for "yes" then "no" in the first 4 chars
    if pred in ("yes", "no"):
        return pred
    return "yes" if "yes" in pred[:4] else "no" if "no" in pred[:4] else "other"


_OPTION = re.compile(r"^\(?([a-z])(?![a-z0-9])")
_ANSWER_IS = re.compile(r"\banswer(?: is)?\s*:?\s*\(?([a-z])(?![a-z0-9])")


def option_letter(pred):
    """The option letter of a generation (lowercase), or None: its first character, optionally after "(", when that
    character is a letter not followed by a letter or digit ("B", "B.", "(b) cat", "B) cat"; "Bus" has none), else
    the letter after "answer" / "answer is" ("The answer is B", "Answer: (c)")."""
    pred = pred.strip().lower()
    m = _OPTION.match(pred) or _ANSWER_IS.search(pred)
    return m.group(1) if m else None


def multiple_choice_accuracy(predictions, answers):
    """Accuracy for MME (yes/no) and SEED-Bench style (option letter) questions, in [0, 1]. Both sides are stripped
    and lowercased; against a yes/no answer the prediction is parsed as MME's calculation.py does (_yes_no), against
    an option letter by option_letter, exact match (the generative variant of SEED-Bench; option_logliks ranks)."""
    assert len(predictions) == len(answers)
    correct = 0
    for pred, ans in zip(predictions, answers):
        pred, ans = pred.strip().lower(), ans.strip().lower()
        correct += (_yes_no(pred) if ans in ("yes", "no") else option_letter(pred)) == ans
    return correct / len(answers)


def mme_scores(items, predictions):
    """MME's metrics as the official eval_tool/calculation.py computes them, in percent. Per subtask: acc (questions
    answered right, the answer parsed by _yes_no; "other" is wrong), acc_plus (images whose questions are all right; MME
    asks two per image) and score = acc + acc_plus (0-200). perception and cognition: the sums of their subtasks' scores
    (the official totals, out of 2000 and 800 on the full benchmark). Beside them: accuracy over all questions and the
    mean of the subtasks' acc; Table 2's MME numbers (55.36-82.13) are percentages, not scores, so the paper appears to
    report such an accuracy (which of the two is not stated)."""
    right = [_yes_no(p.strip().lower()) == it.target.lower() for it, p in zip(items, predictions)]
    subtasks = {}  # {subtask: {image: [each of its questions answered right]}}
    for it, r in zip(items, right):
        subtasks.setdefault(it.category, {}).setdefault(it.image_path, []).append(r)
    out = {"subtasks": {}}
    for name, images in subtasks.items():
        rs = [r for questions in images.values() for r in questions]
        acc, acc_plus = 100 * sum(rs) / len(rs), 100 * sum(map(all, images.values())) / len(images)
        out["subtasks"][name] = {"acc": acc, "acc_plus": acc_plus, "score": acc + acc_plus}
    for total, names in (("perception", D.MME_PERCEPTION), ("cognition", D.MME_COGNITION)):
        out[total] = sum(v["score"] for k, v in out["subtasks"].items() if k in names)
    out["accuracy"] = 100 * sum(right) / len(right)
    out["mean_subtask_accuracy"] = statistics.mean(v["acc"] for v in out["subtasks"].values())
    return out


def seed_scores(items, predictions):
    """SEED-Bench accuracy in percent, per dimension and over all questions (as its official eval.py: the overall
    number counts questions, not dimensions). predictions are option letters or generations (option_letter)."""
    dims = {}
    for it, p in zip(items, predictions):
        dims.setdefault(it.category, []).append(option_letter(p) == it.target.lower())
    return {"dimensions": {k: 100 * sum(v) / len(v) for k, v in dims.items()},
            "accuracy": 100 * sum(sum(v) for v in dims.values()) / len(items)}


# -------------------------------- CHAIR (Rohrbach et al. 2018, "Object Hallucination in Image Captioning"; Table 5)

# The synonym list of Rohrbach et al. as published (data/synonyms.txt of github.com/LisaAnne/Hallucination, read by
# their utils/chair.py), shipped byte for byte as tests/data/chair-synonyms.txt (its sha256 checked on import): one
# COCO category a line, its instances_*2014.json name first, then the words a caption may use for it, in singular
# form (captions are singularised first), repetitions and stray spaces included.
CHAIR_SYNONYMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "data", "chair-synonyms.txt")
CHAIR_SYNONYMS_SHA256 = "b685537b36fe21b791c87151b96a991ceb582edff19f3da204dcc7a7905502f2"


def published_synonyms(path=CHAIR_SYNONYMS, sha256=CHAIR_SYNONYMS_SHA256):
    """The text of the published synonyms.txt; a ValueError if the file is not the published one."""
    with open(path, "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise ValueError(f"{path} is not the published CHAIR synonyms.txt (sha256 differs); "
                         "restore it with `git checkout tests/data`")
    return raw.decode()


def read_synonyms(text):
    """{category: "word, word, ..."} of a synonyms.txt (one category a line, its name first, ", " between words).
    Each word is stripped and lowercased, where chair.py keeps it as split: its " motor bike", " cheesecake" (a
    leading space) and "iPhone" (a capital, against lowercased captions) can never match there, and do here."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = [w.strip().lower() for w in line.split(", ")]
        if not all(words):
            raise ValueError(f"synonyms line {n}: expected `category, word, ...`, got {line!r}")
        out[words[0]] = ", ".join(dict.fromkeys(words))
    return out


COCO_SYNONYMS = read_synonyms(published_synonyms())
# Word pairs read as another word before matching, as chair.py's double_word_dict: an age qualifier or "passenger"
# before an animal or a vehicle is not a person ("baby elephant" -> elephant), a toilet seat is the toilet, not a
# chair, a bow tie a tie, and "train track" and "home plate" are no object (no train; "plate" is none anyway).
_ANIMALS = ("bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "animal", "cub")
_READ_AS = {f"{q} {a}": a for q in ("baby", "adult") for a in _ANIMALS} | \
    {"passenger jet": "jet", "passenger train": "train", "toilet seat": "toilet", "bow tie": "tie"} | \
    {"train track": "train track", "home plate": "home plate"}  # chair.py's: no train, no object at all
_IRREGULAR = {"taxis": "taxi", "scissors": "scissors", "tvs": "tv", "buffaloes": "buffalo", "flamingoes": "flamingo",
              "pocketknives": "pocketknife", "people": "people", "children": "child", "mice": "mouse",
              "knives": "knife", "geese": "goose", "oxen": "oxen", "calves": "calf", "feet": "foot", "teeth": "tooth",
              "wolves": "wolf", "leaves": "leaf", "shelves": "shelf", "loaves": "loaf", "halves": "half",
              "wives": "wife", "corgis": "corgi", "broccolis": "broccoli", "zebus": "zebu", "mouses": "mouse"}


def singularize(word):
    """The singular of an English noun, by rule (irregular forms, -men, -ies, -(s|x|z|ch|sh)es, -s); words ending in
    ss / us / is, and words of at most three letters, are kept (glass, bus, tennis, yes) unless _IRREGULAR names
    them (taxis -> taxi, as chair.py's singulariser reads it; tvs -> tv)."""
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if word.endswith("men") and word not in ("omen", "specimen"):
        return word[:-3] + "man"
    if len(word) <= 3 or word.endswith(("ss", "us", "is")):
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "uses", "xes", "zes", "ches", "shes")):
        return word[:-2]
    return word[:-1] if word.endswith("s") else word


# chair.py's quirks, which its published numbers (the paper's Table 5 among them) include, so counted by default
# (--chair; --chair corrected counts without them): pattern.en's singularize turns these caption words into
# non-words ("bus" -> "bu", so a singular bus is never counted; "ties" -> "ty", "canoes" -> "cano"), and three
# synonyms of synonyms.txt can never match as written there (CHAIR_PY_UNMATCHED; read_synonyms says why).
# pattern.en also keeps "doggies" as it is (no dog) and reads people, skis, oxen, tennis as person, ski, ox, "tenni"
# (so "tennis racket" is a racket); chair.py joins no "dining table" (a table) and keeps punctuation tokens, which
# part a pair ("hot, dog" is a dog).
CHAIR_PY_SINGULAR = {"bus": "bu", "minibus": "minibu", "airbus": "airbu", "ties": "ty", "canoes": "cano",
                     "doggies": "doggies", "people": "person", "skis": "ski", "oxen": "ox", "tennis": "tenni"}
CHAIR_PY_UNMATCHED = ("motor bike", "cheesecake", "iphone")
CHAIR_PY_UNJOINED = ("dining table",)
CHAIR_COUNTS = ("chair.py", "corrected")


def chair_vocabulary(categories):
    """{word or phrase: category} for the given categories (the instances file's), from COCO_SYNONYMS (a category
    missing from it is read by its own name)."""
    return {w: c for c in categories for w in (COCO_SYNONYMS.get(c) or c).split(", ")}


def caption_objects(caption, vocabulary, count="chair.py"):
    """The object mentions of a caption, in order, with repetition: [(word, category)], counted as chair.py counts.
    Tokenised as for CIDEr, each word singularised, then read left to right: two words that form a multi-word
    synonym or a _READ_AS phrase are taken as one word ("hot dog" is a hot dog, not a dog; "teddy bears" a teddy
    bear; "train tracks" no train), else the word alone. Only pairs are joined, as in chair.py, so "stove top oven"
    is two ovens (stove, oven). "seat" does not count when the caption mentions a toilet. count "chair.py" keeps
    chair.py's quirks (CHAIR_PY_SINGULAR, CHAIR_PY_UNMATCHED); "corrected" counts those words as what they are."""
    quirks = count == "chair.py"
    tokens = [t.lower() for t in _ptb_tokens(caption)] if quirks else tokenize_caption(caption)
    words = [CHAIR_PY_SINGULAR.get(w) if quirks and w in CHAIR_PY_SINGULAR else singularize(w) for w in tokens]
    out, i = [], 0
    while i < len(words):
        pair = " ".join(words[i:i + 2])
        joined = i + 1 < len(words) and (pair in vocabulary and not (quirks and pair in CHAIR_PY_UNJOINED)
                                         or pair in _READ_AS)
        out.append(_READ_AS.get(pair, pair) if joined else words[i])
        i += 2 if joined else 1
    if "toilet" in out:
        out = [w for w in out if w != "seat"]
    return [(w, vocabulary[w]) for w in out if w in vocabulary and not (quirks and w in CHAIR_PY_UNMATCHED)]


def chair(captions, annotated, references, vocabulary, count="chair.py"):
    """CHAIR_s, CHAIR_i (Rohrbach et al. 2018) and object Recall of generated captions, as fractions, and {id:
    hallucinated words}. captions: {id: generated caption}; annotated: {id: set of categories in the image's instance
    annotations}; references: {id: [reference captions]}. An image's ground-truth objects are its annotated categories
    plus the categories its references mention (caption_objects, by `count` as for the captions); a mention is
    hallucinated if its category is not among them.
        CHAIR_i = hallucinated mentions / all mentions       (mentions counted with repetition)
        CHAIR_s = captions with a hallucinated mention / captions
        Recall  = sum over images |mentioned categories & ground truth| / sum over images |ground truth|
    A ratio whose denominator is 0 (no mention; no ground-truth object) is reported as 0."""
    mentions = hallucinated = bad_captions = covered = truth_total = 0
    per_caption = {}
    for i, caption in captions.items():
        truth = set(annotated[i]) | {c for r in references[i] for _, c in caption_objects(r, vocabulary, count)}
        found = caption_objects(caption, vocabulary, count)
        per_caption[i] = [w for w, c in found if c not in truth]
        mentions, hallucinated = mentions + len(found), hallucinated + len(per_caption[i])
        bad_captions += bool(per_caption[i])
        covered, truth_total = covered + len({c for _, c in found} & truth), truth_total + len(truth)
    return {"chair_s": bad_captions / len(captions), "chair_i": hallucinated / mentions if mentions else 0.0,
            "recall": covered / truth_total if truth_total else 0.0}, per_caption


def chair_metrics(items, predictions, count="chair.py"):
    """Table 5 for caption items: CHAIR_s, CHAIR_i and Recall x 100, with the objects of the COCO instances files of
    the items' image folders (data.read_instances) and the items' reference captions. count "chair.py" (chair.py's
    count, quirks included) names them chair_s, chair_i, recall; "corrected" chair_s_corrected, ..."""
    annotated, categories = D.read_instances(items)
    vocabulary = chair_vocabulary(categories)
    result, _ = chair({it.id: p for it, p in zip(items, predictions)}, annotated,
                      {it.id: it.answers for it in items}, vocabulary, count)
    suffix = "" if count == "chair.py" else "_" + count
    return {k + suffix: 100 * v for k, v in result.items()}


# ------ training-free in-context vectors (Table 1): task vectors (Hendel et al. 2023), function vectors (Todd 2024)
#
# Both are computed once from ICL prompts [ICDs; query] of the training split, saved, and applied to the zero-shot
# prompt at the last prompt token of one decoder layer (steer), the layer of lowest target cross-entropy on queries
# held out of the training split (layer_losses; never the evaluation split).

VECTOR_SETS = 100  # N ICL prompts averaged (Todd et al.'s 100 prompts for the mean head outputs; the same N for TV)
FV_HEADS = 10      # k: heads summed into a function vector (Todd et al.: |A| = 10)
FV_TRIALS = 25     # corrupted prompts per head for the average indirect effect (Todd et al.: 25)


def vector_sets(pool, args, shots):
    """(queries, ICDs) of the N extraction prompts and the held-out queries that choose the layer: the training split
    shuffled with --seed, its first --vector-heldout items held out, the next N the extraction queries; their ICDs
    are drawn at random from the whole split (never the query itself)."""
    shuffled = random.Random(args.seed).sample(pool, len(pool))
    heldout, queries = shuffled[:args.vector_heldout], shuffled[args.vector_heldout:][:args.vector_sets]
    if len(queries) < args.vector_sets:
        raise ValueError(f"--vector-sets {args.vector_sets} + --vector-heldout {args.vector_heldout} exceed the "
                         f"{len(pool)} training items of {args.task}")
    return queries, D.demonstrations([q.id for q in queries], pool, shots, args.seed), heldout


def target_batches(backbone, kind, queries, icds, batch_size, workers=0):
    """Teacher-forced batches [ICDs; query + target] (icds None: zero-shot) and, per row, the last prompt token; made
    by `workers` DataLoader workers (data.prepared)."""
    icds = icds or [[] for _ in queries]
    specs = [(queries[i:i + batch_size], icds[i:i + batch_size]) for i in range(0, len(queries), batch_size)]
    build = functools.partial(forced_rows, backbone.processor, backbone.family, kind)
    return [(batch, (batch["labels"] != -100).int().argmax(1) - 1)
            for batch in D.prepared(build, specs, workers, backbone.model.device)]


def forced_rows(processor, family, kind, spec):
    """The teacher-forced batch of spec = (queries, their ICDs): data.teacher_batch of their pieces."""
    return D.teacher_batch(processor, family, kind, D.query_pieces(processor, family, kind, spec[0]), spec[1])


@torch.no_grad()
def icl_means(backbone, kind, queries, icds, batch_size, workers=0):
    """Means over the ICL prompts of each decoder layer's output at the last prompt token, [L, d] (the task vector
    of every layer, Hendel et al.), and of each head's output there, [L, H, d_h] (Todd et al.'s mean activations)."""
    model, states, heads = backbone.model, {}, {}
    specs = [(queries[i:i + batch_size], icds[i:i + batch_size]) for i in range(0, len(queries), batch_size)]
    batches = D.prepared(functools.partial(prompt_rows, backbone.processor, backbone.family, kind), specs, workers,
                         model.device)
    for batch in tqdm(batches, total=len(specs), desc="ICL means", unit="batch"):
        with layer_states_at(model, states), head_outputs(model, heads):
            model(**D.model_inputs(batch, model.device), logits_to_keep=1)
    mean = lambda store: torch.stack([torch.cat(store[l]).double().mean(0) for l in sorted(store)]).float().cpu()
    return mean(states), mean(heads)


def answer_probability(backbone, batch, positions):
    """Probability of each row's first answer token at its last prompt token: [B]."""
    device = backbone.model.device
    logits, labels = train.target_logits(backbone.model, train.to_device(batch, device))
    at = positions.to(device) - (batch["labels"].shape[1] - labels.shape[1])  # within the kept answer window
    rows = torch.arange(len(positions), device=device)
    return logits[rows, at].float().softmax(-1)[rows, labels[rows, at + 1]]


@torch.no_grad()
def indirect_effects(backbone, kind, queries, icds, mean_heads, batch_size, seed):
    """Average indirect effect of every head (Todd et al. 2024), [L, H]: on ICL prompts whose ICD labels are
    shuffled, the rise of the first answer token's probability when the head's output at the last prompt token is
    replaced by its mean over clean prompts (model.set_head_output), averaged over the prompts."""
    rng = random.Random(seed)  # the corrupted prompts: each ICD list with its targets shuffled among its ICDs
    shuffled = [[dataclasses.replace(d, target=t) for d, t in zip(ds, rng.sample([d.target for d in ds], len(ds)))]
                for ds in icds]
    batches = target_batches(backbone, kind, queries, shuffled, batch_size)
    base = [answer_probability(backbone, b, p) for b, p in batches]
    layers, heads, _ = M.attention_shape(backbone.model)
    aie = torch.zeros(layers, heads, dtype=torch.float64)
    bar = tqdm(total=layers * heads * len(batches), desc="indirect effects", unit="head x batch")
    for (batch, positions), p0 in zip(batches, base):
        batch = train.to_device(batch, backbone.model.device)  # once, not once per head
        for l, h in itertools.product(range(layers), range(heads)):
            with set_head_output(backbone.model, l, h, mean_heads[l, h], positions):
                aie[l, h] += (answer_probability(backbone, batch, positions) - p0).double().sum().item()
            bar.update()
    bar.close()
    return aie / len(queries)


def function_vector(model, mean_heads, aie, k):
    """Todd et al.'s FV: the sum over the k heads of largest average indirect effect of what each adds to the
    residual stream with its mean output (model.head_contribution). Returns ([d], the heads as [k, 2] (layer, head))."""
    top = aie.flatten().topk(k).indices
    heads = torch.stack([top // aie.shape[1], top % aie.shape[1]], 1)
    fv = sum(head_contribution(model, l, h, mean_heads[l, h]) for l, h in heads.tolist())
    return fv.float().cpu(), heads


@torch.no_grad()
def layer_losses(backbone, batches, vectors, add):
    """Per decoder layer l: the mean target cross-entropy of the held-out queries (zero-shot, teacher-forced) with
    vectors[l] put in at layer l and the last prompt token (replaced: TV; added: FV). The layer choice."""
    totals, count = [0.0] * len(vectors), 0
    for batch, positions in tqdm(batches, desc="layer choice", unit="batch"):
        batch = train.to_device(batch, backbone.model.device)  # once, not once per layer
        for l in range(len(vectors)):
            with steer(backbone.model, l, vectors[l], positions, add):
                logits, labels = train.target_logits(backbone.model, batch)
            totals[l] += train.supervised_loss(logits, labels).item() * len(positions)
        count += len(positions)
    return torch.tensor([total / count for total in totals])


def vector_path(backbone, args, shots):
    """Where a vector is saved, <out>/vectors/<model>-<task>-<tv|fv>-<key>.safetensors, and its key: the hash of
    everything it depends on."""
    spec = dict(backbone=train.fingerprint(backbone), task=args.task, method=args.vector, shots=shots,
                sets=args.vector_sets, heldout=args.vector_heldout, seed=args.seed, prompts=D.PROMPTS,
                images=train.image_key(backbone.processor),  # Idefics2's image splitting changes the prompts
                **({"heads": args.fv_heads, "trials": args.fv_trials} if args.vector == "fv" else {}))
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    name = f"{os.path.basename(args.model.rstrip('/'))}-{args.task}-{args.vector}-{key[:12]}.safetensors"
    return os.path.join(args.out, "vectors", name), key


def compute_vector(backbone, args, shots):
    """Extract a TV or FV from the training split and score every layer on the held-out queries. Returns tensors:
    "vectors" [L, d] (TV: the mean state of each layer; FV: the same FV for every layer), "losses" [L]; FV also
    "mean_heads" [L, H, d_h], "aie" [L, H], "heads" [k, 2]."""
    kind, pool = D.TASKS[args.task].kind, D.load_task(args.task, "train", args.data_root)
    queries, icds, heldout = vector_sets(pool, args, shots)
    states, mean_heads = icl_means(backbone, kind, queries, icds, args.batch_size, args.workers)
    out = {"vectors": states}
    if args.vector == "fv":
        out["aie"] = indirect_effects(backbone, kind, queries[:args.fv_trials], icds[:args.fv_trials], mean_heads,
                                      args.batch_size, args.seed).float()
        fv, out["heads"] = function_vector(backbone.model, mean_heads, out["aie"], args.fv_heads)
        out |= {"mean_heads": mean_heads, "vectors": fv.expand(len(states), -1).contiguous()}
    batches = target_batches(backbone, kind, heldout, None, args.batch_size, args.workers)
    out["losses"] = layer_losses(backbone, batches, out["vectors"], add=args.vector == "fv")
    return out


def load_vector(backbone, args):
    """The TV or FV for --vector, computed once (compute_vector) and saved, else read back. Returns the steering
    (layer, vector, add) evaluate() applies and the facts the metrics file records."""
    shots, fv = args.shots or D.default_shots(args.task, backbone.family), args.vector == "fv"
    layers, heads, _ = M.attention_shape(backbone.model)
    if args.vector_layer is not None and not 0 <= args.vector_layer < layers:
        raise ValueError(f"--vector-layer {args.vector_layer} is out of range: {backbone.name} has decoder layers "
                         f"0..{layers - 1}")
    if fv and not 0 < args.fv_heads <= layers * heads:
        raise ValueError(f"--fv-heads {args.fv_heads} is out of range: {backbone.name} has {layers * heads} heads")
    path, key = vector_path(backbone, args, shots)
    D.remove_stale_tmp(os.path.dirname(path))
    # what the file holds ({name: (shape, dtype)}, None: any), as compute_vector returns it
    shapes = {"vectors": ((layers, backbone.model.config.get_text_config().hidden_size), None),
              "losses": ((layers,), None)}
    if fv:
        shapes |= {"mean_heads": ((layers, heads, None), None), "aie": ((layers, heads), None),
                   "heads": ((args.fv_heads, 2), None)}
    saved = D.read_cache(path, key, shapes)
    if saved is not None:
        print(f"{args.vector}: read {path}")
    else:
        saved = compute_vector(backbone, args, shots)
        D.write_cache(path, saved, key)
        print(f"{args.vector}: computed and saved to {path}")
    layer = args.vector_layer if args.vector_layer is not None else int(saved["losses"].argmin())
    info = {"vector": args.vector, "vector_layer": layer, "vector_file": path, "vector_shots": shots,
            "vector_sets": args.vector_sets, "layer_losses": saved["losses"].tolist(),
            **({"fv_heads": saved["heads"].tolist()} if fv else {})}
    return {"layer": layer, "vector": saved["vectors"][layer], "add": fv, "decoding": fv}, info


def _rows_at(h, positions):
    """(row index, position index) selecting position positions[b] of each row b (the last one when None)."""
    rows = torch.arange(h.shape[0], device=h.device)
    return rows, torch.full_like(rows, h.shape[1] - 1) if positions is None else positions.to(h.device)


@contextlib.contextmanager
def steer(model, layer, vector, positions=None, add=False, decoding=False):
    """Patch the output hidden state of decoder layer `layer` (0-based) at one position per row (positions: [B], or None
    for each row's last token, the last prompt token of a left-padded prompt): replace it by `vector` ([d], or [B, d]
    one per row: task vector, Hendel et al. 2023) or add `vector` to it (function vector, Todd et al. 2024). Forward
    passes over the prompt are patched, and cached decoding steps too if `decoding` (Todd et al. add the FV at every
    generated token; a task vector patches the prompt alone, which later tokens see through the KV cache)."""
    def hook(module, inputs, output):
        h = output[0] if isinstance(output, tuple) else output
        if h.shape[1] == 1 and not decoding:
            return None
        rows, cols = _rows_at(h, positions)
        h = h.clone()
        h[rows, cols] = vector.to(h.device, h.dtype) + (h[rows, cols] if add else 0)
        return (h, *output[1:]) if isinstance(output, tuple) else h
    with M.hooked(model.get_decoder().layers[layer].register_forward_hook(hook)):
        yield


def _recorder(store, layer, positions, shape=(-1,)):
    """A forward hook (a pre-hook: of the input) appending the rows at positions (_rows_at), viewed as [B, *shape],
    to store[layer] on forward passes over the prompt."""
    def hook(module, inputs, output=None):
        h = inputs[0] if output is None else output[0] if isinstance(output, tuple) else output
        if h.shape[1] > 1:
            store.setdefault(layer, []).append(h[_rows_at(h, positions)].view(h.shape[0], *shape).detach())
    return hook


@contextlib.contextmanager
def layer_states_at(model, store, positions=None):
    """Record each decoder layer's output hidden state at one position per row (None: the last): store[l] gets a
    [B, d] tensor per forward pass over the prompt (the states a task vector is made of)."""
    layers = model.get_decoder().layers
    with M.hooked(*(m.register_forward_hook(_recorder(store, l, positions)) for l, m in enumerate(layers))):
        yield store


@contextlib.contextmanager
def head_outputs(model, store, positions=None):
    """Record, per decoder layer, every head's output (the input of the output projection o_proj, head-major) at one
    position per row (None: the last): store[l] gets a [B, H, d_h] tensor per forward pass over the prompt."""
    shape, attns = M.attention_shape(model)[1:], M.decoder_self_attentions(model)
    with M.hooked(*(a.o_proj.register_forward_pre_hook(_recorder(store, l, positions, shape))
                    for l, a in enumerate(attns))):
        yield store


@contextlib.contextmanager
def set_head_output(model, layer, head, value, positions=None):
    """Replace head `head`'s output at decoder layer `layer` (its slice of o_proj's input) by `value` [d_h] at one
    position per row (None: the last), on forward passes over the prompt: Todd et al.'s activation patching."""
    _, _, head_dim = M.attention_shape(model)

    def hook(module, inputs):
        x = inputs[0]
        if x.shape[1] == 1:
            return None
        rows, cols = _rows_at(x, positions)
        x = x.clone()
        x[rows, cols, head * head_dim:(head + 1) * head_dim] = value.to(x.device, x.dtype)
        return (x, *inputs[1:])
    with M.hooked(M.decoder_self_attentions(model)[layer].o_proj.register_forward_pre_hook(hook)):
        yield


def head_contribution(model, layer, head, value):
    """What head `head` of layer `layer` adds to the residual stream when it outputs `value` [..., d_h]: its
    columns of o_proj's weight times value (no bias: that belongs to no head). Returns [..., d]."""
    _, _, head_dim = M.attention_shape(model)
    w = M.decoder_self_attentions(model)[layer].o_proj.weight[:, head * head_dim:(head + 1) * head_dim]
    return value.to(w.device, w.dtype) @ w.T


# ------------------------- efficiency (Table 6): FLOPs and latency of one query, zero-shot vs adapter vs n-shot ICL

ROUNDS = 10  # latency: rounds of timed runs; the FLOP count (Table 6) or the peak-memory run (attention) warms up
BENCH_SHOTS = (8, 16, 32)
# Synthetic prompts (--random-weights): text tokens per piece, estimated from the toy prompts of data.PROMPTS as a
# LLaMA-style tokenizer splits them: BOS + the instruction line; one ICD's "Question: ... Short answer: ..." + end
# token + newline (about 20 for a VQAv2 question); the query's question without the answer.
PREFIX_TEXT, ICD_TEXT, QUERY_TEXT = 14, 20, 16
MID_QUERY_TEXT = 512  # --random-weights mid: a long query, so that attention's share of the cost shows on a CPU


def synthetic_prompt(model, family, shots, seed=0, query_text=QUERY_TEXT):
    """One query with `shots` ICDs (the query with `query_text` text tokens) in the family's real input format, with
    random text ids and pixels (Table 6). Per image, as the family's processor expands it: Idefics2
    <fake_token_around_image>, 64 <image> (perceiver latents), <fake_token_around_image>, pixels at COCO's typical
    480 x 640 (which its processor keeps as is); Idefics one <image> between two wrappers, cross-attending to its
    224 x 224 image; LLaVA-Interleave one token per SigLIP patch (729 at 384 x 384); LLaVA-OneVision its base
    384 x 384 view and a newline (730), the multi-image mode of data.onevision_piece. Sizes come from the model's
    config, so tiny twins get the same format."""
    cfg, n, gen = model.config, shots + 1, torch.Generator().manual_seed(seed)
    vocab = cfg.get_text_config().vocab_size
    image_id = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", vocab)

    def text(k):  # random ids, never the image token
        t = torch.randint(vocab - 1, (k,), generator=gen)
        return t + (t >= image_id).long()

    side = cfg.vision_config.image_size
    if family == "idefics2":
        image = lambda: torch.cat([text(1), torch.full((cfg.perceiver_config.resampler_n_latents,), image_id), text(1)])
        h, w = min(480, side), min(640, side)
        pixels = {"pixel_values": torch.randn(1, n, 3, h, w), "pixel_attention_mask": torch.ones(1, n, h, w).bool()}
    elif family == "idefics":
        image = lambda: text(3)
        pixels = {"pixel_values": torch.randn(1, n, 3, side, side)}
    else:
        p = side // cfg.vision_config.patch_size
        count = p * p if family == "llava-interleave" else p * p + 1  # OneVision: base view + newline (onevision_piece)
        image = lambda: torch.full((count,), image_id)
        pixels = {"pixel_values": torch.randn(n, 3, side, side)} if family == "llava-interleave" else \
            {"pixel_values": torch.randn(n, 1, 3, side, side), "image_sizes": torch.tensor([[side, side]] * n),
             "batch_num_images": torch.tensor([max(n, 2)])}  # one sample of several images, as data.image_inputs
    pieces = [text(PREFIX_TEXT)] + [torch.cat([image(), text(ICD_TEXT if i < shots else query_text)]) for i in range(n)]
    ids = torch.cat(pieces)[None]
    if family == "idefics":  # which image each token cross-attends to: the latest one before it
        owner = torch.cat([torch.full_like(p, i - 1) for i, p in enumerate(pieces)])
        pixels["image_attention_mask"] = torch.nn.functional.one_hot(owner + 1, n + 1)[None, :, 1:]
    pixels = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in pixels.items()}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels}


def benchmark_prompt(backbone, args, shots):
    """The Table 6 input with `shots` ICDs: synthetic (--random-weights), else the first --split item of --task."""
    if backbone.processor is None:
        query_text = MID_QUERY_TEXT if args.random_weights == "mid" else QUERY_TEXT
        batch = synthetic_prompt(backbone.model, backbone.family, shots, args.seed, query_text)
    else:
        query = D.load_task(args.task, args.split, args.data_root)[:1]
        icds = D.demonstrations([query[0].id], D.load_task(args.task, "train", args.data_root), shots, args.seed) \
            if shots else None
        batch = D.prompt_batch(backbone.processor, backbone.family, D.TASKS[args.task].kind, query, icds)
    return D.model_inputs(batch, backbone.model.device)


def keep_freed_memory():
    """CPU benchmarks: glibc's malloc keeps freed blocks (up to 32 MiB each) for reuse, so that a run does not
    page-fault its activations in again (docs/efficiency.md: 8% of a mid-size prefill's time). A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 * 2 ** 20)   # M_MMAP_THRESHOLD: blocks up to 32 MiB come from the heap, not from mmap
    libc.mallopt(-1, 2 ** 31 - 1)    # M_TRIM_THRESHOLD: the heap's free top is never given back


def paired_latency(runs, device):
    """Latency of every runs[name] relative to the first (the reference: zero-shot, plain SDPA) on a machine whose
    speed drifts. run(timer) runs one call under its setting, timed by timer(f) (seconds; the GPU synchronised).
    Each of ROUNDS rounds times the reference before and after every other setting, so each run has reference runs
    on both sides; its ratio is its time over their mean. Returns {name: (ms, ratio, q1, q3)}: the median time, and
    the median and quartiles over rounds of the ratio (the reference's are 1). Why paired, not torch.utils.benchmark:
    docs/efficiency.md, "How latency is measured"."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None

    def timer(f):
        sync()
        start = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - start

    (reference, *others), times = list(runs), {name: [] for name in runs}
    ratios = {name: [1.0] if name == reference else [] for name in runs}
    with tqdm(total=ROUNDS * (2 * len(others) + 1), desc="latency", unit="run") as bar:
        for _ in range(ROUNDS):
            times[reference].append(runs[reference](timer))
            for name in others:
                times[name].append(runs[name](timer))
                times[reference].append(runs[reference](timer))
                ratios[name].append(times[name][-1] / statistics.mean(times[reference][-2:]))
                bar.update(2)
            bar.update()
    quantiles = lambda r: torch.tensor(r, dtype=torch.float64).quantile(torch.tensor([.5, .25, .75]).double()).tolist()
    return {name: (1000 * statistics.median(times[name]), *quantiles(r)) for name, r in ratios.items()}


@contextlib.contextmanager
def run_as(model, method):
    """The model as one Table 6 row runs it. method None: the backbone (zero-shot, n-shot ICL); "loaded": the adapter
    of --checkpoint; else a fresh `method` adapter of model.METHODS (its default sizes) attached through model.attach
    with every parameter drawn at random, so that no zero-initialised factor hides a cost, and detached after."""
    if method is None:
        with M.without_adapter(model):
            yield
    elif method == "loaded":
        yield
    else:
        with torch.no_grad():
            for p in M.attach(model, method).parameters():
                p.normal_(0, 0.02)
        try:
            yield
        finally:
            M.detach(model)


def flops(backbone, inputs, new_tokens):
    """FLOPs of one generate call of exactly new_tokens tokens (torch.utils.flop_counter); also a warm-up."""
    with FlopCounterMode(display=False) as counter:
        generate(backbone, inputs, new_tokens, min_new_tokens=new_tokens)
    return counter.get_total_flops()


def benchmark(backbone, args):
    """Table 6: per query, FLOPs and latency (paired_latency) of the prefill (one new token) and of generating
    --new-tokens tokens for zero-shot, each adapter (the --checkpoint's, else every method of model.METHODS) and
    --bench-shots-shot ICL, each with its ratio to zero-shot; for zero-shot and each adapter also the peak memory of one
    decoder attention layer at --attention-tokens tokens (attention_call). Writes benchmark.json."""
    new_tokens = args.new_tokens or (8 if args.random_weights == "mid" else D.TASKS[args.task].max_new_tokens)
    loaded = getattr(backbone.model, "icl_settings", {}).get("method")
    methods = [(loaded, "loaded")] if loaded else [(m, m) for m in M.METHODS]
    settings = [("zero-shot", None, 0)] + [(name, m, 0) for name, m in methods] + \
        [(f"{s}-shot", None, s) for s in args.bench_shots]
    path = os.path.join(args.out, "benchmark.json")
    check_replaceable(path, {"model": backbone.name})  # the latest measurement of this backbone
    device, (attention, _, _) = backbone.model.device, attention_call(backbone.model, args.attention_tokens)
    rows, runs = [], {"prefill": {}, "generate": {}}
    for name, method, shots in tqdm(settings, desc="FLOPs, memory", unit="setting"):
        inputs = benchmark_prompt(backbone, args, shots)
        with run_as(backbone.model, method):
            rows.append({"setting": name, "prompt_tokens": inputs["input_ids"].shape[1],
                         "prefill_tflops": flops(backbone, inputs, 1) / 1e12,
                         "tflops": flops(backbone, inputs, new_tokens) / 1e12,
                         "attention_mib": None if shots else peak_memory_mb(attention, device)})
        for part, k in (("prefill", 1), ("generate", new_tokens)):
            runs[part][name] = lambda timer, m=method, i=inputs, k=k: run_as(backbone.model, m)(
                lambda: timer(lambda: generate(backbone, i, k, min_new_tokens=k)))()
    for part, key in (("prefill", "prefill_ms"), ("generate", "ms")):
        for r, (ms, ratio, q1, q3) in zip(rows, paired_latency(runs[part], device).values()):
            r[key], r[key + "_ratio"], r[key + "_quartiles"] = ms, ratio, [q1, q3]
    for r in rows:
        for key in ("prefill_tflops", "tflops", "attention_mib"):
            r[key + "_ratio"] = r[key] / rows[0][key] if r[key] is not None else None
    print(f"{backbone.name} on {device}, {torch.get_num_threads()} threads; prefill (1 new token) and {new_tokens} new "
          f"tokens per query; latency: median ms, and the median [quartiles] over {ROUNDS} rounds of the time over "
          f"zero-shot runs on both sides; attention: peak memory of one decoder attention layer at "
          f"{args.attention_tokens} tokens")
    print(f"{'setting':<17} {'tokens':>6} | prefill {'TFLOPs':>8} {'x':>6} {'ms':>8} {'x [quartiles]':>19} | "
          f"generate {'TFLOPs':>8} {'x':>6} {'ms':>8} {'x [quartiles]':>19} | attention {'MiB':>7} {'x':>5}")
    part = lambda r, tflops, ms: f"{r[tflops]:>8.4g} {r[tflops + '_ratio']:>6.3f} {r[ms]:>8.1f} " \
        f"{r[ms + '_ratio']:>6.3f} [{r[ms + '_quartiles'][0]:.3f}, {r[ms + '_quartiles'][1]:.3f}]"
    for r in rows:
        memory = f"{r['attention_mib']:>7.1f} {r['attention_mib_ratio']:>5.2f}" if r["attention_mib"] is not None \
            else f"{'-':>7} {'-':>5}"
        print(f"{r['setting']:<17} {r['prompt_tokens']:>6} | {'':7} {part(r, 'prefill_tflops', 'prefill_ms')} | "
              f"{'':8} {part(r, 'tflops', 'ms')} | {'':9} {memory}")
    D.write_json(path, {"model": backbone.name, "device": str(device), "threads": torch.get_num_threads(),
                        "new_tokens": new_tokens, "attention_tokens": args.attention_tokens, "rows": rows}, indent=2)
    print(f"-> {path}")
    return rows


def peak_memory_mb(run, device="cpu"):
    """Peak of the memory run() allocates beyond what is live before it, in MiB. CPU: from torch.profiler's allocation
    records (profile_memory: every allocation and free of torch's CPU allocator, in time order), summed up in order;
    CUDA: torch.cuda.max_memory_allocated."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    return max(itertools.accumulate((nbytes for _, nbytes in records), initial=0)) / 2 ** 20


def attention_call(model, T):
    """One decoder self-attention of `model` (its first layer's module and head sizes) on random q [1, H, T, d_h] and
    k, v [1, H_kv, T, d_h], causal: (forward, reference, sizes), closures running model.calibrated_attention (the
    module's adapter, or the stock SDPA forward without one) and the adapter's T x S reference, both without autograd
    (the adapter's parameters would otherwise keep its activations), and the sizes in words."""
    attn = M.decoder_self_attentions(model)[0]
    device, dtype = model.device, model.dtype
    _, heads, head_dim = M.attention_shape(model)
    kv_heads = getattr(attn.config, "num_key_value_heads", None) or heads
    q = torch.randn(1, heads, T, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, T, head_dim, device=device, dtype=dtype) for _ in range(2))
    return (torch.no_grad()(lambda: M.calibrated_attention(attn, q, k, v, None, scaling=attn.scaling)),
            torch.no_grad()(lambda: attn.icl_adapter.reference(q, k, v, None, attn.scaling)),
            f"{heads} heads ({kv_heads} key/value) x {head_dim}")


def attention_benchmark(model, T=2048):
    """One decoder self-attention of `model` at T query and key tokens (attention_call), batch 1: latency
    (paired_latency) and peak memory (peak_memory_mb) of the stock SDPA forward, of every method of model.METHODS
    through model.attach, and of Hyper-ICL's T x T reference; each relative to SDPA. Returns {name: (ms, MiB)}."""
    device, dtype = model.device, model.dtype
    forward, reference, sizes = attention_call(model, T)
    paths = [("sdpa", None, forward)] + [(m, m, forward) for m in M.METHODS] + \
        ([("hyper-icl reference", "hyper-icl", reference)] if "hyper-icl" in M.METHODS else [])
    runs, memory = {}, {}
    for name, method, run in paths:  # attention_call's closures run without autograd
        with run_as(model, method):
            memory[name] = peak_memory_mb(run, device)
        runs[name] = lambda timer, m=method, run=run: run_as(model, m)(lambda: timer(run))()  # in its setting
    latency = paired_latency(runs, device)
    print(f"one attention layer: {sizes}, T = {T}, {dtype} on {device}, {torch.get_num_threads()} threads; latency: "
          f"median ms, and the median [quartiles] over {ROUNDS} rounds of the time over SDPA runs on both sides; "
          "peak memory: " + ("torch.cuda.max_memory_allocated" if torch.device(device).type == "cuda" else
                             "torch.profiler's allocation records"))
    for name, (ms, ratio, q1, q3) in latency.items():
        print(f"{name:<20} {ms:>9.2f} ms {ratio:>6.2f}x [{q1:.2f}, {q3:.2f}] {memory[name]:>10.1f} MiB "
              f"{memory[name] / memory['sdpa']:>6.2f}x")
    return {name: (latency[name][0], memory[name]) for name in latency}


def attention_model(args):
    """The model whose first attention layer --benchmark-attention measures: --model, or with --random-weights the
    mid-size model or a one-layer model with the published attention sizes (model.grown_twin)."""
    family = M.family_of(args.model)
    if args.random_weights == "mid":
        return M.mid_model(family)[0]
    if args.random_weights == "published":
        text = M.PUBLISHED[family]().get_text_config()
        sizes = {k: getattr(text, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
                 if getattr(text, k, None)}
        return M.grown_twin(family, num_hidden_layers=1, intermediate_size=64, **sizes)[0]
    return M.load_backbone(args.model).model


# ----------- analyses: the query-adaptive gate (Appendix D, Table 10) and delta-hyperbolicity (Appendix C, Table 9)

def analysis_batches(backbone, args, items):
    """(teacher, student) prompt batches per --batch-size items: [ICDs; query] and [query], as model inputs, with
    each row's number of query tokens (the last positions of both rows, since both are left-padded)."""
    shots = args.shots or D.default_shots(args.task, backbone.family)
    support = D.load_task(args.task, "train", args.data_root)
    kind, device = D.TASKS[args.task].kind, backbone.model.device
    groups = [items[i:i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    specs = [(qs, D.demonstrations([q.id for q in qs], support, shots, args.seed)) for qs in groups]
    build = functools.partial(paired_prompts, backbone.processor, backbone.family, kind)
    for teacher, student in tqdm(D.prepared(build, specs, args.workers, device), total=len(specs),
                                 desc=f"{backbone.name} {args.task}", unit="batch"):
        inputs = lambda b: {**D.model_inputs(b, device), "logits_to_keep": 1}  # hidden states only: no vocabulary
        yield (inputs(teacher), inputs(student)), student["query_target"].sum(1).tolist()


def paired_prompts(processor, family, kind, spec):
    """(teacher, student) prompt batches of spec = (queries, their ICDs): with the ICDs and without."""
    return tuple(D.prompt_batch(processor, family, kind, spec[0], d) for d in (spec[1], None))


def aligned_shift(A_icd, A_plain, n_icd, n_plain, T):
    """Eq 19 for one example: Delta A = || A^ICD - A^noICD ||_1 per layer, head and query token, [L, H, T].
    A_icd: [L, H, T, S_icd], A_plain: [L, H, T, S_plain], query-token rows of left-padded rows with n_icd / n_plain
    real tokens. Keys are aligned as the rows are built: the shared start (BOS + instruction) first, the query last;
    the ICD keys have no counterpart, so A^noICD is zero there."""
    start = n_plain - T  # BOS + instruction
    aligned = torch.zeros_like(A_icd)
    first_icd, first_plain = A_icd.shape[-1] - n_icd, A_plain.shape[-1] - n_plain
    aligned[..., first_icd:first_icd + start] = A_plain[..., first_plain:first_plain + start]
    aligned[..., -T:] = A_plain[..., -T:]
    return (A_icd - aligned).abs().sum(-1)


@torch.no_grad()
def gate_analysis(backbone, args, items):
    """Table 10: mean gate g per layer (over heads and query tokens), early-layer (first quarter) and late-layer
    (last quarter) means, average per-layer std, and Pearson Corr(g, Delta A) (Eq 19) over layers, heads, query
    tokens and examples. g is the adapter's (Eq 9) on the query-only prompt; Delta A compares the teacher's
    attention ([ICDs; query], no adapter) with the query-only prompt's (no adapter)."""
    model, gates = backbone.model, []
    if model.icl_settings["method"] != "hyper-icl":
        raise ValueError(f"the gate analysis needs a Hyper-ICL adapter, not {model.icl_settings['method']!r}")
    hooks = [a.register_forward_pre_hook(lambda mod, inp: gates.append(mod.gate(inp[0])[..., 0]))
             for a in M.adapter_modules(model)]
    g_all, dA_all = [], []
    with M.hooked(*hooks):
        for (teacher, student), lengths in analysis_batches(backbone, args, items):
            gates.clear()
            model(**student)
            g = torch.stack(gates)                                            # [L, B, H, S_student]
            with M.attention_as(model, "eager"):
                A_icd = model(**teacher, output_attentions=True).attentions   # L x [B, H, S, S]
                A_plain = model(**student, output_attentions=True).attentions
            for b, T in enumerate(lengths):
                rows = lambda A: torch.stack([a[b, :, -T:].float() for a in A])  # [L, H, T, S]
                dA = aligned_shift(rows(A_icd), rows(A_plain), int(teacher["attention_mask"][b].sum()),
                                   int(student["attention_mask"][b].sum()), T)
                g_all.append(g[:, b, :, -T:].flatten(1).float().cpu())
                dA_all.append(dA.flatten(1).cpu())
    g, dA = torch.cat(g_all, 1), torch.cat(dA_all, 1)                         # [L, all heads x tokens]
    quarter, per_layer = max(1, g.shape[0] // 4), g.mean(1)
    return {"per_layer_mean": per_layer.tolist(), "early_mean": per_layer[:quarter].mean().item(),
            "late_mean": per_layer[-quarter:].mean().item(), "per_layer_std": g.std(1).mean().item(),
            "corr_g_delta_attention": torch.corrcoef(torch.stack([g.flatten(), dA.flatten()]))[0, 1].item(),
            "n": len(items)}


def middle_layers(n_layers, k=4):
    """The k middle decoder layers (0-based; all of them when there are fewer)."""
    first = max(0, n_layers // 2 - k // 2)
    return range(first, min(n_layers, first + k))


def query_states(hidden_states, b, T, layers):
    """The metric space of Appendix C for row b: query-token states of the given layers, one point per
    (layer, token): [len(layers) * T, d] in float32."""
    return torch.cat([hidden_states[l + 1][b, -T:] for l in layers]).float()


@torch.no_grad()
def hyperbolicity_analysis(backbone, args, items, n_samples=1000):
    """Table 9: relative delta-hyperbolicity (Eq 18) of the teacher's ([ICDs; query], no adapter) and the student's
    (query only, with the adapter if one is attached) query-token hidden states in the four middle decoder layers,
    per example on n_samples quadruples drawn with the same seed for teacher and student; mean and std over examples."""
    model = backbone.model
    layers = middle_layers(len(M.decoder_self_attentions(model)))
    deltas, i = {"teacher": [], "student": []}, 0
    for (teacher, student), lengths in analysis_batches(backbone, args, items):
        with M.without_adapter(model):
            h_teacher = model(**teacher, output_hidden_states=True).hidden_states
        h_student = model(**student, output_hidden_states=True).hidden_states
        for b, T in enumerate(lengths):
            for name, h in (("teacher", h_teacher), ("student", h_student)):
                X = query_states(h, b, T, layers)
                gen = torch.Generator(X.device).manual_seed(args.seed + i)
                deltas[name].append(lorentz.delta_hyperbolicity(torch.cdist(X, X), n_samples, gen).item())
            i += 1
    return {name: {"mean": statistics.mean(d), "std": statistics.pstdev(d)} for name, d in deltas.items()} | \
        {"layers": list(layers), "n": len(items)}


# --------------------------- learning curves (Table 1, Table 4, Fig 2-3 on the toy world): every method, with seeds
#
# The paper's comparisons (Table 1's ordering, Table 4, Fig 2) ask which method is better at a given budget. One run
# per point cannot say (on the toy world a run either flips the task or not), hence seeds, intervals and two graded
# measures (`curve`, `answer_measures`); rates are tuned by the rule of `tune` (below), never on evaluation items.

CURVE_QUERIES = (4, 8, 16, 32)  # training queries per run: the x axis (Fig 2: training sample size)
CURVE_SEEDS = 3                  # train.py --seed of each point's runs: query draw, demonstrations, order, init
CURVE_TRAIN_ARGS = "--epochs 16 --n-heldout 8"  # 16 passes: N queries take 4 N steps at batch size 4
ICL_LEVELS = (0, 1, 2, 4, 8)     # n-shot ICL, the horizontal lines of the figure (Fig 2's x axis)
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


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
        pieces = D.query_pieces(backbone.processor, backbone.family, kind, items[i:i + batch_size])
        batch = train.to_device(D.student_batch(backbone.processor, backbone.family, kind, pieces), device)
        logits, labels = train.target_logits(backbone.model, batch)
        log_p = F.log_softmax(logits.float(), -1)                                          # [B, K, V]
        answer = train.answer_positions(labels)                                            # [B, K]: predicts a target
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
# out of the *training* split (train.split_pool: never trained on in that run, never an evaluation image), at
# TUNE["n_train"] training queries and a seed no curve run uses. Hyper-ICL's variants (Table 4, lambda, kappa) train
# at Hyper-ICL's rate. Published rates: the papers' 5e-3 (Hyper-ICL, HiFICL, and so the gate ablations of Hyper-ICL);
# LoRA 5e-4 and MimIC 1e-5 (MimIC's public configs, peft/lora.yaml and peft/mimic.yaml); LIVE 1e-3 (its VQAv2 runs).
# Their cross-entropy weights (LIVE's hard_loss_weight, MimIC's ce_loss_weight) are 0.5, the paper's lambda.
PUBLISHED_LR = {"hyper-icl": 5e-3, "hificl": 5e-3, "static-layer": 5e-3, "static-layer-head": 5e-3,
                "output-level": 5e-3, "mimic": 1e-5, "live": 1e-3, "lora": 5e-4}
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


def tune(args, common, methods):
    """Each method's {"lr", "lam"} by the rule above; also every tuning run's score (tune.json)."""
    runs, chosen = [], {}
    for method in methods:
        def score(lr, lam=None):
            out = os.path.join(args.out, "tune", method, f"lr{lr:g}" + ("" if lam is None else f"-lam{lam:g}"))
            train.main(common + shlex.split(args.train_args) + tune_flags(lr, lam) + [
                "--method", method, "--out", out, "--overwrite", "--teacher-cache", os.path.join(args.out, "teacher")])
            with open(os.path.join(out, "history.json")) as f:
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
            lams = {lam: scores[best()] if lam == train.PAPER["lam"] else score(chosen[method]["lr"], lam)
                    for lam in TUNE_LAMBDAS[method]}
            chosen[method]["lam"] = min(lams, key=lams.get)
    D.write_json(os.path.join(args.out, "tune.json"), {"chosen": chosen, "runs": runs, "rule": TUNE}, indent=2)
    return chosen, runs


def row_flags(flags, chosen):
    """A row's train.py flags with its method's tuned rate (and lambda) first, so the row's own flags override."""
    tuned = chosen.get(method_of(flags))
    return flags if tuned is None else rate_flags(**tuned) + flags


def curve_runs(names=None):
    """The rows of --curve: every method of model.METHODS, Hyper-ICL's anchor ablations (Table 4), lambda and kappa
    beside the paper's 0.5 and 0.1 (Fig 3b), and the anchor divided by its first-step value; only `names`, if given."""
    rows = [(m, ["--method", m]) for m in M.METHODS] + [("hyper-icl, euclidean anchor", ["--anchor", "euclidean"]),
            ("hyper-icl, CE only", ["--anchor", "none"]), ("hyper-icl, anchor only", ["--lam", "0"])]   # Table 4
    rows += [(f"hyper-icl, lambda {lam}", ["--lam", lam]) for lam in ("5", "50")]           # Fig 3b: lambda
    rows += [(f"hyper-icl, kappa {kappa}", ["--kappa", kappa]) for kappa in ("0.01", "1")]  # Fig 3b: kappa
    rows += [("hyper-icl, anchor / first step", ["--anchor-norm", "first"])]              # not in the paper
    return [r for r in rows if names is None or r[0] in names]


def curve(args):
    """--curve: tune each method's rate (`tune`; --no-tune: the published ones), then train every row of curve_runs on
    each of --curve-queries training queries with --curve-seeds seeds, score each run on the same evaluation items
    (accuracy, answer log-probability, KL from the 8-shot teacher) and write <out>/curve.md (mean [95% interval] per row
    and budget), curve.json (every run), curve.png and tune.json. One thread on CPU unless --threads (main): on a
    shared machine that was about 10x faster than two, and deterministic."""
    settings = curve_settings(args)
    check_replaceable(os.path.join(args.out, "curve.json"), settings)  # before hours of training
    items, backbone = eval_items(args), M.load_backbone(args.model)
    kind, shots = D.TASKS[args.task].kind, D.default_shots(args.task, backbone.family)
    # the teacher: the backbone's answer logits with `shots` random ICDs from the training split (seed 0), per item
    icds = D.demonstrations([it.id for it in items], D.load_task(args.task, "train", args.data_root), shots, 0)
    pieces, teacher = D.query_pieces(backbone.processor, backbone.family, kind, items), []
    for i in tqdm(range(0, len(items), args.batch_size), desc=f"{shots}-shot teacher", unit="batch"):
        s = slice(i, i + args.batch_size)
        teacher += [t.cpu() for t in train.run_teacher(backbone, kind, items[s], icds[s], pieces[s],
                                                       backbone.model.device, output="logits")]
    common = ["--model", args.model, "--task", args.task] + (["--data-root", args.data_root] if args.data_root else [])
    scoring = common + ["--split", args.split, "--batch-size", str(args.batch_size), "--seed", "0"] + \
        (["--n-eval", str(args.n_eval)] if args.n_eval else [])
    scored = lambda flags, setting: evaluate(backbone, parse_args(scoring + flags), items, setting)  # as main runs it
    levels = {f"{n}-shot ICL": scored(["--shots", str(n), "--out", os.path.join(args.out, "icl")], f"{n}-shot")
              for n in sorted({*ICL_LEVELS, shots})}
    levels = {k: {"accuracy": m[headline_metric(m)]} for k, m in levels.items()}
    levels["0-shot ICL"] |= answer_measures(backbone, kind, items, teacher, args.batch_size)
    rows = curve_runs(args.curve_methods)
    methods = list(dict.fromkeys(method_of(flags) for _, flags in rows))
    chosen = {} if args.no_tune else tune(args, common, methods)[0]
    runs, plan = [], list(itertools.product(rows, args.curve_queries, range(args.curve_seeds)))
    for (name, flags), n, seed in tqdm(plan, desc="learning curves", unit="run"):
        out = os.path.join(args.out, re.sub(r"[^a-z0-9.]+", "-", name.lower()), f"n{n}-seed{seed}")
        row = row_flags(flags, chosen)
        adapter = train.main(common + shlex.split(args.train_args) + row + [
            "--n-train", str(n), "--seed", str(seed), "--out", out, "--overwrite",
            "--teacher-cache", os.path.join(args.out, "teacher")])
        checkpoint = os.path.join(out, "adapter.safetensors")
        method = M.load_adapter(checkpoint, backbone)["method"]
        m = scored(["--checkpoint", checkpoint, "--out", out], method)
        runs.append({"setting": name, "queries": n, "seed": seed, "accuracy": m[headline_metric(m)],
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
    D.atomic_write(os.path.join(args.out, "curve.md"), lambda f: f.write(("\n".join(lines) + "\n").encode()))
    D.write_json(os.path.join(args.out, "curve.json"), {**recorded, "runs": runs, "levels": levels, "tuned": chosen},
                 indent=2)
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
    D.atomic_write(os.path.join(args.out, "curve.png"), lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
    print("\n".join(lines) + f"\n-> {args.out}/curve.md, curve.png")


# ----------------------------------------------------------------------------------------------------- command line

# Every setting that changes an evaluation's result, as the metrics record it (the name holds those a user varies)
RESULT_SETTINGS = ("model", "image_splitting", "data_root", "task", "split", "setting", "checkpoint", "shots", "icds",
                   "rices_encoder", "protocol", "chair", "seed", "n_eval", "n", "vector_file", "vector_layer")


def result_settings(backbone, args, setting, n):
    """An evaluation's RESULT_SETTINGS (the SEED protocol and a vector's file and layer are added by evaluate): the
    backbone, its image splitting as applied (Idefics2: on / off, else None), the data's folder, the demonstrations'
    choice (where there are demonstrations), the seed, --n-eval and the items scored."""
    splitting, rices = train.image_key(backbone.processor), args.icds == "rices" and bool(args.shots)
    return {"model": args.model, "image_splitting": None if splitting is None else "on" if splitting else "off",
            "data_root": args.data_root and os.path.abspath(args.data_root), "task": args.task, "split": args.split,
            "setting": setting, "checkpoint": args.checkpoint, "shots": args.shots or 0,
            "icds": args.icds if args.shots else None, "rices_encoder": args.rices_encoder if rices else None,
            "chair": args.chair, "seed": args.seed, "n_eval": args.n_eval, "n": n}


def check_replaceable(path, settings):
    """Refuse to replace the result file at `path` (metrics, an analysis, a benchmark, a curve) if it records other
    values of `settings` ({name: value}, as far as the old file records them): a ValueError naming the file and each
    difference. Paths compare as absolute paths. An unreadable file holds no result and is replaced."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return
    path_of = lambda v: os.path.abspath(v) if isinstance(v, str) else v
    same = lambda k: old[k] == settings[k] or k in ("checkpoint", "data_root") and \
        path_of(old[k]) == path_of(settings[k])
    differ = [f"{k} {old[k]!r} (now {settings[k]!r})" for k in settings if isinstance(old, dict) and k in old and
              not same(k)]
    if differ:
        raise ValueError(f"{path} holds the result of other settings: {', '.join(differ)}; it is kept. Give another "
                         "--out, or remove the file to replace it")


def default_checkpoint(model, task):
    """Where a train.py run with the default --out and --method writes its best adapter."""
    return os.path.join(train.default_out(model, task, "hyper-icl"), "adapter.safetensors")


def parse_args(argv=None):
    """The flags (see --help). Fills in the default checkpoint and the output folder."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="toy-idefics2",
                   help="backbone: idefics2, idefics, llava-interleave, llava-onevision (the paper's checkpoints), "
                        "tiny-<family> (offline twin, random weights), toy-idefics2 (meta-trained to learn in "
                        "context: the shipped reference), a toy backbone's file (train.py --build-toy), or a local "
                        "path (default: %(default)s)")
    p.add_argument("--task", default="toy-icl-colour", choices=list(D.TASKS), help="benchmark (default: %(default)s)")
    p.add_argument("--checkpoint", help="adapter checkpoint (train.py's <out>/adapter.safetensors; default: "
                   f"{default_checkpoint('<model>', '<task>')} if it exists and --shots is not given, else none)")
    p.add_argument("--shots", type=int, help="random in-context demonstrations per query from the training split "
                   "(0: zero-shot; N: the paper's N-shot Direct-ICD baseline). For --gates / --hyperbolicity: the "
                   "teacher's ICDs (default: the paper's, data.default_shots: 2 for MME and SEED)")
    train.add_icd_flags(p)
    train.add_plan_flags(p)
    train.add_worker_flag(p)
    p.add_argument("--n-eval", type=int, help="evaluate the first N items of the split (default: all; the paper "
                                              "uses 10,000 VQAv2 val questions, the full OK-VQA val and COCO test); "
                                              "MME and SEED-Bench: about N questions drawn by image, stratified by "
                                              "subtask / dimension and seeded by --seed (data.stratified_subset)")
    p.add_argument("--batch-size", type=int, default=8, help="queries per generate call (default: %(default)s)")
    p.add_argument("--data-root", help="datasets in their official layout (see data.py; toy-icl tasks need none)")
    p.add_argument("--split", default="val", choices=D.SPLITS, help="split to evaluate (default: %(default)s)")
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
    p.add_argument("--curve-queries", type=int, nargs="+", default=list(CURVE_QUERIES),
                   help="--curve: training queries per run (default: %(default)s)")
    p.add_argument("--curve-seeds", type=int, default=CURVE_SEEDS,
                   help="--curve: seeds per point (default: %(default)s)")
    p.add_argument("--curve-methods", nargs="+", help="--curve: only these rows (names as in curve.md; default: all)")
    p.add_argument("--no-tune", action="store_true", help="--curve: train every method at its published learning "
                   "rate (PUBLISHED_LR) instead of tuning it on held-out training queries first")
    p.add_argument("--train-args", default="", help="with --curve: train.py flags for every run, before the "
                   f"tuned rate and each row's own (default: '{CURVE_TRAIN_ARGS}')")
    p.add_argument("--vector", choices=["tv", "fv"], help="evaluate zero-shot with a training-free in-context vector "
                   "(Table 1): tv = task vector (Hendel et al. 2023), fv = function vector (Todd et al. 2024), "
                   "computed once from --vector-sets ICL prompts of --shots ICDs (default: the paper's) of the "
                   "training split and saved under <out>/vectors/")
    p.add_argument("--vector-layer", type=int, help="decoder layer (0-based) the vector goes in (default: the one "
                   "with the lowest target loss on --vector-heldout training queries)")
    p.add_argument("--vector-sets", type=int, default=VECTOR_SETS, help="ICL prompts averaged into the vector "
                   "(default: %(default)s, as Todd et al.'s mean activations)")
    p.add_argument("--vector-heldout", type=int, default=32, help="training queries held out to choose the layer "
                   "(default: %(default)s)")
    p.add_argument("--fv-heads", type=int, default=FV_HEADS, help="k, heads summed into a function vector "
                   "(default: %(default)s, Todd et al.'s |A|)")
    p.add_argument("--fv-trials", type=int, default=FV_TRIALS, help="corrupted prompts for each head's average "
                   "indirect effect (default: %(default)s, Todd et al.'s)")
    p.add_argument("--chair", nargs="?", const="chair.py", choices=CHAIR_COUNTS, help="also CHAIR_s, CHAIR_i and "
                   "object Recall (Table 5) of the captions, from coco/annotations/instances_{train,val}2014.json "
                   "under --data-root (coco); counted as the published chair.py counts, its quirks "
                   "included (as in published numbers), or with `--chair corrected` without them (chair_s_corrected, "
                   "...)")
    p.add_argument("--random-weights", nargs="?", const="published", choices=["published", "mid"],
                   help="with --benchmark / --benchmark-attention: a backbone of --model's family with random weights "
                   "and synthetic prompts, no download. 'published' (the default when no size is named): the real "
                   "size (model.PUBLISHED), bf16 on CUDA (--benchmark-attention: one layer of its attention sizes, "
                   "also on CPU); 'mid': 8 decoder layers x 1024, 16 heads, 4 key/value heads (model.mid_model), "
                   f"float32, a {MID_QUERY_TEXT}-token query, meant for CPUs")
    p.add_argument("--new-tokens", type=int, help="--benchmark: tokens generated per query (default: --task's "
                                                 "generation length; 8 with --random-weights mid)")
    p.add_argument("--bench-shots", type=int, nargs="*", default=list(BENCH_SHOTS),
                   help="--benchmark: the n-shot ICL rows (default: %(default)s; none when given without values)")
    p.add_argument("--attention-tokens", type=int, default=2048, help="--benchmark (peak memory of one attention "
                   "layer) and --benchmark-attention: query and key tokens (default: %(default)s)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: one for the tiny and toy backbones "
                   "on CPU, else torch's own choice)")
    p.add_argument("--rounds", type=int, help=f"benchmarks: rounds of timed runs, each setting once per round "
                   f"between two runs of the reference (default: {ROUNDS})")
    p.add_argument("--force", action="store_true", help="load --checkpoint even if it was trained on another "
                   "backbone (family or weights) of the same shape, with a warning")
    # `--train-args VALUE` as `--train-args=VALUE`: a value starting with '-' ("--resume") is the flag's, not a flag
    argv = list(sys.argv[1:] if argv is None else argv)
    for k in range(len(argv) - 1):
        if argv[k] == "--train-args":
            argv[k:k + 2] = [f"--train-args={argv[k + 1]}", None]
    args = p.parse_args([a for a in argv if a is not None])
    if args.seed_protocol and D.TASKS[args.task].kind != "choice":
        p.error(f"--seed-protocol applies to the SEED-Bench tasks (multiple choice), not {args.task}")
    args.seed_protocol = args.seed_protocol or "generate"
    train.check_at_least(p, args, {"n_eval": 1, "batch_size": 1, "shots": 0, "rounds": 1, "vector_layer": 0,
                                   "vector_sets": 1, "vector_heldout": 1, "fv_heads": 1, "fv_trials": 1,
                                   "new_tokens": 1, "attention_tokens": 1, "threads": (1, train.MAX_THREADS),
                                   "bench_shots": 0, "curve_queries": 1, "seed": (0, train.MAX_SEED),
                                   "workers": (0, train.MAX_WORKERS)})
    if not 0 < args.image_memory < math.inf:
        p.error(f"--image-memory must be a finite number > 0 (in GB; got {args.image_memory})")
    if args.curve:
        args.train_args = args.train_args or CURVE_TRAIN_ARGS
        unknown = set(args.curve_methods or []) - {name for name, _ in curve_runs()}
        if unknown:
            p.error(f"--curve-methods: unknown {sorted(unknown)}; choose from {[n for n, _ in curve_runs()]}")
        if not 2 <= args.curve_seeds <= len(T_975) + 1:
            p.error(f"--curve-seeds must be in [2, {len(T_975) + 1}] for an interval (got {args.curve_seeds})")
        try:  # split as a shell does and parsed by train.py's parser (with what curve adds) now, before any work
            with contextlib.redirect_stderr(io.StringIO()) as err:
                train.parse_args(["--model", args.model, "--task", args.task, *shlex.split(args.train_args),
                                  "--overwrite"])
        except ValueError as e:
            p.error(f"--train-args {args.train_args!r} cannot be split into flags ({e})")
        except SystemExit:
            p.error(f"--train-args {args.train_args!r}: train.py says: "
                    + err.getvalue().strip().splitlines()[-1].split(" error: ", 1)[-1])
    if args.icds == "rices" and not args.shots:
        p.error("--icds rices chooses demonstrations: give their number with --shots N")
    if args.chair and args.task != "coco":
        p.error(f"--chair scores COCO captions against COCO instance annotations (coco), not {args.task}")
    if args.random_weights and not (args.benchmark or args.benchmark_attention):
        p.error("--random-weights only makes sense with --benchmark or --benchmark-attention")
    if args.random_weights == "published" and args.benchmark and not torch.cuda.is_available():
        p.error("--random-weights published runs a real-size backbone and needs a CUDA GPU")
    default = default_checkpoint(args.model, args.task)
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
    args.out = args.out or (f"runs/curve-{name}-{args.task}" if args.curve else os.path.dirname(args.checkpoint)
                            or "." if args.checkpoint else f"runs/eval-{name}-{args.task}")
    train.check_folders(p, {"--out": args.out, "--rices-cache": args.rices_cache})
    return args


def main(argv=None):
    """python evaluate.py [--benchmark | --benchmark-attention | --gates | --hyperbolicity | --curve] [flags]. Under
    torchrun the evaluation is shared by the processes (the other modes run whole in each; the first writes)."""
    args = parse_args(argv)
    if args.plan:  # before any folder is made or weights load
        return train.plan(args, queries=eval_items(args))
    M.choose_threads(args.model, args.threads or (1 if args.curve and not torch.cuda.is_available() else None))
    global ROUNDS
    ROUNDS = args.rounds or ROUNDS
    with train.process_group(), contextlib.nullcontext() if args.benchmark_attention else train.locked(args.out):
        D.remove_stale_tmp(args.out)
        if args.benchmark or args.benchmark_attention:
            keep_freed_memory()
        if args.benchmark_attention:
            return attention_benchmark(attention_model(args), args.attention_tokens)
        if args.curve:
            return curve(args)
        items = None if args.benchmark else eval_items(args)
        if items == []:
            raise ValueError(f"{args.task} has no {args.split} items to evaluate")
        if args.random_weights:
            family, mid = M.family_of(args.model), args.random_weights == "mid"
            model = M.mid_model(family)[0].to("cuda" if torch.cuda.is_available() else "cpu") if mid else \
                M.published_model(family, device="cuda")
            backbone = M.Backbone(model, None, family, f"{family} ({'mid size, ' if mid else ''}random weights)")
        else:
            backbone = M.load_backbone(args.model, image_splitting=args.image_splitting,
                                       image_memory=args.image_memory * 1e9)
            if backbone.images:
                print(backbone.images)
        setting = args.vector or f"{args.shots or 0}-shot" + ("-rices" if args.shots and args.icds == "rices" else "")
        default, asked = default_checkpoint(args.model, args.task), args.shots is not None or args.vector
        if args.checkpoint:
            method = M.load_adapter(args.checkpoint, backbone, force=args.force)["method"]
            setting = method if not args.shots else f"{method}+{setting}"
            print(f"adapter: {args.checkpoint} ({method})")
        elif not args.benchmark:
            print(f"no adapter: {setting} evaluation" + (f" ({default} not found)" if not asked else ""))
        if args.benchmark:
            return benchmark(backbone, args)
        if not (args.gates or args.hyperbolicity):
            if not asked and args.checkpoint in (None, default):  # the default job
                return evaluate_with_baselines(backbone, args, items, setting)
            return evaluate(backbone, args, items, setting, load_vector(backbone, args) if args.vector else None)
        path = os.path.join(args.out, f"{'gates' if args.gates else 'hyperbolicity'}-{args.task}-{args.split}.json")
        settings = result_settings(backbone, args, setting, len(items))
        check_replaceable(path, settings)
        result = gate_analysis(backbone, args, items) if args.gates else hyperbolicity_analysis(backbone, args, items)
        if train.rank_and_world()[0] != 0:
            return result
        D.write_json(path, {**settings, **result}, indent=2)
        print(json.dumps({k: v for k, v in result.items() if k != "per_layer_mean"}), f"-> {path}")
        return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # bad input (unknown backbone, missing data, mismatched checkpoint)
        raise SystemExit(f"error: {e}")
