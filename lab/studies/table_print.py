"""A table beside the paper's (evaluate.py --table N [--print]): each cell assembled from its result file alone (our
number, its 95% interval where the metric allows one, the items scored, the adapter's parameters and the run that
made it), the paper's number and the difference, marks on what is not a result; written as Markdown and JSON (and a
figure for a sweep) in the backbone's folder."""
import glob
import json
import os

from lab.disk import files
from lab.datasets import tasks
from lab.models import families
from lab.scores import results
from lab.studies import tables

MARKS = {  # what a mark on a cell says
    "chance": "not a result: n-shot ICL at chance (at most the most frequent answer's share + 5 points): the backbone "
              "does not learn in context here, so nothing distilled from it can show anything",
    "subset": "a subset smaller than the paper's evaluation (items: ours / the paper's)",
    "queries": "the adapter trained on fewer queries than the paper's 1,000",
    "missing": "no result yet: run the table's command (it continues where it stopped)",
    "extra": "a row the paper does not hold (the project's)"}
SYMBOLS = {"chance": "†", "subset": "‡", "queries": "§", "missing": "?", "extra": "*"}


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


def cell_record(out, name, family, table, key, job, parsers):
    """One cell: ours, the paper's, the difference, items (ours, the paper's), interval, parameters, marks."""
    (row, column), cell = key, table.cells[key]
    path, m = found(job, parsers)
    paper = tables.published(name, family, row, column)
    record = {"row": row, "column": column, "paper": paper, "paper_items": tables.PAPER_ITEMS.get(cell.task),
              "marks": ["extra"] if row in table.extra else []}
    if m is None:
        return record | {"ours": None, "marks": record["marks"] + ["missing"]}
    metric = results.headline_metric(m)
    record |= {"metric": metric, "ours": m[metric], "items": m["n"], "interval95": m.get("interval95"),
               "params": m.get("params"), "difference": None if paper is None else m[metric] - paper,
               "result": os.path.relpath(path, out)}
    if cell.train is None and m["shots"] and metric != "cider" and "chance" in m and m[metric] <= m["chance"] + 5:
        record["marks"].append("chance")
    if record["paper_items"] and m["n"] < record["paper_items"]:
        record["marks"].append("subset")
    if (m.get("run") or {}).get("n_train", 1000) < 1000:
        record["marks"].append("queries")
    return record


def text(record):
    """A cell as the Markdown table shows it: ours [interval] / the paper's (difference), items, marks."""
    if record["ours"] is None:
        ours = "-"
    else:
        interval = record.get("interval95")
        ours = f"{record['ours']:.2f}" + (f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else "") + \
            f", {record['items']:,}" + (f"/{record['paper_items']:,}" if record["paper_items"] else "") + " items"
    paper = "" if record["paper"] is None else f" / {record['paper']:.2f}" + (
        "" if record["ours"] is None else f" ({record['difference']:+.2f})")
    return ours + paper + "".join(SYMBOLS[m] for m in record["marks"])


def params_text(table, records, family, row):
    """The # Params cell of a row: the adapter's parameters (ours, from its result file) / the paper's (millions)."""
    ours = next((r["params"] for r in records if r["row"] == row and r.get("params")), None)
    paper = tables.PARAMS.get(family, {}).get(row) if table.name == "Table 1" else None
    return ("-" if ours is None else f"{ours:,}") + ("" if paper is None else f" / {paper} M")


def write(model, out, name, table, of_cell, parsers, printing=False):
    """Assemble the table from its result files and write <out>/<name>.md and .json (and .png for a sweep) where they
    differ from the files there (a read-only finished table prints); print the Markdown. Returns the JSON's dict.
    parsers: train.py's and evaluate.py's parse_args. printing (--print): a table there that shows results these
    files no longer give is kept (kept_table)."""
    family = families.family_of(model)
    records = [cell_record(out, name, family, table, key, of_cell[key], parsers) for key in table.cells]
    by_key = {(r["row"], r["column"]): r for r in records}
    paper = tables.FAMILY_NAMES.get(family) if name in tables.PAPER and family in tables.PAPER[name] else None
    random_weights = model.startswith("tiny-")
    head = (f"{table.name} of {model}" + (" (random weights)" if random_weights else "") +
            f": {table.caption}. Each cell: ours [95% interval], items" +
            (f" / the paper's {paper} (difference)" if paper else " (the paper has no numbers for this backbone)"))
    show_params = table.params
    lines = [head, "", "| | " + ("# Params (ours / paper) | " if show_params else "") +
             " | ".join(tables.TASK_NAMES.get(c, c) for c in table.columns) + " |",
             "|---|" + ("---:|" if show_params else "") + "---:|" * len(table.columns)]
    for row in table.rows:
        cells = [text(by_key[row, c]) if (row, c) in by_key else "" for c in table.columns]
        lines.append(f"| {tables.TASK_NAMES.get(row, row)} | " +
                     (params_text(table, records, family, row) + " | " if show_params else "") +
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
    if before != (markdown, json.loads(json.dumps(summary))) or table.figure and not os.path.exists(stem + ".png"):
        files.atomic_write(stem + ".md", lambda f: f.write(markdown.encode()))
        files.write_json(stem + ".json", summary, indent=1)
        if table.figure:
            draw(table, by_key, stem + ".png")
    print(markdown + f"-> {stem}.md, {stem}.json" + (f", {stem}.png" if table.figure else ""))
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
