"""The paper's tables in one command (lab/studies/tables.py, table_runs.py, table_print.py): the published numbers
against the paper's own table text, the layouts, --table on the tiny twins at rehearsal size, --gpus, --print and
the flags a table takes."""
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

import benchmarks
import data as D
import evaluate
import train
from helpers import lab, lab_args, lab_evaluate, lab_evaluate_args, lab_train, lab_train_args, QUIET, refused
from lab.datasets import readers, tasks
from lab.disk import files
from lab.methods import registry
from lab.models import backbones
from lab.run import adapter_files, locks, runs, training_batches
from lab.scores import results
from lab.studies import analyses, efficiency, table_print, table_runs, tables


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


T10_HEADERS = {r"$\boldsymbol{\mathrm{Corr}(g,\Delta A)}$": "Corr(g, Delta A)"}  # Table 10's last header


def paper_blocks():
    """{table number: (header cells, rows of cells)} of paper-tables.txt, an empty leading cell filled from the row
    above (the paper's merged cells); Figure 3a's sentence: {"figure-3a": ([the sentence], [])}."""
    blocks = {}
    for block in open(PAPER_TEXT, encoding="utf-8").read().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith("#")]
        if not lines:
            continue
        if lines[0].startswith("Figure 3a (in the text): "):
            blocks["figure-3a"] = [lines[0].removeprefix("Figure 3a (in the text): ")], []
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
            elif number == "9":  # "$0.228\pm 0.014$": mean and std (Idefics2-8B-base, its caption)
                family, row, columns = "idefics2", cells[0], ["mean", "std"]
                values = cells[1].strip("$").split(r"\pm ")
            elif number in ("5", "6", "10"):  # 5: Idefics-9b (its 32-ICL), 6: Idefics2 (8/16/32-shot), 10: its caption
                family, row, values = {"5": "idefics", "6": "idefics2", "10": "idefics"}[number], \
                    TASKS.get(cells[0], cells[0]), cells[1:]
                columns = [T10_HEADERS.get(h, h.replace("$", "")) for h in header[1:]]
            else:
                family, row, values, columns = "idefics", cells[0].replace("$", ""), cells[1:], header[1:]
            table = numbers.setdefault(number, {}).setdefault(family, {})
            for column, value in zip(columns, values, strict=True):
                table[row, TASKS.get(column, column)] = float(value)
    (sentence,), _ = paper_blocks()["figure-3a"]  # "reaching $60.9$, $62.1$, and $62.2$ for $r{=}2,4,8$"
    ranks = re.search(r"\$r\{=\}([\d,]+)\$", sentence).group(1).split(",")
    numbers["figure-3a"] = {"idefics": {("Hyper-ICL", r): float(v) for r, v in zip(
        ranks, re.findall(r"\$(\d+\.\d+)\$", sentence), strict=True)}}
    return numbers, params


def test_the_published_numbers_are_the_papers_text():
    numbers, params = parsed()
    assert numbers == tables.PAPER and params == tables.PARAMS
    assert sum(len(cells) for table in numbers.values() for cells in table.values()) == 132 + 24 + 10 + 6 + 8 + 3


def test_every_published_number_has_its_cell_and_cells_with_one_command_have_one_number():
    """Each number of PAPER sits in a cell of its table's layout; two cells of any tables that run the same commands
    (Table 4's zero-shot is Table 1's, Table 8's zero-shot on OK-VQA is Table 1's, on Flickr30k Table 2's) hold the
    same published number, to the fewer decimals of the two (Figure 3a's in-text 62.1 is Table 1's 62.08)."""
    by_cell = {}
    for name, families in tables.PAPER.items():
        for family, cells in families.items():
            table = tables.layout(name, family)
            assert set(cells) <= set(table.cells), (name, family, set(cells) - set(table.cells))
            for key, value in cells.items():
                by_cell.setdefault((family, table.cells[key]), set()).add(value)
    decimals = lambda v: min(len(repr(x).split(".")[1]) for x in v)
    assert {k: v for k, v in by_cell.items() if len({round(x, decimals(v)) for x in v}) > 1} == {}
    assert len([v for v in by_cell.values()]) < 183  # some cells are shared between tables
    assert by_cell["idefics", tables.layout("figure-3a", "idefics").cells["Hyper-ICL", "4"]] == {62.08, 62.1}


def test_tables_5_6_9_10_and_figure_4_share_the_work_of_tables_1_and_4(tmp_path):
    """Each job of Table 5 and Figure 4 is one of Table 1's (CHAIR: its COCO evaluations, read again); Tables 6, 9
    and 10 train nothing that Tables 1 and 4 do not (their studies measure those adapters)."""
    args = lab_args(table("1", "tiny-idefics", tmp_path))
    jobs = lambda name: {(j.script, j.argv) for j in table_runs.table_jobs(  # (which run computes a teacher: the
        args, lab_evaluate_args([]), lab_train_args, tables.layout(name, "idefics"))[1]}  # table's first, its own)
    one, four = jobs("1"), jobs("4")
    assert jobs("5") < one and jobs("figure-4") < one and len(jobs("5")) == 4 + 8  # 4 trainings, 8 evaluations
    for name, study, count in (("6", "benchmark", 1), ("9", "hyperbolicity", 2), ("10", "gates", 2)):
        studies = {j for j in jobs(name) if j[0] != "train.py"}
        assert jobs(name) - studies <= one | four and {j[0] for j in studies} == {study} and \
            len(studies) == count
    with pytest.raises(ValueError, match="no table '12'"):
        tables.layout("12", "idefics2")


HIFICL_TEXT = os.path.join(os.path.dirname(tables.__file__), "hificl-tables.txt")


HIFICL_BLOCKS = {  # hificl-tables.txt's captions (the summary's words): (table, backbone family)
    "在 LLaVA-Interleave-7b 上的性能对比：": ("hificl-1", "llava-interleave"),
    "在 Idefics2-8b-base 上的性能对比：": ("hificl-1", "idefics2"), "在 Idefics2 上的组件消融：": ("hificl-ablation", "idefics2")}


HIFICL_ROWS = {"HiFICL (完整)": "HiFICL", "+ Teacher（加教师）": "+ teacher alignment",  # its ablation's rows
               "- LoRA on K（去 K 低秩）": "K without low-rank", "- LoRA on V（去 V 低秩）": "V without low-rank",
               r"w/o SA scaling (\(\alpha=1\))": "alpha = 1"}


