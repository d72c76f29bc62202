"""The paper's tables in one command (lab/studies/tables.py and its runner, printer and plan): the published numbers
against the paper's own table text, the layouts, and --table on the tiny twins at rehearsal size."""
import dataclasses
import os

import pytest

import benchmarks
import data as D
import evaluate
import train
from lab.datasets import tasks
from lab.studies import tables

PAPER_TEXT = os.path.join(os.path.dirname(tables.__file__), "paper-tables.txt")

# The paper's words for a backbone and a task, as its tables write them
FAMILIES = {"Idefics-9b": "idefics", "Idefics2-8b": "idefics2", "Idefics2-8B-base": "idefics2",
            "LLaVA-Interleave-7B": "llava-interleave", "LLaVA-OneVision (Qwen2-7B)": "llava-onevision"}
TASKS = {"VQAv2": "vqav2", "OK-VQA": "ok-vqa", "COCO": "coco", "Flickr30k": "flickr30k", "MME": "mme", "SEED": "seed"}
OBJECTIVES = {  # Table 4's headers
    r"$\bm{\mathcal{L}_{\mathrm{sup}}}$": "L_sup",
    r"$\bm{\mathcal{L}_{\mathrm{sup}}\mathbin{\scalebox{0.8}{$+$}}\mathcal{L}_{\mathrm{L_{2}\text{-}anchor}}}$":
        "L_sup + L_L2-anchor",
    r"$\bm{\mathcal{L}_{\mathrm{H\text{-}anchor}}}$": "L_H-anchor",
    r"$\bm{\mathcal{L}_{\mathrm{sup}}\mathbin{\scalebox{0.8}{$+$}}\mathcal{L}_{\mathrm{H\text{-}anchor}}}$":
        "L_sup + L_H-anchor"}


def paper_blocks():
    """{table number: (header cells, rows of cells)} of paper-tables.txt, an empty leading cell filled from the row
    above (the paper's merged cells)."""
    blocks = {}
    for block in open(PAPER_TEXT, encoding="utf-8").read().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith("#")]
        if not lines:
            continue
        number = lines[0].split(":")[0].removeprefix("Table ")
        header, rows, above = lines[1].split("\t"), [], []
        for line in lines[2:]:
            cells = line.split("\t")
            cells = [c or (above[k] if k < len(above) else c) for k, c in enumerate(cells)]
            rows.append(cells)
            above = cells
        blocks[number] = header, rows
    return blocks


def parsed():
    """The numbers of paper-tables.txt as {table: {family: {(row, column): value}}} and Table 1's # Params
    {family: {row: millions}}, read with the paper's own labels mapped by hand (FAMILIES, TASKS, OBJECTIVES)."""
    numbers, params = {}, {}
    for number, (header, rows) in paper_blocks().items():
        for cells in rows:
            if number == "1":
                family, row, values, columns = FAMILIES[cells[0]], cells[2], cells[4:], header[4:]
                if cells[3] != "-":
                    params.setdefault(family, {})[row] = float(cells[3].split(" ")[0])
            elif number in ("2", "7"):
                family, row, values, columns = FAMILIES[cells[0]], cells[1], cells[2:], header[2:]
            elif number == "3":  # Tables 3, 4 and 11 are Idefics-9b's (their captions, Table 11's Hyper-ICL row)
                family, row, values, columns = "idefics", f"{cells[0]} {cells[1]}", cells[2:], header[2:]
            elif number == "4":
                family, row, values = "idefics", TASKS[cells[0]], cells[1:]
                columns = [OBJECTIVES.get(h, h) for h in header[1:]]
            elif number == "8":
                family, row, values, columns = "idefics2", f"{TASKS[cells[0]]} -> {TASKS[cells[1]]}", cells[2:], \
                    header[2:]
            else:
                family, row, values, columns = "idefics", cells[0].replace("$", ""), cells[1:], header[1:]
            table = numbers.setdefault(number, {}).setdefault(family, {})
            for column, value in zip(columns, values, strict=True):
                table[row, TASKS.get(column, column)] = float(value)
    return numbers, params


