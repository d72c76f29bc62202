"""Result files: their names, the settings a result depends on, refusing to replace another setting's result, an
evaluation's predictions and metrics, MME's results folder."""
import hashlib
import json
import math
import os
import statistics
from collections import Counter

from lab.disk import files
from lab.datasets import tasks
from lab.run import adapter_files, resume, teacher_cache
from lab.scores.metrics import T_975, multiple_choice_accuracy, vqa_accuracy


def result_name(args, setting, n, vector_info):
    """The file name (no extension) of an evaluation's results, naming what besides the folder a user varies:
    <task>-<split>-<setting: method or n-shot, -rices>[-<SEED protocol>][-splitting-on|off][-icds-<--icd-task>]
    [-<RICES encoder>]
    [-<vector layer and file key>][-chair[-corrected]][-<checkpoint key: a hash of its path, if it is not the folder's
    adapter.safetensors>]-seed<seed>-n<items>. What else changes a result (the backbone, --data-root, --n-eval) is in
    the metrics, and check_replaceable keeps a file of other settings from being replaced."""
    short = lambda text: hashlib.sha256(str(text).encode()).hexdigest()[:8]
    parts = [tasks.file_name(args.task), args.split, setting]
    if tasks.spec(args.task).kind == "choice":
        parts.append(args.seed_protocol)
    if args.image_splitting != "checkpoint":
        parts.append("splitting-" + args.image_splitting)
    if args.icd_task and args.shots:
        parts.append("icds-" + tasks.file_name(args.icd_task))
    if args.icds == "rices" and args.shots and args.rices_encoder:
        parts.append("encoder-" + short(args.rices_encoder))
    if vector_info:
        key = os.path.basename(vector_info["vector_file"]).rsplit("-", 1)[-1].split(".")[0]
        parts.append(f"layer{vector_info['vector_layer']}-{key}")
    if args.chair:
        parts.append("chair" if args.chair == "chair.py" else "chair-" + args.chair)
    own = os.path.join(args.out, "adapter.safetensors")  # the folder's own adapter needs no key
    if args.checkpoint and os.path.abspath(args.checkpoint) != os.path.abspath(own):
        parts.append("checkpoint-" + short(os.path.abspath(args.checkpoint)))
    return "-".join(parts + [f"seed{args.seed}", f"n{n}"])


def write_evaluation(stem, kind, items, predictions, metrics):
    """An evaluation's files: <stem>.predictions.jsonl (id, prediction, references per item), for MME its results
    folder <stem>.mme (write_mme_results), and last <stem>.metrics.json: `metrics` and the name and sha256 of the
    predictions it scores, so that a kill in between leaves old metrics whose hash does not match (the old metrics
    and MME folder are removed first). Returns the metrics as written."""
    lines = "".join(json.dumps({"id": it.id, "prediction": p, "references": list(it.answers)}) + "\n"
                    for it, p in zip(items, predictions)).encode()
    for subtask in {it.category for it in items} if kind == "yes-no" else ():  # before any file is touched
        files.plain_name(subtask)
    try:  # never the old metrics (or MME folder) beside the new predictions, even if killed next
        os.remove(stem + ".metrics.json")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise OSError(f"could not remove the old {stem}.metrics.json ({e.strerror or e})") from e
    if kind == "yes-no":
        files.discard(stem + ".mme")
    files.atomic_write(stem + ".predictions.jsonl", lambda f: f.write(lines))
    if kind == "yes-no":
        write_mme_results(stem + ".mme", items, predictions)
    metrics = {**metrics, "predictions": os.path.basename(stem) + ".predictions.jsonl",
               "predictions_sha256": hashlib.sha256(lines).hexdigest()}
    files.write_json(stem + ".metrics.json", metrics, indent=2)
    return metrics


def write_mme_results(folder, items, predictions):
    """One <subtask>.txt per subtask in the official eval_tool's results format (`image<TAB>question<TAB>answer
    <TAB>prediction`, an image's two questions on consecutive lines), so its calculation.py can check mme_scores. The
    folder is written whole or not at all (files.replaced): calculation.py never reads two runs' files mixed."""
    lines = {}
    for it, p in zip(items, predictions):  # " ".join(p.split()): no tab or newline may break the four columns
        row = f"{os.path.basename(it.image_path)}\t{it.question}\t{it.target}\t{' '.join(p.split())}\n"
        lines.setdefault(it.category, []).append(row)

    def write(tmp):
        for subtask, rows in lines.items():
            files.atomic_write(os.path.join(tmp, subtask + ".txt"), lambda f: f.write("".join(rows).encode()))
    files.replaced(folder, write)