def test_hificls_published_numbers_are_its_papers_text():
    """HIFICL_PAPER and HIFICL_PARAMS against hificl-tables.txt, its rows and columns mapped by hand, its COCO CIDEr
    (1.2951) x 100 as this project prints it, an ablation's difference in parentheses left out."""
    numbers, params = {}, {}
    for block in open(HIFICL_TEXT, encoding="utf-8").read().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith("#")]
        if not lines:
            continue
        name, family = HIFICL_BLOCKS[lines[0]]
        header = [TASKS[h.removesuffix(" CIDEr")] for h in lines[1].split("\t")[-3:]]
        for cells in (line.split("\t") for line in lines[2:]):
            row = HIFICL_ROWS.get(cells[0], cells[0])
            if name == "hificl-1" and cells[1] != "-":
                params.setdefault(family, {})[row] = float(cells[1])
            for column, value in zip(header, cells[-3:], strict=True):
                value = float(value.split(" ")[0])
                numbers.setdefault(name, {}).setdefault(family, {})[row, column] = \
                    round(value * 100, 2) if column == "coco" else value
    assert numbers == tables.HIFICL_PAPER and params == tables.HIFICL_PARAMS
    assert sum(len(cells) for table in numbers.values() for cells in table.values()) == 12 + 6 + 15


def test_hificl_runs_at_its_papers_rank_per_task_and_its_numbers_stand_in_their_cells():
    """HiFICL's rank: 8 on VQAv2 (the registry's default, unnamed), 16 on OK-VQA, 8 on COCO, in Table 1, its own
    tables and the robustness table alike (one run a task, shared); each of its published numbers has its cell,
    Table 1's HiFICL row shows HiFICL's Idefics2 number (before: none), and the ablation's rows are its methods."""
    assert registry.METHODS["hificl"].rank == 8
    layouts = {name: tables.layout(name, "idefics2") for name in ("1", "hificl-1", "hificl-ablation", "robustness")}
    for task, rank in (("vqav2", ()), ("ok-vqa", ("--rank", "16")), ("coco", ())):
        run = ("--method", "hificl", *rank)
        assert layouts["1"].cells["HiFICL", task].train == layouts["hificl-1"].cells["HiFICL", task].train == run
        assert layouts["hificl-ablation"].cells["alpha = 1", task].train == ("--method", "hificl-linear", *rank)
        assert layouts["robustness"].cells["HiFICL", f"{tables.TASK_NAMES[task]} 8-shot"] == \
            tables.Cell(task, ("--shots", "8"), run)
    assert set(tables.HIFICL_ABLATION.values()) <= set(registry.METHODS)
    for name, families in tables.HIFICL_PAPER.items():
        for family, cells in families.items():
            assert set(cells) <= set(tables.layout(name, family).cells), (name, family)
    assert tables.published("1", "idefics2", "HiFICL", "coco") == 129.51
    assert tables.published("1", "idefics", "HiFICL", "coco") is None  # HiFICL's paper has no Idefics-9b
    assert tables.published("1", "idefics2", "MimIC", "coco") == 132.87  # the Hyper-ICL paper's, not HiFICL's 128.27


def test_icd_task_draws_from_the_other_tasks_training_split_with_ids_apart():
    flags = ["--model", "tiny-idefics2", "--task", "ok-vqa", "--icd-task", "vqav2", "--data-root", benchmarks.ROOT]
    args = lab_evaluate_args([*flags, "--shots", "2"])
    vqav2 = tasks.load_task("vqav2", "train", benchmarks.ROOT)
    support = tasks.icd_support(args)
    assert [(it.id, it.image_path, it.question) for it in support] == \
        [(f"vqav2:{it.id}", it.image_path, it.question) for it in vqav2]
    assert tasks.split_pool(lab_train_args([*flags, "--n-train", "2"]), "idefics2")[2] == support  # the teacher's
    query = dataclasses.replace(tasks.load_task("ok-vqa", "val", benchmarks.ROOT)[0], id=vqav2[0].id)  # one number
    drawn = [d.id for seed in range(8) for d in D.demonstrations([query.id], support[:3], 2, seed)[0]]
    assert f"vqav2:{query.id}" in drawn  # an ICD of another task is never taken for the query it shares a number with
    assert tasks.icd_support(lab_evaluate_args([*flags[:4], "--data-root", benchmarks.ROOT])) == \
        tasks.load_task("ok-vqa", "train", benchmarks.ROOT)  # no --icd-task: the query's own training split


def test_icd_task_evaluation_records_its_source_and_refuses_another_kind(tmp_path, capsys):
    flags = ["--model", "tiny-idefics2", "--task", "ok-vqa", "--data-root", benchmarks.ROOT, "--n-eval", "2",
             "--shots", "2", "--out", str(tmp_path)]
    metrics = lab_evaluate([*flags, "--icd-task", "vqav2"])
    assert metrics["icd_task"] == "vqav2" and metrics["setting"] == "2-shot"
    assert os.path.exists(tmp_path / "ok-vqa-val-2-shot-icds-vqav2-seed0-n2.metrics.json")
    with pytest.raises(SystemExit):
        lab_evaluate_args([*flags, "--icd-task", "coco"])
    assert "--icd-task coco is a caption task and --task ok-vqa a vqa one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lab_evaluate_args(["--task", "ok-vqa", "--icd-task", "vqav2"])
    assert "--icd-task draws the ICDs of n-shot ICL" in capsys.readouterr().err


REHEARSAL = ["--data-root", benchmarks.ROOT, "--n-eval", "2", "--threads", "1", "--workers", "0",
             "--train-args", "--n-train 2 --n-heldout 1 --epochs 1 --batch-size 2 --workers 0",
             "--vector-sets", "2", "--vector-heldout", "1", "--fv-heads", "2", "--fv-trials", "1"]


class Counted:
    """The work a table's run does, counted where it is done: backbone loads, the teacher's queries (also per query
    and tensor), optimiser steps, held-out queries scored, generate calls' items, prompt tokens and new tokens."""

    def __init__(self, monkeypatch):
        self.work = dict.fromkeys(("backbone_loads", "teacher_passes", "teacher_tokens", "steps", "heldout_forwards",
                                   "items", "prompt_tokens", "generated"), 0)
        self.teacher, self.studies = {}, []  # the studies run (Tables 6, 9, 10), by name
        load, run_teacher, pair, step, heldout, generate = (backbones.load_backbone, train.run_teacher,
                                                            training_batches.pair, runs.step, runs.heldout_loss,
                                                            evaluate.generate)
        analysis, benchmark = analyses.analysis, efficiency.benchmark
        monkeypatch.setattr(analyses, "analysis", lambda backbone, args, *a: self.studies.append(
            "gates" if args.gates else "hyperbolicity") or analysis(backbone, args, *a))
        monkeypatch.setattr(efficiency, "benchmark", lambda *a: self.studies.append("benchmark") or benchmark(*a))

        def counting_load(*a, **k):
            self.work["backbone_loads"] += 1
            return load(*a, **k)

        def counting_teacher(backbone, batch, output="states"):
            self.work["teacher_passes"] += len(batch["labels"])
            self.work["teacher_tokens"] += int(batch["attention_mask"].sum())
            return run_teacher(backbone, batch, output)

        def counting_pair(run, prepared, computed):
            missing = [q for q, s in zip(prepared["queries"], prepared["found"]["states"]) if s is None] \
                if prepared["found"] else []
            for q in missing:  # per query and tensor (states; LIVE's logits): the teacher computed it
                self.teacher[q.id, run.cache["output"]] = self.teacher.get((q.id, run.cache["output"]), 0) + 1
            return pair(run, prepared, computed)

        def counting_step(run, parts):
            self.work["steps"] += 1
            return step(run, parts)

        def counting_heldout(run):
            self.work["heldout_forwards"] += len(run.heldout)
            return heldout(run)

        def counting_generate(backbone, inputs, max_new_tokens, min_new_tokens=0):
            tokens = generate(backbone, inputs, max_new_tokens, min_new_tokens)
            stop = torch.isin(tokens, torch.tensor(backbones.stop_ids(backbone)))
            ends = torch.where(stop.any(1), stop.int().argmax(1) + 1, tokens.shape[1])
            self.work["items"] += len(tokens)
            self.work["prompt_tokens"] += int(inputs["attention_mask"].sum())
            self.work["generated"] += int(ends.sum())
            return tokens
        for target, name, fake in ((backbones, "load_backbone", counting_load),
                                   (train, "run_teacher", counting_teacher), (training_batches, "pair", counting_pair),
                                   (runs, "step", counting_step),
                                   (runs, "heldout_loss", counting_heldout), (evaluate, "generate", counting_generate)):
            monkeypatch.setattr(target, name, fake)