def test_the_published_numbers_are_the_papers_text():
    numbers, params = parsed()
    assert numbers == tables.PAPER and params == tables.PARAMS
    assert sum(len(cells) for table in numbers.values() for cells in table.values()) == 132


def test_every_published_number_has_its_cell_and_cells_with_one_command_have_one_number():
    """Each number of PAPER sits in a cell of its table's layout; two cells of any tables that run the same commands
    (Table 4's zero-shot is Table 1's, Table 8's zero-shot on OK-VQA is Table 1's, on Flickr30k Table 2's) hold the
    same published number."""
    by_cell = {}
    for name, families in tables.PAPER.items():
        for family, cells in families.items():
            table = tables.layout(name, family)
            assert set(cells) <= set(table.cells), (name, family, set(cells) - set(table.cells))
            for key, value in cells.items():
                by_cell.setdefault((family, table.cells[key]), set()).add(value)
    assert {k: v for k, v in by_cell.items() if len(v) > 1} == {}
    assert len([v for v in by_cell.values()]) < 132  # some cells are shared between tables


def test_the_other_tables_name_their_mode():
    with pytest.raises(ValueError, match="--benchmark"):
        tables.layout("6", "idefics2")
    with pytest.raises(ValueError, match="no table '12'"):
        tables.layout("12", "idefics2")


# -----------------------------------------------------------------------------
# --icd-task (Table 8): the query from one task, its ICDs from another's training split


def test_icd_task_draws_from_the_other_tasks_training_split_with_ids_apart():
    flags = ["--model", "tiny-idefics2", "--task", "ok-vqa", "--icd-task", "vqav2", "--data-root", benchmarks.ROOT]
    args = evaluate.parse_args([*flags, "--shots", "2"])
    vqav2 = tasks.load_task("vqav2", "train", benchmarks.ROOT)
    support = tasks.icd_support(args)
    assert [(it.id, it.image_path, it.question) for it in support] == \
        [(f"vqav2:{it.id}", it.image_path, it.question) for it in vqav2]
    assert tasks.split_pool(train.parse_args([*flags, "--n-train", "2"]), "idefics2")[2] == support  # the teacher's
    query = dataclasses.replace(tasks.load_task("ok-vqa", "val", benchmarks.ROOT)[0], id=vqav2[0].id)  # one number
    drawn = [d.id for seed in range(8) for d in D.demonstrations([query.id], support[:3], 2, seed)[0]]
    assert f"vqav2:{query.id}" in drawn  # an ICD of another task is never taken for the query it shares a number with
    assert tasks.icd_support(evaluate.parse_args([*flags[:4], "--data-root", benchmarks.ROOT])) == \
        tasks.load_task("ok-vqa", "train", benchmarks.ROOT)  # no --icd-task: the query's own training split


def test_icd_task_evaluation_records_its_source_and_refuses_another_kind(tmp_path, capsys):
    flags = ["--model", "tiny-idefics2", "--task", "ok-vqa", "--data-root", benchmarks.ROOT, "--n-eval", "2",
             "--shots", "2", "--out", str(tmp_path)]
    metrics = evaluate.main([*flags, "--icd-task", "vqav2"])
    assert metrics["icd_task"] == "vqav2" and metrics["setting"] == "2-shot"
    assert os.path.exists(tmp_path / "ok-vqa-val-2-shot-icds-vqav2-seed0-n2.metrics.json")
    with pytest.raises(SystemExit):
        evaluate.parse_args([*flags, "--icd-task", "coco"])
    assert "--icd-task coco is a caption task and --task ok-vqa a vqa one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--task", "ok-vqa", "--icd-task", "vqav2"])
    assert "--icd-task draws the ICDs of n-shot ICL" in capsys.readouterr().err
