"""The meta-trained toy-idefics2 backbone (lab/models/toy_backbone.py): determinism, the checked file, a build that
never learns refused, and the efficacy of distillation on it (fails when the adapter or the teacher is broken)."""
import errno
import os

import pytest
import torch

import evaluate as E
import train
from lab.datasets import toy_world
from lab.disk import files
from lab.models import backbones, toy_backbone
from helpers import lab


SHIPPED = toy_backbone.TOY_REFERENCE  # lab/models/toy-idefics2.safetensors


SMALL_RECIPE = {**toy_backbone.TOY_RECIPE, "named_steps": 2, "episode_steps": 2, "named_batch": 4, "episode_batch": 2,
                "scenes": 64, "probe_every": 10**6}


def test_every_answer_is_one_token():
    tok = toy_backbone.toy_processor().tokenizer
    for answers in toy_world.ICL_ATTRIBUTES.values():
        assert all(len(tok(" " + a, add_special_tokens=False)["input_ids"]) == 1 for a in answers)


EVERY_BUILD = {"8-shot": 0.0, "0-shot": 1.0}  # acceptance bounds every build meets (SMALL_RECIPE learns nothing)


def test_the_builder_is_deterministic_and_its_file_is_checked(tmp_path, capsys):
    paths = [str(tmp_path / f"{k}.safetensors") for k in "ab"]
    first, second = (toy_backbone.build_toy(p, SMALL_RECIPE, accept=EVERY_BUILD)[0].state_dict() for p in paths)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert files.weights_digest(toy_backbone.read_toy(paths[0])) == files.weights_digest(first)
    meta = toy_backbone.toy_metadata(paths[0])
    assert meta["recipe"] == SMALL_RECIPE and set(meta["probe"]) == {"named", "0-shot", "8-shot"}
    assert "seed 0" in capsys.readouterr().out
    loaded, _ = toy_backbone.toy_idefics2(paths[0])  # read back, not rebuilt
    assert all(torch.equal(loaded.state_dict()[k], first[k]) for k in first) and "seed" not in capsys.readouterr().out
    blob = open(paths[0], "rb").read()
    for damage in (blob[:len(blob) // 2], blob[:-8] + bytes(8)):  # truncated; weights changed
        with open(paths[0], "wb") as f:
            f.write(damage)
        with pytest.raises(ValueError, match=f"toy backbone {paths[0]}"):
            backbones.load_backbone(paths[0])  # an error naming the file, never a silent rebuild


def test_a_build_that_never_learns_in_context_is_retried_then_refused(tmp_path, monkeypatch, capsys):
    """The builder's training replaced by one that returns an untrained model (it never learns in context): every
    try is probed and rejected, the error names the seeds, and no file is left to be mistaken for a backbone."""
    seeds = []

    def never_learns(recipe, threads=1, log=print):
        seeds.append(recipe["seed"])
        processor = toy_backbone.toy_processor()
        model = toy_backbone.toy_model(processor, recipe["seed"]).eval()
        text = toy_world.icl_text_pieces(processor)
        probe_set = toy_backbone.toy_scenes(processor, 64, __import__("random").Random(1))
        return model, processor, [], toy_backbone.probe_row(model, processor, text, probe_set, n=16)

    monkeypatch.setattr(toy_backbone, "meta_train", never_learns)
    out = tmp_path / "backbone.safetensors"
    with pytest.raises(ValueError, match="no toy-idefics2 build learned in context in 3 tries .seeds 5..7"):
        lab(["build-toy", "--seed", "5", "--out", str(out)])
    assert seeds == [5, 6, 7] and capsys.readouterr().out.count("does not learn in context, rejected") == 3
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def interrupted(tensors, metadata=None):  # stopped while serialising, its temporary file already open
        raise KeyboardInterrupt
    monkeypatch.setattr(toy_backbone, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        toy_backbone.build_toy(str(tmp_path / "backbone.safetensors"), SMALL_RECIPE, accept=EVERY_BUILD)
    assert os.listdir(tmp_path) == []


def test_the_default_backbone_is_the_shipped_reference(monkeypatch, tmp_path):
    """toy-idefics2 is the shipped file, checked against toy_backbone.TOY_SHA256: never built, never read from a
    cache."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(toy_backbone, "meta_train",
                        lambda *a, **k: pytest.fail("the default backbone must not be built"))
    backbone = backbones.load_backbone("toy-idefics2")
    assert files.weights_digest(backbone.model.state_dict()) == toy_backbone.TOY_SHA256
    assert list(tmp_path.iterdir()) == []
    meta = toy_backbone.toy_metadata(SHIPPED)
    assert toy_backbone.learns_in_context(meta["probe"]) if "probe" in meta else \
        meta["curve"][-1]["8-shot"]["colour"] >= .9
    monkeypatch.setattr(toy_backbone, "TOY_SHA256", "0" * 64)  # a reference of other bytes than the pinned is refused
    with pytest.raises(ValueError, match="do not match their checksum"):
        backbones.load_backbone("toy-idefics2")


def test_the_summary_says_when_the_backbone_does_not_learn_in_context(tmp_path, capsys):
    """A random twin cannot use demonstrations: the default job's line says so instead of reporting zeros."""
    E.main(["--model", "tiny-idefics2", "--task", "toy-icl-colour", "--n-eval", "16", "--batch-size", "16",
            "--out", str(tmp_path)])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("0-shot") and "NOT A RESULT: 8-shot ICL is at chance" in line
    assert "does not learn in context" in line


EFFICACY = ["--model", "toy-idefics2", "--task", "toy-icl-colour"]


@pytest.fixture
def one_thread():
    """One thread: on a shared 2-core machine about 10x faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def accuracy(out, flags):
    return E.main([*EFFICACY, "--n-eval", "60", "--batch-size", "30", "--out", out, *flags])["vqa_accuracy"]


def test_distillation_lifts_zero_shot_to_eight_shot(one_thread, tmp_path):
    """The anchor alone (lambda = 0: no label is seen) on 48 queries carries 8-shot behaviour into the zero-shot
    student. Fails if the adapter cannot move the logits (U_k frozen at 0) or the teacher sees no demonstrations."""
    out = str(tmp_path / "run")
    train.main([*EFFICACY, "--out", out, "--lam", "0", "--lr", "2e-2", "--n-train", "48", "--n-heldout", "8",
                "--batch-size", "8", "--epochs", "16"])
    zero, eight = accuracy(out, ["--shots", "0"]), accuracy(out, ["--shots", "8"])
    adapter = accuracy(out, ["--checkpoint", os.path.join(out, "adapter.safetensors")])
    print(f"zero-shot {zero:.1f}, 8-shot {eight:.1f}, anchor-only Hyper-ICL {adapter:.1f}")
    assert zero <= 45 and eight >= 80             # the backbone needs the demonstrations and uses them
    assert adapter - zero >= 50                   # the distilled adapter carries them without the demonstrations


@pytest.mark.parametrize("out, overwrite, message", [
    ("mytoy", False, r"--out .*mytoy: a toy backbone must be a .safetensors file"),
    ("folder.safetensors", True, r"--out .*folder.safetensors is a folder"),
    ("afile/b.safetensors", False, r"--out .*afile/b.safetensors: .*afile is a file, not a folder"),
    ("readonly/b.safetensors", False, r"--out .*readonly/b.safetensors: cannot write in .*readonly"),
    ("old.safetensors", False, r"--out .*old.safetensors exists; pass --overwrite"),
])
def test_build_toy_checks_out_before_it_builds(tmp_path, monkeypatch, out, overwrite, message):
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "old.safetensors").write_text("x")
    (tmp_path / "readonly").mkdir(mode=0o555)
    monkeypatch.setattr(toy_backbone, "build_toy", lambda *a: pytest.fail("built before --out was checked"))
    real_open = os.open
    def refused(path, *a):  # as a read-only folder answers (root could write into one with mode 555)
        if "readonly" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, *a)
    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(ValueError, match=message):
        lab(["build-toy", "--out", str(tmp_path / out), *(["--overwrite"] if overwrite else [])])
    assert sorted(os.listdir(tmp_path)) == ["afile", "folder.safetensors", "old.safetensors", "readonly"]