def table(name, model, out, *extra):
    """python -m lab table N / figure N: the words and flags of a rehearsal run."""
    which = ["figure", name.removeprefix("figure-")] if name.startswith("figure") else ["table", name]
    return [*which, "--model", model, "--out", str(out), *REHEARSAL, *extra]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """Tables 1, 2, 8, 5, 9, 6 and Figure 4 of tiny-idefics2 in one folder and Tables 4 and 10 of tiny-idefics in
    another, each run with its work counted (Counted), Tables 1, 8, 9 and 6 twice: {name: [(counts, printed JSON) of
    each run]}, and the folders."""
    root, done = tmp_path_factory.mktemp("tables"), {}
    two, one = root / "idefics2", root / "idefics"
    for name, model, out in (("1", "tiny-idefics2", two), ("2", "tiny-idefics2", two), ("8", "tiny-idefics2", two),
                             ("4", "tiny-idefics", one), ("5", "tiny-idefics2", two),
                             ("figure-4", "tiny-idefics2", two), ("9", "tiny-idefics2", two),
                             ("6", "tiny-idefics2", two), ("10", "tiny-idefics", one)):
        runs_of = []
        for _ in range(2 if name in ("1", "8", "9", "6") else 1):
            with pytest.MonkeyPatch.context() as m:
                counted = Counted(m)
                printed = lab(table(name, model, out))
            runs_of.append((counted, printed))
        done[name] = runs_of
    return done, root


def test_a_table_does_each_piece_of_work_once_and_a_second_run_does_none(rehearsal):
    done, _ = rehearsal
    (first, printed), (again, reprinted) = done["1"]
    assert first.work["backbone_loads"] == 1 and again.work["backbone_loads"] == 1
    # the teacher of a task: once for Hyper-ICL, MimIC (states) and LIVE (logits) alike; 3 tasks x 2 queries
    assert set(first.teacher.values()) == {1} and first.work["teacher_passes"] == 3 * 2
    assert len(first.teacher) == 3 * 2  # one pass a query, whichever method ran it (LIVE, the first): the others read
    assert first.work["steps"] == 5 * 3  # LoRA, LIVE, MimIC, Hyper-ICL, HiFICL on 3 tasks: 2 queries, 1 step each
    assert first.work["items"] == 10 * 3 * 2  # every cell evaluated once, on 2 items
    for name in ("1", "8"):
        (_, printed), (again, reprinted) = done[name]
        assert {k: v for k, v in again.work.items() if k != "backbone_loads"} == dict.fromkeys(
            ("teacher_passes", "teacher_tokens", "steps", "heldout_forwards", "items", "prompt_tokens", "generated"), 0)
        assert reprinted == printed
    assert all(c["ours"] is not None or c["marks"] == ["undefined"] for runs_of in done.values()
               for c in runs_of[0][1]["cells"])
    (eight, printed), _ = done["8"]  # its zero-shots are Tables 1's and 2's, its adapters Table 1's runs
    assert eight.work["steps"] == 0 and eight.work["teacher_passes"] == 0 and eight.work["items"] == 4 * 2
    (four, _), = done["4"]  # Idefics: L_sup + L_H, L_sup + L_2 and L_H alone share one teacher (32 ICDs) a task
    assert set(four.teacher.values()) == {1} and four.work["teacher_passes"] == 2 * 2


def test_the_printed_table_stands_beside_the_papers(rehearsal):
    done, root = rehearsal
    (_, printed), _ = done["1"]
    cell = {(c["row"], c["column"]): c for c in printed["cells"]}
    assert printed["paper_backbone"] == "Idefics2-8b" and printed["random_weights"]
    hyper = cell["Hyper-ICL", "vqav2"]
    assert hyper["paper"] == 71.17 and hyper["difference"] == hyper["ours"] - 71.17 and hyper["items"] == 2
    assert hyper["paper_items"] == 10_000 and {"subset", "queries"} <= set(hyper["marks"])
    assert hyper["params"] == 4 * 2 * (2 * 16 * 4 + 16 + 1)  # 2 layers x 4 heads of 16, r = 4 (Eq 6, 9)
    assert len(hyper["interval95"]) == 2 and cell["Zero-shot", "coco"]["interval95"] is None  # CIDEr: none
    assert "chance" in cell["8-shot ICL", "vqav2"]["marks"] and cell["HiFICL", "coco"]["marks"][0] == "extra"
    md = (root / "idefics2" / "table-1.md").read_text()
    assert "| Hyper-ICL | 1,160 / 1.18 M |" in md and "/ 71.17 (" in md and "random weights" in md
    (_, four), = done["4"]
    assert four["paper_backbone"] == "Idefics-9b" and {c["column"] for c in four["cells"]} == set(tables.T4)


