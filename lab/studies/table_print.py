"""A table beside the paper's (evaluate.py --table N [--print]): each cell assembled from its result file alone (our
number, its 95% interval where the metric allows one, the items scored, the adapter's parameters and the run that
made it; Table 5's CHAIR counted on its evaluation's predictions; Tables 6, 9, 10 from their study's result file),
the paper's number and the difference, marks on what is not a result; written as Markdown and JSON (and a figure for
a sweep, Figure 4's gallery page) in the backbone's folder."""
import base64
import glob
import html
import json
import mimetypes
import os

from lab.disk import files
from lab.datasets import tasks
from lab.models import families
from lab.scores import chair, results
from lab.studies import tables

MARKS = {  # what a mark on a cell says
    "chance": "not a result: n-shot ICL at chance (at most the most frequent answer's share + 5 points): the backbone "
              "does not learn in context here, so nothing distilled from it can show anything",
    "subset": "a subset smaller than the paper's evaluation (items: ours / the paper's)",
    "queries": "the adapter trained on fewer queries than the paper's 1,000",
    "missing": "no result yet: run the table's command (it continues where it stopped)",
    "undefined": "undefined on this result (NaN: a correlation with a gate that does not vary)",
    "extra": "a row the paper does not hold (the project's)",
    "hificl": "the published number is HiFICL's paper's (arXiv 2603.12760, its main results), not this paper's"}
SYMBOLS = {"chance": "†", "subset": "‡", "queries": "§", "missing": "?", "undefined": "~", "extra": "*",
           "hificl": "¶"}


