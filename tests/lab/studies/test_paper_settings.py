"""The paper's settings as the tables run them (issue 60): each follows the paper's words or the cited protocol's
code, and the table's footnote says which where they differ."""
import benchmarks
from helpers import lab
from lab.studies import table_print, tables


def test_table_2_runs_mme_and_seed_2_shot_on_idefics2_and_32_shot_on_idefics_9b():
    """"Due to computational constraints, we run 2-shot ICL on MME and SEED-Bench for Idefics2-8B-base": the ICL row
    and Hyper-ICL's teacher (the family's default shots, no --shots of its own) on Idefics-9b keep its 32 ICDs."""
    for family, shots in (("idefics", "32"), ("idefics2", "2")):
        layout = tables.layout("2", family)
        for task in ("mme", "seed"):
            assert layout.cells["ICL", task].evaluate == ("--shots", shots)
            assert tables.shots_of(task, family) == int(shots) and layout.cells["Hyper-ICL", task].train == ()
        assert layout.cells["ICL", "flickr30k"].evaluate == ("--shots", "32" if family == "idefics" else "8")


def test_lora_keeps_the_targets_of_the_papers_counts_and_table_1_says_so(tmp_path):
    """LoRA's targets are the ones Table 1's # Params pins (tests/lab/methods/test_lora.py), not the paper's words:
    Table 1's footnote says which and why, a table without a LoRA row does not."""
    printed = lab(["table", "1", "--model", "tiny-idefics2", "--out", str(tmp_path), "--data-root", benchmarks.ROOT,
                   "--print"])
    assert printed["notes"][0] == tables.NOTES["LoRA"] and "25.5 M on Idefics-9b" in tables.NOTES["LoRA"]
    assert f"Note: {tables.NOTES['LoRA']}" in (tmp_path / "table-1.md").read_text().splitlines()
    assert "LoRA" in tables.layout("1", "idefics").rows and table_print.settings_notes(tables.layout("3", "idefics")) == []