def test_tables_5_9_6_10_and_figure_4_measure_only_what_tables_1_and_4_left_and_read_it_back(rehearsal):
    """After Tables 1 and 4: Table 5 and Figure 4 do no work; Table 9 trains the Euclidean-anchor run alone (its
    teacher read from Table 1's cache) and measures two adapters; Table 6 benchmarks once; Table 10 measures the
    gates of Table 4's two Hyper-ICL runs; a second run does nothing and prints the same table. Each cell holds the
    number at its place in its study's file."""
    done, root = rehearsal
    for name in ("5", "figure-4"):
        (ran, _), = done[name]
        assert {k: v for k, v in ran.work.items() if k != "backbone_loads"} == NO_WORK and ran.studies == []
    for name, trained, studies in (("9", 1, ["hyperbolicity"] * 2), ("6", 0, ["benchmark"]), ("10", 0, ["gates"] * 2)):
        ran, printed = done[name][0]
        assert ran.work["steps"] == trained and ran.work["teacher_passes"] == 0 and ran.studies == studies, name
        if name in ("9", "6"):
            (again, reprinted) = done[name][1]
            assert again.studies == [] and again.work["steps"] == 0 and reprinted == printed
    cells = lambda name: {(c["row"], c["column"]): c for c in done[name][0][1]["cells"]}
    study = lambda folder, file: json.loads((folder / "train" / "vqav2" / file).read_text())
    euclidean, hyperbolic = (study(root / "idefics2", f"{run}/hyperbolicity-vqav2-val.json")
                             for run in ("hyper-icl-anchor-euclidean", "hyper-icl"))
    nine = cells("9")
    assert [nine[r, c]["ours"] for r in tables.T9 for c in ("mean", "std")] == [
        hyperbolic["teacher"]["mean"], hyperbolic["teacher"]["std"], euclidean["student"]["mean"],
        euclidean["student"]["std"], hyperbolic["student"]["mean"], hyperbolic["student"]["std"]]
    assert nine[tables.T9[0], "mean"]["paper"] == 0.228 and nine[tables.T9[1], "mean"]["items"] == 2 and \
        nine[tables.T9[1], "std"]["paper_items"] == 1000 and "subset" in nine[tables.T9[1], "std"]["marks"]
    rows = {r["setting"]: r for r in study(root / "idefics2", "hyper-icl/benchmark.json")["rows"]}
    six = cells("6")
    assert [six["Runtime (ms)", c]["ours"] for c in tables.T6] == [rows[s]["prefill_ms"] for s in (
        "hyper-icl", "zero-shot", "8-shot", "16-shot", "32-shot")] and six["FLOPs (T)", "8-shot"]["ours"] == \
        rows["8-shot"]["prefill_tflops"]
    gates, ten = study(root / "idefics", "hyper-icl/gates-vqav2-val.json"), cells("10")
    assert ten["vqav2", "Late-layer mean g"]["ours"] == gates["late_mean"] and ten["vqav2", "Early-layer mean g"][
        "paper"] == 0.38
    assert ten["ok-vqa", "Corr(g, Delta A)"]["marks"] == ["undefined"]  # one step at the warm-up's lr 0: g constant
    assert "Corr(g, Delta A) |" in (root / "idefics" / "table-10.md").read_text()


def test_table_5_counts_chair_on_table_1s_coco_predictions(rehearsal, tmp_path):
    """Hyper-ICL's COCO captions replaced by two of known objects (a triangle where the image has none; a circle
    where it has one): CHAIR_s, CHAIR_i and Recall are 50 each, worked out by hand, and the other columns keep
    theirs."""
    done, root = rehearsal
    moved = shutil.copytree(root / "idefics2", tmp_path / "moved")
    before = {(c["row"], c["column"]): c for c in done["5"][0][1]["cells"]}
    metrics = moved / before["CHAIRs", "Hyper-ICL"]["result"]
    predictions = metrics.with_name(metrics.name.replace(".metrics.json", ".predictions.jsonl"))
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    objects, _ = readers.read_instances(tasks.load_task("coco", "val", benchmarks.ROOT)[:2])
    assert [objects[p["id"]] for p in lines] == [{"circle"}, {"circle"}]  # the toy world's first two images
    captions = ["A triangle.", "A circle."]  # a triangle not there (1 of 1 mentions); a circle found
    text = "".join(json.dumps({**p, "prediction": c}) + "\n" for p, c in zip(lines, captions))
    predictions.write_text(text)
    m = json.loads(metrics.read_text())
    metrics.write_text(json.dumps({**m, "predictions_sha256": hashlib.sha256(text.encode()).hexdigest()}))
    printed = {(c["row"], c["column"]): c for c in lab(table("5", "tiny-idefics2", moved, "--print"))["cells"]}
    assert [printed[r, "Hyper-ICL"]["ours"] for r in ("CHAIRs", "CHAIRi", "Recall")] == [50.0, 50.0, 50.0]
    assert all(printed[k] == before[k] for k in before if k[1] != "Hyper-ICL")
    one = {(c["row"], c["column"]): c for c in done["1"][0][1]["cells"]}
    assert before["CHAIRs", "Z-Shot"]["result"] == one["Zero-shot", "coco"]["result"]  # Table 1's own file


def test_figure_4_shows_the_first_queries_on_which_the_answers_differ(rehearsal):
    """figure-4.html: per task, the first queries in id order whose answers differ between the rows, each with its
    image inline, its question, every row's answer and the references; nothing it needs outside the page."""
    done, root = rehearsal
    page = (root / "idefics2" / "figure-4.html").read_text()
    (_, printed), = done["figure-4"]
    for task in tables.T1[:2]:
        said = [{p["id"]: p["prediction"] for p in map(json.loads, (root / "idefics2" / c["result"].replace(
            ".metrics.json", ".predictions.jsonl")).read_text().splitlines())} for c in printed["cells"]
            if c["column"] == task]
        differ = [i for i in sorted(said[0]) if len({" ".join(s[i].lower().split()) for s in said}) > 1][
            :table_print.GALLERY_QUERIES]
        shown = [int(i) for i in re.findall(r"\(id (\d+)\)", page.split(f"<h2>{tables.TASK_NAMES[task]}</h2>")[1]
                                           .split("<h2>")[0])]
        assert shown == differ and differ
    assert page.count("data:image/") == page.count("<figure>") and "src=\"/" not in page
    assert all(f"<th>{row}</th>" in page for row in printed["rows"]) and "<th>references</th>" in page


