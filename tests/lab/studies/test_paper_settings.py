"""The paper's settings as the tables run them (issue 60): each follows the paper's words or the cited protocol's
code, and the table's footnote says which where they differ."""
import shlex

import pytest

import benchmarks
from helpers import lab, lab_args
from lab.datasets import readers, tasks
from lab.studies import table_print, tables


def test_table_2_runs_mme_and_seed_2_shot_on_idefics2_and_32_shot_on_idefics_9b():
    """"Due to computational constraints, we run 2-shot ICL on MME and SEED-Bench for Idefics2-8B-base": the ICL row
    and Hyper-ICL's teacher (the family's default shots, no --shots of its own) on Idefics-9b keep its 32 ICDs."""
    for family, shots in (("idefics", "32"), ("idefics2", "2")):
        layout = tables.layout("2", family)
        for task in ("mme", "seed"):
            assert layout.cells["ICL", task].evaluate == ("--shots", shots)
            assert tasks.default_shots(task, family) == int(shots) and layout.cells["Hyper-ICL", task].train == ()
        assert layout.cells["ICL", "flickr30k"].evaluate == ("--shots", "32" if family == "idefics" else "8")


def test_lora_keeps_the_targets_of_the_papers_counts_and_table_1_says_so(tmp_path):
    """LoRA's targets are the ones Table 1's # Params pins (tests/lab/methods/test_lora.py), not the paper's words:
    Table 1's footnote says which and why, a table without a LoRA row does not."""
    printed = lab(["table", "1", "--model", "tiny-idefics2", "--out", str(tmp_path), "--data-root", benchmarks.ROOT,
                   "--print"])
    assert printed["notes"][0] == tables.NOTES["LoRA"] and "25.5 M on Idefics-9b" in tables.NOTES["LoRA"]
    assert f"Note: {tables.NOTES['LoRA']}" in (tmp_path / "table-1.md").read_text().splitlines()
    assert "LoRA" in tables.layout("1", "idefics").rows
    assert table_print.settings_notes(tables.layout("3", "idefics")) == []


def commands(name, tmp_path, *extra):
    """The evaluate.py lines of Table `name` on tiny-idefics2 (--print-commands), each as its flags {flag: value}."""
    lines = lab(["table", name, "--model", "tiny-idefics2", "--out", str(tmp_path), "--data-root", benchmarks.ROOT,
                 "--print-commands", *extra])
    words = [shlex.split(line)[4:] for line in lines[:-1] if line.startswith("python -m lab evaluate ")]
    return [dict(zip(w[::2], w[1::2])) for w in words]  # every evaluate.py flag of a table's cell takes a value


@pytest.mark.parametrize("extra, task, items", [((), "seed2", 23_000), (("--seed-bench", "1"), "seed", 13_233)])
def test_table_2s_seed_column_is_seed_bench_2_and_seed_bench_1_by_flag(tmp_path, extra, task, items):
    """The paper's "24,000 multiple-choice questions" (its citation's "24K") is SEED-Bench-2: the SEED column's
    cells run it, every question of its evaluation part (no --n-eval); --seed-bench 1 runs SEED-Bench-1. The
    footnote says which; PAPER_ITEMS holds the paper's count less its 1,000 training queries."""
    seed = [c for c in commands("2", tmp_path, *extra) if c["--task"].startswith("seed")]
    assert len(seed) == 3 and {c["--task"] for c in seed} == {task} and not any("--n-eval" in c for c in seed)
    assert tables.PAPER_ITEMS[task] == items
    notes = table_print.settings_notes(tables.layout("2", "idefics2", seed_bench=extra[-1] if extra else "2"))
    assert tables.NOTES[task] in notes and tables.NOTES["mme"] in notes and tables.NOTES["flickr30k"] in notes


@pytest.mark.parametrize("extra, split", [((), None), (("--karpathy-split", "test"), "test")])
def test_coco_and_flickr30k_run_karpathys_val_split_and_its_test_by_flag(tmp_path, extra, split):
    """COCO's and Flickr30k's cells evaluate Karpathy's val split, as MimIC's code runs the paper's protocol (no
    --split: evaluate.py's val, readers.KARPATHY_SPLITS); --karpathy-split test hands --split test to them alone."""
    assert readers.KARPATHY_SPLITS["val"] == ("val",) and readers.KARPATHY_SPLITS["test"] == ("test",)
    cells = commands("8", tmp_path, *extra)
    captions = [c for c in cells if c["--task"] == "flickr30k"]
    assert len(captions) == 3 and {c.get("--split") for c in captions} == {split}
    assert all("--split" not in c for c in cells if c["--task"] == "ok-vqa")
    assert tables.NOTES["coco"] in table_print.settings_notes(tables.layout("1", "idefics2"))
    evaluated = {s: tasks.eval_items(lab_args(["evaluate", "--task", "coco", "--split", s, "--data-root",
                                               benchmarks.ROOT])) for s in ("val", "test")}
    assert [len(evaluated[s]) for s in ("val", "test")] == [80, 20]  # tools/benchmarks.py's Karpathy val and test
    assert not {it.id for it in evaluated["val"]} & {it.id for it in evaluated["test"]}


def test_mme_evaluates_every_question_outside_the_paper_sized_training_pool(tmp_path):
    """MME's cells take no --n-eval (every question of its evaluation part: all but the training pool's, the images of
    the paper's 1,000 queries + 32 held out, tasks.pool_fraction), unless the table's --n-eval caps them."""
    mme = [c for c in commands("2", tmp_path) if c["--task"] == "mme"]
    assert len(mme) == 3 and not any("--n-eval" in c for c in mme)
    assert {c["--n-eval"] for c in commands("2", tmp_path, "--n-eval", "6") if c["--task"] == "mme"} == {"6"}
    assert tasks.POOL_QUESTIONS == 1_032 and tables.PAPER_ITEMS["mme"] == 2_374 - 1_000