def found(job, parsers):
    """The metrics file of an evaluation job, found among its folder's files by what it records (None if none is
    there): its name as the job names it (results.result_name: the setting, split, SEED protocol, image splitting,
    ICDs' task and encoder, vector, adapter), the backbone, data root, task, seed, --n-eval, ICDs, tokens generated,
    the adapter (by its bytes: a folder moved with its adapters keeps its results) and the task it was trained on,
    and the predictions it scores (results.scores_its_predictions). A file that is unreadable, damaged
    (results.damage: said in a line), of other settings or beside other predictions is no result of the job, which
    evaluates it again."""
    a = job.args(parsers)
    want = {"model": a.model, "task": a.task, "split": a.split, "seed": a.seed, "n_eval": a.n_eval,
            "shots": a.shots or 0, "icds": a.icds if a.shots else None, "icd_task": a.icd_task if a.shots else None,
            "new_tokens": a.new_tokens or tasks.spec(a.task).max_new_tokens, "vector": a.vector,
            "data_root": a.data_root, "checkpoint": a.checkpoint}
    trained_on = a.checkpoint and tasks.task_id(a.checkpoint_task or a.task)
    for path in sorted(glob.glob(os.path.join(glob.escape(a.out), "*.metrics.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                m = json.load(f)
            stem = path.removesuffix(".metrics.json")
            vector = {k: m[k] for k in ("vector_file", "vector_layer")} if a.vector else {}
            name = results.result_name(a, m["setting"], m["n"], vector)
        except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
            continue  # unreadable, or not an evaluation's metrics
        if os.path.basename(stem) != name:
            continue
        if results.damage(m) is not None:
            print(f"note: {path}: {results.damage(m)}: no result (the table's run evaluates it again)")
            continue
        if all(results.same_setting(m, k, v) for k, v in want.items()) and \
                (m.get("run") or {}).get("task", trained_on) == trained_on and \
                results.scores_its_predictions(stem, tasks.spec(a.task).kind, m):
            return path, m
    return None, None


STUDY_FILES = {"benchmark": "benchmark.json", "gates": "gates-{task}-{split}.json",
               "hyperbolicity": "hyperbolicity-{task}-{split}.json"}  # a study's result file in its --out


def study_found(study, a):
    """The result file of a study job of parsed flags `a` in its --out, and its dict, if it holds a result of these
    settings (the backbone; an analysis's data root, task, split, seed, --n-eval, shots and adapter), else (None,
    None): the table's run measures it (again)."""
    path = os.path.join(a.out, STUDY_FILES[study].format(task=tasks.file_name(a.task), split=a.split))
    want = {"model": a.model} if study == "benchmark" else {
        "model": a.model, "data_root": a.data_root and os.path.abspath(a.data_root), "task": a.task, "split": a.split,
        "seed": a.seed, "n_eval": a.n_eval, "shots": a.shots or 0, "checkpoint": a.checkpoint}
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
        same = all(results.same_setting(m, k, v) for k, v in want.items())
    except (OSError, ValueError, RecursionError, TypeError, AttributeError):
        return None, None
    return (path, m) if same else (None, None)


def study_value(m, read):
    """The number at path `read` ("teacher/mean"; a list's entry by its "setting": "rows/8-shot/prefill_ms") of a
    study's result, or None where it has none."""
    value = m
    for part in read.split("/"):
        if isinstance(value, list):
            value = next((r for r in value if isinstance(r, dict) and r.get("setting") == part), None)
        else:
            value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def chair_of(path, job, parsers, memo):
    """CHAIR_s, CHAIR_i and Recall (x 100, chair.chair_metrics) of the predictions beside an evaluation's metrics at
    `path`, counted once per file (memo), on the evaluation's items; None if an item has no prediction there."""
    if path not in memo:
        said, items = {i: p for i, (p, _) in predictions(path).items()}, tasks.eval_items(job.args(parsers))
        memo[path] = chair.chair_metrics(items, [said[it.id] for it in items]) if all(
            it.id in said for it in items) else None
    return memo[path]


def cell_record(out, name, family, table, key, job, parsers, memo=None):
    """One cell: ours, the paper's, the difference, items (ours, the paper's), interval, parameters, marks. memo:
    the CHAIR counts of the table's predictions files (chair_of)."""
    (row, column), cell = key, table.cells[key]
    path, m = study_found(job.script, job.args(parsers)) if cell.study else found(job, parsers)
    paper = tables.published(name, family, row, column)
    record = {"row": row, "column": column, "paper": paper,
              "paper_items": {"hyperbolicity": tables.ANALYSIS_ITEMS}.get(cell.study) if cell.study else
              tables.PAPER_ITEMS.get(cell.task),  # Table 9's 1,000 queries (Appendix C); the others state none
              "marks": (["extra"] if row in table.extra else []) +
              (["hificl"] if paper is not None and (name, row) in tables.BESIDE else [])}
    if m is not None and cell.read:
        scores = study_value(m, cell.read) if cell.study else (chair_of(path, job, parsers, {} if memo is None
                                                                        else memo) or {}).get(cell.read)
        m = None if scores is None else {**m, cell.read: scores}
    metric = m and (cell.read or results.headline_metric(m))
    if m is None or m[metric] != m[metric]:  # NaN: undefined
        return record | {"ours": None, "marks": record["marks"] + ["missing" if m is None else "undefined"]}
    record |= {"metric": metric, "ours": m[metric], "items": m.get("n"),
               "interval95": None if cell.read else m.get("interval95"),
               "params": m.get("params"), "difference": None if paper is None else m[metric] - paper,
               "result": os.path.relpath(path, out)}
    if cell.train is None and not cell.read and m["shots"] and metric != "cider" and "chance" in m and \
            m[metric] <= m["chance"] + 5:
        record["marks"].append("chance")
    if record["paper_items"] and m.get("n") is not None and m["n"] < record["paper_items"]:
        record["marks"].append("subset")
    if (m.get("run") or {}).get("n_train", 1000) < 1000:
        record["marks"].append("queries")
    return record


def text(record, digits=2):
    """A cell as the Markdown table shows it: ours [interval] / the paper's (difference), items, marks; numbers with
    `digits` decimals."""
    if record["ours"] is None:
        ours = "-"
    else:
        interval = record.get("interval95")
        ours = f"{record['ours']:.{digits}f}" + (f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else "") + \
            ("" if record["items"] is None else f", {record['items']:,}" + (
                f"/{record['paper_items']:,}" if record["paper_items"] else "") + " items")
    paper = "" if record["paper"] is None else f" / {record['paper']:.{digits}f}" + (
        "" if record["ours"] is None else f" ({record['difference']:+.{digits}f})")
    return ours + paper + "".join(SYMBOLS[m] for m in record["marks"])


def params_text(name, records, family, row):
    """The # Params cell of a row: the adapter's parameters (ours, from its result file) / the paper's (millions)."""
    ours = next((r["params"] for r in records if r["row"] == row and r.get("params")), None)
    paper = {"1": tables.PARAMS, "hificl-1": tables.HIFICL_PARAMS}.get(name, {}).get(family, {}).get(row)
    return ("-" if ours is None else f"{ours:,}") + ("" if paper is None else f" / {paper} M")


def write(model, out, name, table, of_cell, parsers, printing=False):
    """Assemble the table from its result files and write <out>/<name>.md and .json (and .png for a sweep) where they
    differ from the files there (a read-only finished table prints); print the Markdown. Returns the JSON's dict.
    parsers: train.py's and evaluate.py's parse_args. printing (--print): a table there that shows results these
    files no longer give is kept (kept_table)."""
    family, memo = families.family_of(model), {}
    records = [cell_record(out, name, family, table, key, of_cell[key], parsers, memo) for key in table.cells]
    by_key = {(r["row"], r["column"]): r for r in records}
    numbers = (tables.HIFICL_PAPER if name in tables.HIFICL_PAPER else tables.PAPER).get(name, {})
    paper = tables.FAMILY_NAMES.get(family) if family in numbers else None
    whose = "HiFICL's paper's" if name in tables.HIFICL_PAPER else "the paper's"
    random_weights = model.startswith("tiny-")
    head = (f"{table.name} of {model}" + (" (random weights)" if random_weights else "") +
            f": {table.caption}. Each cell: ours [95% interval], items" +
            (f" / {whose} {paper} (difference)" if paper else " (the paper has no numbers for this backbone)"))
    show_params = table.params
    lines = [head, "", "| | " + ("# Params (ours / paper) | " if show_params else "") +
             " | ".join(tables.TASK_NAMES.get(c, c) for c in table.columns) + " |",
             "|---|" + ("---:|" if show_params else "") + "---:|" * len(table.columns)]
    for row in table.rows:
        cells = [text(by_key[row, c], table.digits) if (row, c) in by_key else "" for c in table.columns]
        lines.append(f"| {tables.TASK_NAMES.get(row, row)} | " +
                     (params_text(name, records, family, row) + " | " if show_params else "") +
                     " | ".join(cells) + " |")
    used = dict.fromkeys(m for r in records for m in r["marks"])
    notes = settings_notes(table)
    lines += [""] + [f"{SYMBOLS[m]} {MARKS[m]}" for m in used] + [f"Note: {n}" for n in notes]
    stem = os.path.join(out, name if name.startswith("figure") else f"table-{name}")
    markdown = "\n".join(lines) + "\n"
    summary = {"table": table.name, "model": model, "family": family, "paper_backbone": paper,
               "random_weights": random_weights, "rows": list(table.rows), "columns": list(table.columns),
               "cells": records, "marks": {m: MARKS[m] for m in used}, "notes": notes}
    before, lost = written(stem, summary)
    if printing and lost:
        print(markdown + f"note: kept {stem}.md and .json, which show {lost} result(s) these files no longer give "
              "(removed, damaged or of other settings since; the notes above name any damaged file): run the table "
              "to evaluate them again")
        return summary
    figure = stem + (".html" if table.figure == "gallery" else ".png")
    if before != (markdown, json.loads(json.dumps(summary))) or table.figure and not os.path.exists(figure):
        files.atomic_write(stem + ".md", lambda f: f.write(markdown.encode()))
        files.write_json(stem + ".json", summary, indent=1)
        if table.figure == "gallery":
            gallery(table, by_key, of_cell, parsers, out, figure)
        elif table.figure:
            draw(table, by_key, figure)
    print(markdown + f"-> {stem}.md, {stem}.json" + (f", {figure}" if table.figure else ""))
    return summary


def settings_notes(table):
    """The footnotes (tables.NOTES) of the table's rows and of its cells' tasks: where it runs other than the paper's
    words, and why."""
    keys = {*table.rows, *(c.task for c in table.cells.values())}
    return [note for key, note in tables.NOTES.items() if key in keys]


def written(stem, summary):
    """The table written before at `stem` as (its Markdown, its JSON's dict) (None if unreadable), and how many of its
    cells with a number `summary` has none for."""
    try:
        with open(stem + ".md", encoding="utf-8") as md, open(stem + ".json", encoding="utf-8") as js:
            before = md.read(), json.load(js)
        ours = {(c["row"], c["column"]) for c in before[1]["cells"] if c["ours"] is not None}
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None, 0
    return before, len(ours - {(c["row"], c["column"]) for c in summary["cells"] if c["ours"] is not None})


def draw(table, by_key, path):
    """A sweep's figure: a line per row over the columns (ours solid, the paper's dotted where it has numbers)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    x = list(range(len(table.columns)))
    for i, row in enumerate(table.rows):
        color = plt.cm.tab10(i % 10)
        ours = [by_key[row, c]["ours"] for c in table.columns]
        paper = [by_key[row, c]["paper"] for c in table.columns]
        ax.plot(x, [float("nan") if v is None else v for v in ours], "o-", color=color, label=row)
        if any(v is not None for v in paper):
            ax.plot(x, [float("nan") if v is None else v for v in paper], "s:", color=color, label=f"{row} (paper)")
    ax.set_xticks(x, table.columns)
    ax.set(title=f"{table.name}: {table.caption}", ylabel="score")
    ax.legend(fontsize=6)
    fig.tight_layout()
    files.atomic_write(path, lambda f: fig.savefig(f, format="png", metadata={"Software": None}))
    plt.close(fig)


GALLERY_QUERIES = 4  # Figure 4: queries shown per task


def gallery(table, by_key, of_cell, parsers, out, path, n=GALLERY_QUERIES):
    """Figure 4 as one self-contained HTML page (images as data URIs): per task (column), the first n queries in id
    order on which the rows' answers differ (lowercased, spaces collapsed), each with its image, question, every
    row's answer (a check where it is one of the references) and the references; only rows with a result count."""
    same = lambda text: " ".join(str(text).lower().split())
    parts = [f"<h1>{html.escape(table.name)}: {html.escape(table.caption)}</h1>",
             f"<p>Per task, the first {n} queries in id order on which the answers differ.</p>"]
    for task in table.columns:
        rows = [r for r in table.rows if by_key[r, task]["ours"] is not None]
        said = {r: predictions(os.path.join(out, by_key[r, task]["result"])) for r in rows}
        items = {it.id: it for it in tasks.eval_items(of_cell[rows[0], task].args(parsers))} if rows else {}
        chosen = [i for i in sorted(set(items).intersection(*said.values())) if len({same(said[r][i][0])
                                                                                     for r in rows}) > 1][:n]
        parts.append(f"<h2>{html.escape(tables.TASK_NAMES.get(task, task))}</h2>" +
                     ("" if chosen else "<p>No query yet on which the answers differ.</p>"))
        for i in chosen:
            it, references = items[i], "; ".join(dict.fromkeys(said[rows[0]][i][1]))
            answers = "".join(f"<tr><th>{html.escape(r)}</th><td>{html.escape(said[r][i][0])}" +
                              (" &#10003;" if same(said[r][i][0]) in map(same, said[r][i][1]) else "") + "</td></tr>"
                              for r in rows)
            parts.append(f"<figure><img src=\"{data_uri(it.image_path)}\" alt=\"query {html.escape(str(i))}\">"
                         f"<figcaption><p><b>{html.escape(it.question)}</b> (id {html.escape(str(i))})</p><table>"
                         f"{answers}<tr><th>references</th><td>{html.escape(references)}</td></tr>"
                         "</table></figcaption></figure>")
    page = ("<!doctype html><html><head><meta charset=\"utf-8\"><title>" + html.escape(table.name) + "</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:auto}figure{display:flex;gap:1em;"
            "border-top:1px solid #ccc;padding-top:1em}img{max-width:20em;max-height:20em}th{text-align:left;"
            "padding-right:1em}</style></head><body>" + "\n".join(parts) + "</body></html>\n")
    files.atomic_write(path, lambda f: f.write(page.encode()))


def predictions(path):
    """{item id: (prediction, references)} of the predictions beside an evaluation's metrics at `path`."""
    with open(path.removesuffix(".metrics.json") + ".predictions.jsonl", encoding="utf-8") as f:
        return {p["id"]: (p["prediction"], p["references"]) for p in map(json.loads, f)}


def data_uri(image_path):
    """An image file as a data URI."""
    with open(image_path, "rb") as f:
        encoded = base64.b64encode(f.read()).decode()
    return f"data:{mimetypes.guess_type(image_path)[0] or 'image/jpeg'};base64,{encoded}"