def test_hificls_tables_and_the_robustness_table_run_beside_table_1(rehearsal, tmp_path, capsys):
    """In a copy of Table 1's folder (tiny Idefics2): HiFICL's main table does no new work (its cells are Table 1's
    runs); its ablation trains its four variants once a task, + teacher alignment from MimIC's cached teacher; the
    robustness table evaluates each of Table 1's adapters again with 8 ICDs in its prompt: a number for every method,
    task and shots, the n-shot one of an evaluation with the adapter and its ICDs. Table 1 shows HiFICL's published
    number, marked as HiFICL's paper's."""
    done, root = rehearsal
    folder = shutil.copytree(root / "idefics2", tmp_path / "idefics2")
    counts = {}
    for name in ("hificl-1", "hificl-ablation", "robustness"):
        with pytest.MonkeyPatch.context() as m:
            counted = Counted(m)
            printed = lab(table(name, "tiny-idefics2", folder))
        counts[name] = (counted.work, printed)
        assert all(c["ours"] is not None for c in printed["cells"]), name
    main, ablation, robust = (counts[n][0] for n in ("hificl-1", "hificl-ablation", "robustness"))
    assert {k: v for k, v in main.items() if k != "backbone_loads"} == NO_WORK
    assert ablation["steps"] == 4 * 3 and ablation["teacher_passes"] == 0 and ablation["items"] == 4 * 3 * 2
    assert robust["steps"] == 0 and robust["items"] == 5 * 3 * 2  # the n-shot cells alone: 0-shot is Table 1's
    cells = {(c["row"], c["column"]): c for c in counts["robustness"][1]["cells"]}
    assert len(cells) == 5 * 3 * 2
    for method in tables.ROBUST:
        alone, with_icds = cells[method, "OK-VQA 0-shot"], cells[method, "OK-VQA 8-shot"]
        metrics = json.load(open(folder / with_icds["result"], encoding="utf-8"))
        assert (metrics["shots"], metrics["setting"].split("+")[-1]) == (8, "8-shot") and metrics["checkpoint"]
        assert alone["result"] == next(c["result"] for c in done["1"][0][1]["cells"] if (c["row"], c["column"]) ==
                                       (method, "ok-vqa"))
    assert "HiFICL's paper's" in (folder / "table-hificl-ablation.md").read_text()
    hificl = {(c["row"], c["column"]): c for c in done["1"][0][1]["cells"]}["HiFICL", "vqav2"]
    assert hificl["paper"] == 72.08 and hificl["marks"][:2] == ["extra", "hificl"]
    assert "¶ the published number is HiFICL's paper's" in (root / "idefics2" / "table-1.md").read_text()


BY_HAND = {  # one cell of each kind of row: table -> its (row, column)
    "1": [("Zero-shot", "vqav2"), ("8-shot ICL", "ok-vqa"), ("RICES", "coco"), ("FV", "vqav2"), ("TV", "ok-vqa"),
          ("LIVE", "coco"), ("MimIC", "vqav2"), ("Hyper-ICL", "coco")],
    "2": [("ICL", "mme"), ("Hyper-ICL", "seed")],
    "8": [("vqav2 -> ok-vqa", "8-shot ICL"), ("coco -> flickr30k", "Hyper-ICL")],
    "4": [("vqav2", "L_sup + L_L2-anchor")]}


def test_every_kind_of_cell_equals_its_single_commands_run_by_hand(rehearsal, tmp_path):
    """A sample, one cell of each kind of row (zero-shot, ICL, RICES, FV, TV, each learnable method's teacher,
    MME and SEED, Table 8's ICDs of another task and its transfer, Table 4's objectives): its printed jobs run as
    single commands by hand, in a fresh process state and folder (the backbone loaded by each), give the same
    adapter and the same predictions, so the same number. (All cells cost 3x the table: a sample.)"""
    done, root = rehearsal
    for name, cells in BY_HAND.items():
        model, folder = ("tiny-idefics", root / "idefics") if name == "4" else ("tiny-idefics2", root / "idefics2")
        args = lab_args(table(name, model, folder))
        layout = tables.layout(name, "idefics" if name == "4" else "idefics2", 2)
        of_cell, jobs = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, layout)
        by_argv = {j.argv: j for j in jobs}
        printed = {(c["row"], c["column"]): c for c in done[name][0][1]["cells"]}
        for key in cells:
            job = of_cell[key]
            here = lambda argv: [a.replace(str(folder), str(tmp_path / name)) for a in argv]
            for before in job.after:
                lab_train(here(before))
                adapter = os.path.join(by_argv[before].args((lab_train_args,)).out, "adapter.safetensors")
                with open(adapter, "rb") as a, open(here([adapter])[0], "rb") as b:
                    assert a.read() == b.read(), key
            metrics = lab_evaluate(here(job.argv))
            assert metrics[results.headline_metric(metrics)] == printed[key]["ours"], key
            ours = os.path.join(folder, printed[key]["result"]).replace(".metrics.json", ".predictions.jsonl")
            with open(ours, "rb") as a, open(here([ours])[0], "rb") as b:
                assert a.read() == b.read(), key


@pytest.mark.parametrize("name, job", [("8", 2), ("9", 4)])
def test_a_table_killed_mid_run_finishes_with_the_same_table_when_run_again(rehearsal, tmp_path, name, job):
    """kill -9 while Table 8's second training runs, or Table 9's second study (a forked copy of this process: the
    same code, no start-up), then the same command: the table, byte for byte, is the uninterrupted run's (the
    fixture's, in another folder)."""
    _, root = rehearsal
    flags = table(name, "tiny-idefics2", tmp_path / "table")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the table's command, its output into the pipe, a line at a time
        sys.stdout = os.fdopen(write, "w", buffering=1)
        try:
            lab(flags)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as lines:
        for line in lines:
            if line.startswith(f"[{job}/"):
                os.kill(pid, signal.SIGKILL)
                break
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL and not (tmp_path / "table" / f"table-{name}.json").exists()
    lab(flags)
    for ending in (".json", ".md"):
        assert (tmp_path / "table" / f"table-{name}{ending}").read_bytes() == \
            (root / "idefics2" / f"table-{name}{ending}").read_bytes()


def test_the_plan_of_a_table_counts_the_work_its_run_did(rehearsal, tmp_path, capsys):
    done, _ = rehearsal
    planned = lab(table("4", "tiny-idefics", tmp_path / "plan", "--plan", "cpu"))
    (ran, _), = done["4"]
    counts = ("backbone_loads", "teacher_passes", "teacher_tokens", "steps", "heldout_forwards", "items",
              "prompt_tokens")
    assert {k: planned[k] for k in counts} == {k: ran.work[k] for k in counts}
    assert ran.work["generated"] <= planned["generated_at_most"] and not (tmp_path / "plan").exists()
    out = capsys.readouterr().out
    assert "GPU-hours (bound / expected) on an H200 SXM" in out and "peak ~" in out and "disk: teacher caches" in out


def test_the_plan_of_a_study_counts_its_forwards(tmp_path, capsys):
    """Table 9's plan: its two hyperbolicity jobs, each a teacher's and a student's forward of its 2 queries, no token
    generated."""
    planned = lab(table("9", "tiny-idefics2", tmp_path / "plan", "--plan", "cpu"))
    out = capsys.readouterr().out
    assert planned["items"] == 2 * 2 and planned["generated_at_most"] == 0 and planned["jobs"] == 4
    assert out.count("  hyperbolicity vqav2 adapter train/vqav2/hyper-icl") == 2 and "none generated" in out


