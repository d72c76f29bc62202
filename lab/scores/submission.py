"""VQAv2's test server (EvalAI): the test-dev and test questions (no annotations; images in coco/test2015/) and the
results file the server takes, [{"question_id": int, "answer": str}] over every test2015 question (EvalAI refuses a
partial file, so for the test-dev phase the questions outside test-dev get ""), the answers normalised as the
official vqaEval.py normalises them."""
import json
import os

from lab.disk import files
from lab.datasets import readers
from lab.scores.metrics import normalize_vqa_answer


def results_name(split, setting):
    """The server file's name: vqav2_<test-dev2015|test2015>_<setting>_results.json."""
    return f"vqav2_{readers.TEST_SPLITS[split]}_{setting}_results.json"


def server_results(all_ids, items, predictions):
    """The server's list: one {"question_id", "answer"} per id of all_ids (the test2015 questions, in file order), the
    prediction of the item of that id normalised (normalize_vqa_answer), "" where no item has it. An item outside
    all_ids, or a list that is not every id exactly once (int ids, str answers), is a ValueError: never written."""
    answered = {it.id: normalize_vqa_answer(p) for it, p in zip(items, predictions, strict=True)}
    outside = sorted(set(answered) - set(all_ids))
    if outside:
        raise ValueError(f"{len(outside)} question ids (first {outside[0]}) are not in the test2015 questions file "
                         f"{readers.QUESTIONS.format('test2015')}; test-dev must be a part of test2015")
    rows = [{"question_id": q, "answer": answered.get(q, "")} for q in all_ids]
    check_complete(rows, all_ids)
    return rows


def check_complete(rows, all_ids):
    """Every id of all_ids exactly once, an int, with a str answer; else a ValueError saying what is wrong."""
    ids = [r["question_id"] for r in rows]
    bad = [r for r in rows if type(r["question_id"]) is not int or not isinstance(r["answer"], str)]
    if bad:
        raise ValueError(f"the server file needs int question ids and str answers; got {bad[0]}")
    if len(ids) != len(set(ids)) or set(ids) != set(all_ids):
        raise ValueError(f"the server file must hold each of the {len(set(all_ids))} test2015 question ids once; it "
                         f"has {len(ids)} rows over {len(set(ids) & set(all_ids))} of them; not written")


def check_replaceable(args, setting, stem):
    """Before any work: refuse to replace a server file that another evaluation wrote (another checkpoint of the same
    method in this --out): one is at results_name and this evaluation's metrics (<stem>.metrics.json) do not name it.
    An evaluation that writes none (--n-eval below the split's size) replaces nothing."""
    path = os.path.join(args.out, results_name(args.split, setting))
    writes = args.n_eval is None or args.n_eval >= len(readers.read_test(args.data_root, args.split))
    if not (writes and os.path.lexists(path)):
        return
    try:
        with open(stem + ".metrics.json", encoding="utf-8") as f:
            named = json.load(f).get("server_file")
    except (OSError, ValueError, AttributeError):
        named = None
    if named != os.path.basename(path):
        raise ValueError(f"{path} holds another evaluation's answers ({stem}.metrics.json does not name it); it is "
                         "kept. Give another --out, or remove the file to replace it")


def write_server_file(args, items, predictions, setting):
    """The server file of an evaluation of --split test-dev / test, <out>/results_name, written atomically from the
    whole split; with --n-eval below the split's size none, and a line says why. Prints the file's path and returns
    its name, or None."""
    split = readers.read_test(args.data_root, args.split)
    if len(items) < len(split):
        print(f"no server file: --n-eval {args.n_eval} answers {len(items)} of the {len(split)} {args.split} "
              "questions; EvalAI takes only a file of every question (drop --n-eval)")
        return None
    all_ids = [it.id for it in (split if args.split == "test" else readers.read_questions(args.data_root, "test2015"))]
    rows = server_results(all_ids, items, predictions)
    path = os.path.join(args.out, results_name(args.split, setting))
    files.atomic_write(path, lambda f: f.write(json.dumps(rows).encode()))
    print(f"{args.model} {args.task}/{args.split} {setting}: {len(items)} answers, {len(rows)} test2015 questions, "
          f"for the test server -> {path}")
    return os.path.basename(path)