def chance(items):
    """What always giving the most frequent target scores, in percent of the items: where n-shot ICL scores no more
    (+ 5), the backbone does not learn in context (evaluate_with_baselines, a table's marks)."""
    return 100 * max(Counter(it.target for it in items).values()) / len(items)


def item_interval(kind, items, predictions):
    """[low, high]: the two-sided 95% interval of the reported metric as a mean over items, mean +- t s / sqrt(n), t
    Student's t(0.975, n - 1) (metrics.T_975; 1.96 past 31 items), s the items' standard deviation; each item scored
    as the metric scores it (VQA accuracy, or a right yes/no or option letter) x 100. None for CIDEr (a score of the
    whole set, not a mean over items) and under two items."""
    if kind == "caption" or len(items) < 2:
        return None
    scores = [100 * (vqa_accuracy(p, it.answers) if kind == "vqa" else multiple_choice_accuracy([p], [it.target]))
              for it, p in zip(items, predictions)]
    t = T_975[len(scores) - 2] if len(scores) - 1 <= len(T_975) else 1.96
    mean, half = statistics.fmean(scores), t * statistics.stdev(scores) / math.sqrt(len(scores))
    return [mean - half, mean + half]


def headline_metric(metrics):
    """The name of the metric an evaluation reports first: VQA accuracy, CIDEr, or (MME, SEED-Bench) accuracy."""
    return next(k for k in ("vqa_accuracy", "cider", "accuracy") if k in metrics)


# Every setting that changes an evaluation's result, as the metrics record it (the name holds those a user varies)
RESULT_SETTINGS = ("model", "image_splitting", "data_root", "task", "split", "setting", "checkpoint", "shots", "icds",
                   "rices_encoder", "protocol", "chair", "seed", "items", "n", "vector_file", "vector_layer",
                   "new_tokens", "icd_task", "data")


def result_settings(backbone, args, setting, items):
    """An evaluation's RESULT_SETTINGS (the SEED protocol and a vector's file and layer are added by evaluate): the
    backbone, its image splitting as applied (Idefics2: on / off, else None), the data's folder, the demonstrations'
    choice (where there are demonstrations), the tokens generated per query (--new-tokens or the task's), the seed,
    --n-eval (recorded, not compared) and the items scored (their count and a hash of their ids: what was scored,
    however --n-eval chose it; `data`: a hash of what they hold, adapter_files.data_fingerprint's of their questions,
    answers, targets, categories and images' bytes, so a result of data edited since is not read as this one's)."""
    splitting, rices = teacher_cache.image_key(backbone.processor), args.icds == "rices" and bool(args.shots)
    return {"model": args.model, "image_splitting": None if splitting is None else "on" if splitting else "off",
            "data_root": args.data_root and os.path.abspath(args.data_root), "task": args.task, "split": args.split,
            "setting": setting, "checkpoint": args.checkpoint, "shots": args.shots or 0,
            "icds": args.icds if args.shots else None, "icd_task": args.icd_task if args.shots else None,
            "rices_encoder": args.rices_encoder if rices else None,
            "chair": args.chair, "seed": args.seed, "n_eval": args.n_eval, "n": len(items),
            "new_tokens": args.new_tokens or tasks.spec(args.task).max_new_tokens,
            "items": hashlib.sha256(json.dumps([it.id for it in items]).encode()).hexdigest()[:16],
            "data": adapter_files.data_fingerprint(items, [], {it.id: [] for it in items})}