def test_print_reads_the_files_alone_and_the_runs_record_what_makes_their_column(rehearsal, tmp_path, monkeypatch):
    done, root = rehearsal
    before = (root / "idefics2" / "table-8.md").read_bytes()
    counted = Counted(monkeypatch)
    assert lab(table("8", "tiny-idefics2", root / "idefics2", "--print")) == done["8"][0][1]
    assert set(counted.work.values()) == {0} and (root / "idefics2" / "table-8.md").read_bytes() == before
    l2 = root / "idefics" / "train" / "vqav2" / "hyper-icl-anchor-euclidean"
    record = adapter_files.read_record(l2 / "adapter.safetensors")
    assert {k: record[k] for k in ("method", "anchor", "lam", "kappa", "rank", "shots", "icds", "icd_task",
                                   "n_train")} == {"method": "hyper-icl", "anchor": "euclidean", "lam": 0.5,
                                                   "kappa": 0.1, "rank": 4, "shots": 32, "icds": "random",
                                                   "icd_task": None, "n_train": 2}
    assert record["data_root"] == benchmarks.ROOT and set(adapter_files.RESUME_MUST_MATCH) < set(record)
    (metrics,) = [json.loads(p.read_text()) for p in l2.glob("*.metrics.json")]
    assert metrics["run"] == record and metrics["params"] == 2 * 4 * (2 * 16 * 4 + 16 + 1)
    backbone = backbones.load_backbone("tiny-idefics")  # the record is metadata: the same tensors without it
    adapter_files.load_adapter(str(l2 / "adapter.safetensors"), backbone)
    adapter_files.save_adapter(tmp_path / "bare.safetensors", backbone)
    tensors = lambda path: path.read_bytes()[8 + int.from_bytes(path.read_bytes()[:8], "little"):]
    assert tensors(tmp_path / "bare.safetensors") == tensors(l2 / "adapter.safetensors")


def test_print_commands_gives_one_idempotent_line_a_job_in_dependency_order(rehearsal, capsys):
    _, root = rehearsal
    lines = lab(table("4", "tiny-idefics", root / "idefics", "--print-commands"))
    assert capsys.readouterr().out.split("\n")[:-1] == lines and lines[-1].endswith("--print")
    trains = [line for line in lines if line.startswith("python -m lab train ")]
    assert len(trains) == 4 * 2 and all("--proceed" in line for line in trains) and len(lines) == 8 + 10 + 1
    for k, line in enumerate(lines[:-1]):  # an adapter's evaluation after its training
        if "--checkpoint" in line:
            folder = os.path.dirname(shlex.split(line)[shlex.split(line).index("--checkpoint") + 1])
            assert any(f"--out {folder} " in earlier for earlier in lines[:k])


def test_processes_on_several_devices_take_each_job_once_and_wait_for_the_ones_before(tmp_path):
    """run_jobs with claims (--gpus' workers), its commands recorded instead of run: a job another process holds is
    left to it, a job it marked done is not run again, and an adapter's evaluation waits for its training."""
    args = lab_args(table("7", "tiny-idefics2", tmp_path))
    _, jobs = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("7", "idefics2"))
    claims, ran = tmp_path / "claims", []
    claims.mkdir()
    record = lambda argv, load: ran.append(tuple(argv))
    held = next(j for j in jobs if j.script == "evaluate.py" and not j.after)  # zero-shot: another process's
    first = jobs[0]
    (claims / f"{first.key()}.done").write_text("\"done by another process\"")
    with locks.locked(str(claims / held.key())):  # its holder finishes it while this process runs the rest
        threading.Timer(0.5, (claims / f"{held.key()}.done").write_text, ["\"done by its holder\""]).start()
        table_runs.run_jobs(jobs, {"train.py": record, "evaluate.py": record}, str(claims))
    assert first.argv not in ran and held.argv not in ran and len(ran) == len(jobs) - 2
    assert all(ran.index(j.argv) > max((ran.index(a) for a in j.after if a in ran), default=-1)
               for j in jobs if j.argv in ran)


def test_a_sweep_is_a_table_of_cells_with_its_figure(tmp_path):
    """Figure 3a (rank x gate) before any run: every cell named and marked as not run yet, the figure drawn."""
    printed = lab(table("figure-3a", "tiny-idefics2", tmp_path, "--print"))
    assert [(c["row"], c["column"]) for c in printed["cells"]] == [(g, r) for g in tables.GATES for r in tables.RANKS]
    assert all(c["marks"] == ["missing"] for c in printed["cells"]) and (tmp_path / "figure-3a.png").stat().st_size
    layout = tables.layout("figure-2", "idefics", 1000)
    assert layout.columns == ("100", "250", "500", "1000") and layout.cells["VQAv2 LoRA", "1000"].train == \
        ("--method", "lora") and layout.cells["OK-VQA MimIC", "100"].train == ("--method", "mimic", "--n-train", "100")
    assert tables.layout("3", "idefics").cells["VQAv2 Hyper-ICL", "32"].train == ()  # Table 1's run: 32 shots


def test_gpus_names_each_device_of_this_machine_once_counted_as_a_scheduler_lists_them(tmp_path, monkeypatch, capsys):
    table = ["table", "7", *QUIET, "--out", str(tmp_path)]
    assert "names a device twice" in refused(lab_args, [*table, "--gpus", "0,0"], capsys)  # before: 2 on 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "this machine has 2 CUDA device(s) visible (0 to 1)" in refused(lab_args, [*table, "--gpus", "1,2"],
                                                                           capsys)
    assert lab_args([*table, "--gpus", "2,3", "--plan", "cuda"]).gpus == "2,3"  # a plan for other machines
    started = []

    class Process:  # the workers, recorded instead of started
        def __init__(self, argv, env):
            started.append(env["CUDA_VISIBLE_DEVICES"])

        def wait(self):
            return 0
    monkeypatch.setattr(subprocess, "Popen", Process)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a scheduler's share of the machine
    args = lab_args([*table, "--gpus", "0,1"])
    table_runs.on_devices(args.gpus, args.out, [], ["python", "-m", "lab", "table", "7"])
    assert started == ["4", "5"]  # before: "0", "1", devices of another job
    with pytest.raises(ValueError, match=r"--table-worker .*: --gpus gives it to the processes it starts"):
        lab([*table, "--print", "--table-worker", str(tmp_path / "mine")])  # before: nothing printed


def test_a_sharded_table_prints_each_job_as_its_torchrun_line_over_the_devices(tmp_path, monkeypatch, capsys):
    """--gpus 0-1 --shard --print-commands (no GPU needed to print): a training or evaluation over both devices with
    torchrun and --shard, a study (hyperbolicity) unsharded on the first, then the table's --print line, which
    prints and runs nothing; --gpus 0-3 is 0,1,2,3; without --shard the lines are refused, as --shard without
    --gpus."""
    flags = ["table", "9", *QUIET, "--out", str(tmp_path), "--gpus", "0-1", "--shard"]
    lines = lab([*flags, "--print-commands"])
    data, out = f"--data-root {benchmarks.ROOT}", tmp_path
    train = (f"CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node=2 -m lab train --model tiny-idefics2 "
             f"{data} --task vqav2 --out {out}/train/vqav2/hyper-icl{{}} --teacher-cache {out}/teacher/vqav2 "
             "--proceed --threads 1{} --shard")
    study = (f"CUDA_VISIBLE_DEVICES=0 python -m lab hyperbolicity --model tiny-idefics2 {data} --task vqav2 --out "
             f"{out}/train/vqav2/hyper-icl{{0}} --n-eval 1000 --eval-draw seeded --threads 1 --checkpoint "
             f"{out}/train/vqav2/hyper-icl{{0}}/adapter.safetensors")
    assert lines == [train.format("", ""), train.format("-anchor-euclidean", " --anchor euclidean"),
                     study.format(""), study.format("-anchor-euclidean"),
                     shlex.join(["python", "-m", "lab", *flags, "--print"])]
    assert capsys.readouterr().out.split("\n")[:-1] == lines
    monkeypatch.setattr(subprocess, "run", None)  # a job started: a TypeError
    monkeypatch.setattr(subprocess, "Popen", None)
    printed = lab(shlex.split(lines[-1])[3:])
    assert printed["cells"] and all(c["marks"] == ["missing"] for c in printed["cells"])
    assert lab_args([*flags[:-3], "--gpus", "0-3", "--plan", "cuda"]).gpus == "0,1,2,3"
    assert lab_args([*flags[:-3], "--gpus", "0-1,4,6-7", "--plan", "cuda"]).gpus == "0,1,4,6,7"
    assert "--print-commands with --gpus takes --shard" in refused(lab_args, [*flags[:-1], "--print-commands"],
                                                                   capsys)
    assert "--shard in a table takes --gpus, as --gpus 0-3" in refused(lab_args, [*flags[:-3], "--shard"], capsys)


@pytest.mark.parametrize("gpus, said", [("3-1", "--gpus 3-1: the range 3-1 runs downward; name it from its first "
                                                 "device up, as 1-3"),
                                        ("0-", "--gpus takes device numbers separated by commas, as 0,1,2,3 (got "
                                               "'0-'), or a range, as 0-3"),
                                        ("0-2-4", "(got '0-2-4'), or a range, as 0-3"),
                                        ("0-2,1", "--gpus 0-2,1 names a device twice")])
def test_a_bad_range_of_gpus_is_named(gpus, said, tmp_path, capsys):
    flags = ["table", "9", *QUIET, "--out", str(tmp_path), "--gpus", gpus, "--shard", "--print-commands"]
    assert said in refused(lab_args, flags, capsys)


def test_a_sharded_table_runs_each_job_over_every_device_in_turn_and_stops_at_a_failed_one(tmp_path, monkeypatch,
                                                                                          capsys):
    """on_all_devices, its commands recorded instead of run: each job in dependency order, trainings and evaluations
    under this Python's torchrun over the devices a scheduler's CUDA_VISIBLE_DEVICES names, a study on the first
    alone; a failed job stops the table, its line named, the jobs after it not started."""
    args = lab_args(["table", "9", *QUIET, "--out", str(tmp_path), "--gpus", "0-1", "--shard", "--print-commands"])
    _, jobs = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("9", "idefics2"))
    started, codes = [], iter([0, 0, 0, 0, 0, 3])

    def run(argv, env):  # the job's process, recorded
        started.append((env["CUDA_VISIBLE_DEVICES"], argv))
        return subprocess.CompletedProcess(argv, next(codes))
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a scheduler's share of the machine
    table_runs.on_all_devices(jobs, args.gpus)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lab"]
    assert started == [("4,5", [*torchrun, "train", *jobs[0].argv, "--shard"]),
                       ("4,5", [*torchrun, "train", *jobs[1].argv, "--shard"]),
                       ("4", [sys.executable, "-m", "lab", "hyperbolicity", *jobs[2].argv]),
                       ("4", [sys.executable, "-m", "lab", "hyperbolicity", *jobs[3].argv])]
    assert [j.script for j in jobs] == ["train.py", "train.py", "hyperbolicity", "hyperbolicity"]
    assert "[4/4] CUDA_VISIBLE_DEVICES=4 python -m lab hyperbolicity" in capsys.readouterr().out
    started.clear()
    with pytest.raises(ValueError, match=r"^job 2 of 4 failed \(exit 3; its output is above\): "
                                         r"CUDA_VISIBLE_DEVICES=4,5 torchrun .* --anchor euclidean --shard; run the "
                                         r"same command again to continue$"):
        table_runs.on_all_devices(jobs, args.gpus)
    assert len(started) == 2


def test_a_sharded_tables_training_runs_for_real_under_torchrun_and_proceeds(tmp_path, capfd):
    """Table 9's first training by on_all_devices for real: 2 CPU processes (gloo; CUDA_VISIBLE_DEVICES names no
    device here and is harmless), the adapter written; its line carries --proceed, which skips a finished run when
    the same command runs it again (as every table job's: test_a_table_does_each_piece_of_work_once...)."""
    args = lab_args(["table", "9", *QUIET, "--out", str(tmp_path), "--gpus", "0-1", "--shard", "--print-commands",
                     "--train-args", "--n-train 4 --n-heldout 2 --batch-size 2 --epochs 1 --shots 1"])
    _, jobs = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("9", "idefics2", 4))
    table_runs.on_all_devices(jobs[:1], args.gpus)
    adapter = tmp_path / "train" / "vqav2" / "hyper-icl" / "adapter.safetensors"
    assert adapter.stat().st_size and "done: 2 steps" in capfd.readouterr().out
    assert "--proceed" in table_runs.sharded_line(jobs[0], args.gpus)


def test_print_shows_a_cell_only_from_a_result_of_its_own_job(tmp_path, capsys):
    """Table 7's zero-shot VQAv2 evaluated once; --print of another backbone, another --data-root, and after the
    metrics were damaged or the predictions they score removed: no number (before: another backbone's or data's
    number beside the paper's; the damaged file a JSON error naming nothing)."""
    flags = ["table", "7", *QUIET, "--n-eval", "2", "--out", str(tmp_path)]
    args = lab_args(flags)
    of_cell, _ = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("7", "idefics2"))
    job = of_cell["Zero-shot", "vqav2"]
    lab_evaluate(list(job.argv))
    cell = lambda argv: {(c["row"], c["column"]): c for c in lab(argv)["cells"]}["Zero-shot", "vqav2"]
    assert cell([*flags, "--print"])["ours"] is not None
    other = [a.replace("tiny-idefics2", "tiny-llava-interleave") for a in flags]
    assert cell([*other, "--print"])["ours"] is None
    root = shutil.copytree(os.path.join(benchmarks.ROOT, "vqav2"), tmp_path / "root" / "vqav2")
    moved = [str(root.parent) if a == benchmarks.ROOT else a for a in flags]
    assert cell([*moved, "--print"])["ours"] is None
    metrics, = tmp_path.glob("eval/vqav2/*.metrics.json")
    predictions = str(metrics).replace(".metrics.json", ".predictions.jsonl")
    os.rename(predictions, predictions + ".away")
    assert cell([*flags, "--print"])["marks"][-1] == "missing"  # the run would evaluate it again
    os.rename(predictions + ".away", predictions)
    metrics.write_text(metrics.read_text()[:100])
    assert cell([*flags, "--print"])["ours"] is None