def check_replaceable(path, settings):
    """Refuse to replace the result file at `path` (metrics, an analysis, a benchmark, a curve) if it records other
    values of `settings` ({name: value}, as far as the old file records them): a ValueError naming the file and each
    difference. Paths compare as real paths (a data root through a symlink is the same), an adapter also by its bytes
    (a folder of results moved with its adapters holds the same results: same_setting). An unreadable file holds no
    result and is replaced."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError, RecursionError):
        return
    differ = [f"{k} {old[k]!r} (now {settings[k]!r})" + (DATA_CHANGED if k == "data" else "") for k in settings
              if isinstance(old, dict) and k in old and not same_setting(old, k, settings[k])]
    if differ:
        raise ValueError(f"{path} holds the result of other settings: {', '.join(differ)}; it is kept. Give another "
                         "--out, or remove the file to replace it")


DATA_CHANGED = " (the scored items' questions, answers or images changed since it was evaluated)"


def same_setting(old, name, value):
    """Whether the metrics `old` record `value` of the setting `name`: equal, or for a path (--checkpoint,
    --data-root, a vector's file) the same real path, or, wherever the folder now is, for --checkpoint a file of the
    bytes they scored (their checkpoint_sha256: the same adapter), for a vector's file (<out>/vectors/) one of the
    same name (its key: a hash of what made it, vectors.vector_path)."""
    if old.get(name) == value:
        return True
    if name not in ("checkpoint", "data_root", "vector_file") or not isinstance(old.get(name), str) or \
            not isinstance(value, str):
        return False
    return os.path.realpath(old[name]) == os.path.realpath(value) or name == "checkpoint" and \
        old.get("checkpoint_sha256") == adapter_digest(value) or name == "vector_file" and \
        os.path.basename(old[name]) == os.path.basename(value)


def adapter_digest(path):
    """The sha256 of the adapter file at `path`, as an evaluation records it (checkpoint_sha256); None if unreadable."""
    try:
        return files.file_digest(path)
    except OSError:
        return None


def damage(metrics):
    """What makes a metrics file no result (None if nothing): not a dict, or a field a result needs missing or not of
    its kind (the headline score and its interval, the items, the adapter's record and parameters), named."""
    if not isinstance(metrics, dict):
        return "it is not a JSON object"
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    headline = next((k for k in ("vqa_accuracy", "cider", "accuracy") if k in metrics), None)
    interval, run = metrics.get("interval95"), metrics.get("run")
    checks = [(headline or "vqa_accuracy", headline is not None and number(metrics[headline]), "a number"),
              ("n", type(metrics.get("n")) is int and metrics["n"] > 0, "a count of items"),
              ("setting", isinstance(metrics.get("setting"), str), "text"),
              ("interval95", interval is None or isinstance(interval, list) and len(interval) == 2 and
               all(map(number, interval)), "null or [low, high]"),
              ("run", run is None or isinstance(run, dict), "null or the adapter's run record"),
              ("run.n_train", not isinstance(run, dict) or type(run.get("n_train", 0)) is int, "a count of queries"),
              ("params", metrics.get("params") is None or type(metrics["params"]) is int, "null or a count"),
              ("chance", metrics.get("chance") is None or number(metrics["chance"]), "null or a number")]
    wrong = [f"its {name} is {missing_or(metrics, name)}, not {want}" for name, ok, want in checks if not ok]
    return wrong[0] if wrong else None


def missing_or(metrics, name):
    """A field's value as damage names it: its repr, or `missing`."""
    head, _, tail = name.partition(".")
    value = metrics.get(head, "missing") if not tail else (metrics.get(head) or {}).get(tail, "missing")
    return value if value == "missing" else repr(value)


def same_result(stem, kind, settings):
    """The metrics of an evaluation done before under this name with these settings (every key of `settings` as
    recorded, --n-eval aside: the items' ids and content are compared, an adapter by its bytes), whole (damage: none)
    and whose predictions file is the one they score (and MME's results folder is there); None otherwise (it is
    evaluated, and written, again: a damaged file heals)."""
    try:
        with open(stem + ".metrics.json", encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    if damage(old) is not None:
        print(f"note: {stem}.metrics.json: {damage(old)}: no result; evaluated again")
        return None
    same = all(same_setting(old, k, v) for k, v in settings.items() if k != "n_eval")
    return old if same and scores_its_predictions(stem, kind, old) else None


def scores_its_predictions(stem, kind, metrics):
    """Whether the metrics of <stem> score the predictions file beside them (its sha256 the one they record) and, for
    MME, its results folder is there: else they are no result of that file (a kill in between, a file removed)."""
    try:
        with open(stem + ".predictions.jsonl", "rb") as f:
            scored = hashlib.sha256(f.read()).hexdigest() == metrics["predictions_sha256"]
    except (OSError, KeyError, TypeError):
        return False
    return scored and (kind != "yes-no" or os.path.isdir(stem + ".mme"))


def default_checkpoint(model, task):
    """Where a train.py run with the default --out and --method writes its best adapter."""
    return os.path.join(resume.default_out(model, task, "hyper-icl"), "adapter.safetensors")