def test_a_table_takes_the_flags_its_cells_take_and_refuses_the_rest(tmp_path, capsys):
    table = lambda n, *more: ["table", n, *QUIET, "--out", str(tmp_path), *more]
    for flag in (["--again"], ["--new-tokens", "3"], ["--task", "coco"], ["--eval-draw", "seeded"]):
        assert "reaches no cell of Table 1: its cells choose their own" in refused(  # before: taken, doing nothing
            lab_args, table("1", *flag), capsys)
    for flag in ("--task coco", "--meth lora", "--out x"):  # before: every training on coco, LoRA, into x
        assert f"--train-args --{flag.split()[0][2:]}" in refused(lab_args, table("1", "--train-args", flag), capsys)
    args = lab_args(table("2", "--seed-protocol", "likelihood"))  # before: refused, SEED cells' own flag
    _, jobs = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("2", "idefics2"))
    assert {"likelihood" in j.argv for j in jobs if "seed2" in j.argv and j.script == "evaluate.py"} == {True}
    args = lab_args(table("1", "--vector-layer", "1", "--rices-encoder", "clip"))
    _, jobs = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("1", "idefics2"))
    for word, flag in (("--vector", "--vector-layer"), ("rices", "--rices-encoder")):  # before: dropped / refused
        assert {flag in j.argv for j in jobs if word in j.argv} == {True} and \
            not any(flag in j.argv for j in jobs if word not in j.argv)
    lab_args(table("2", "--vector-sets", "2"))  # a flag of other tables' rows: a note, not an error
    assert "note: --vector-sets reaches no cell of Table 2" in capsys.readouterr().err


NO_WORK = dict.fromkeys(("teacher_passes", "teacher_tokens", "steps", "heldout_forwards", "items", "prompt_tokens",
                         "generated"), 0)


def test_a_table_moved_with_its_folder_prints_and_runs_again_as_before(rehearsal, tmp_path, monkeypatch):
    """A finished table's folder moved (here copied: its results record the old paths): --print gives the same table
    and writes nothing (a read-only folder prints), and the table run there again does no work (before: every
    adapter's cell `-?`, table-8.md rewritten so, then `holds the result of other settings: checkpoint`)."""
    done, root = rehearsal
    moved = shutil.copytree(root / "idefics2", tmp_path / "moved")
    writes = []
    with monkeypatch.context() as m:  # what --print writes: nothing, the files being the same
        m.setattr(files, "atomic_write", lambda path, write: writes.append(path))
        assert lab(table("8", "tiny-idefics2", moved, "--print")) == done["8"][0][1] and writes == []
    counted = Counted(monkeypatch)
    assert lab(table("8", "tiny-idefics2", moved)) == done["8"][0][1]
    assert {k: v for k, v in counted.work.items() if k != "backbone_loads"} == NO_WORK


def test_a_cells_adapter_of_another_task_is_refused_and_print_keeps_the_table(rehearsal, tmp_path, capsys):
    """A cell's adapter replaced by another task's and its metrics removed: --print keeps the good table (before:
    rewritten with `-?`), and the table's run refuses the adapter, naming its task (before: scored as VQAv2's)."""
    _, root = rehearsal
    moved = shutil.copytree(root / "idefics2", tmp_path / "moved")
    run = moved / "train" / "vqav2" / "hyper-icl"
    shutil.copy(moved / "train" / "ok-vqa" / "hyper-icl" / "adapter.safetensors", run / "adapter.safetensors")
    for metrics in run.glob("*.metrics.json"):
        os.remove(metrics)
    before = {f: (moved / f).read_bytes() for f in ("table-8.md", "table-8.json")}
    printed = lab(table("8", "tiny-idefics2", moved, "--print"))  # its transfer: the VQAv2 adapter on OK-VQA
    assert [(c["row"], c["column"]) for c in printed["cells"] if c["ours"] is None] == [("vqav2 -> ok-vqa",
                                                                                          "Hyper-ICL")]
    assert {f: (moved / f).read_bytes() for f in before} == before and "note: kept " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lab(table("8", "tiny-idefics2", moved))
    assert "adapter.safetensors is an adapter of the task ok-vqa, not of vqav2" in capsys.readouterr().err


def test_a_damaged_result_is_named_by_print_and_healed_by_the_run(tmp_path, capsys):
    """A cell's metrics whose copied `run` record is a list, or whose score is text: --print names the file and the
    field and shows no number (before: AttributeError in cell_record, `Unknown format code 'f'` naming no file), and
    the table's run evaluates it again (before: read as "the same settings", never healed)."""
    flags = ["table", "7", *QUIET, "--n-eval", "2", "--out", str(tmp_path)]
    args = lab_args(flags)
    of_cell, _ = table_runs.table_jobs(args, lab_evaluate_args([]), lab_train_args, tables.layout("7", "idefics2"))
    job = of_cell["Zero-shot", "vqav2"]
    first = lab_evaluate(list(job.argv))
    metrics, = tmp_path.glob("eval/vqav2/*.metrics.json")
    whole = metrics.read_text()
    cell = lambda: {(c["row"], c["column"]): c for c in lab([*flags, "--print"])["cells"]}["Zero-shot", "vqav2"]
    for field, value in (("run", [1]), ("vqa_accuracy", "high")):
        metrics.write_text(json.dumps({**json.loads(whole), field: value}))
        assert cell()["ours"] is None and f"note: {metrics}: its {field} is " in capsys.readouterr().out
        assert lab_evaluate(list(job.argv)) == first and metrics.read_text() == whole
    assert cell()["ours"] == first["vqa_accuracy"]


def test_a_tables_run_of_other_settings_is_refused_with_advice_a_table_can_follow(tmp_path):
    """A table's training whose folder holds a run of other --train-args: the refusal's advice works when followed
    (before: "or --overwrite", which a table refuses in --train-args)."""
    argv = ("--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--out",
            str(tmp_path / "run"), "--n-train", "2", "--n-heldout", "1", "--epochs", "1", "--batch-size", "2",
            "--workers", "0", "--proceed")
    lab_train([*argv, "--lr", "1e-3"])
    job = tables.Job("train.py", argv)
    with pytest.raises(ValueError, match=rf"--lr 0.001 \(now 0.005\).*move or remove {tmp_path / 'run'} to train"):
        table_runs.run_jobs([job], {"train.py": lab_train})
    shutil.rmtree(tmp_path / "run")
    table_runs.run_jobs([job], {"train.py": lab_train})
    assert (tmp_path / "run" / "adapter.safetensors").exists()
