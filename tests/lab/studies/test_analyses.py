"""The analyses (lab/studies/analyses.py): the aligned attention shift, the gates (Table 10) and delta-hyperbolicity
(Table 9) on a random checkpoint, the middle layers."""
import os

import pytest
import torch

import model as M
from helpers import BENCH, lab
from lab.models import backbones
from lab.studies import analyses


def test_aligned_shift_compares_shared_keys_and_counts_icd_keys():
    """Eq 19's alignment: BOS + instruction keys first, query keys last, ICD keys only in the teacher."""
    T, start, icd, pad_plain, pad_icd = 2, 3, 4, 1, 2
    plain = torch.rand(1, 1, T, pad_plain + start + T).softmax(-1)
    plain[..., :pad_plain] = 0
    plain = plain / plain.sum(-1, keepdim=True)
    teacher = torch.cat([torch.zeros(1, 1, T, pad_icd), plain[..., pad_plain:pad_plain + start],
                         torch.zeros(1, 1, T, icd), plain[..., -T:]], -1)
    n_plain, n_icd = start + T, start + icd + T
    assert torch.allclose(analyses.aligned_shift(teacher, plain, n_icd, n_plain, T), torch.zeros(1, 1, T))
    moved = teacher.clone()
    moved[..., pad_icd + start] += 0.25 * moved[..., -1]  # a quarter of the last key's weight moves onto an ICD key
    moved[..., -1] *= 0.75
    expected = 0.5 * teacher[..., -1]
    assert torch.allclose(analyses.aligned_shift(moved, plain, n_icd, n_plain, T), expected)


def test_gates(tmp_path, checkpoint):
    r = lab(["gates", *BENCH, "--checkpoint", checkpoint, "--n-eval", "4", "--shots", "2", "--out", str(tmp_path)])
    layers = len(M.decoder_self_attentions(backbones.load_backbone("tiny-idefics2").model))
    assert len(r["per_layer_mean"]) == layers
    for v in r["per_layer_mean"] + [r["early_mean"], r["late_mean"]]:
        assert 0 < v < 1
    assert 0 < r["per_layer_std"] < 0.5
    assert -1 <= r["corr_g_delta_attention"] <= 1
    assert os.path.isfile(tmp_path / "gates-vqav2-val.json")


def test_gates_need_a_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        lab(["gates"])
    assert "error: --gates needs a Hyper-ICL checkpoint (--checkpoint; " in capsys.readouterr().err


def test_hyperbolicity(tmp_path, checkpoint):
    r = lab(["hyperbolicity", *BENCH, "--checkpoint", checkpoint, "--n-eval", "4", "--shots", "2", "--out",
                      str(tmp_path)])
    for name in ("teacher", "student"):
        assert 0 <= r[name]["mean"] <= 1 and r[name]["std"] >= 0
    assert r["teacher"] != r["student"]
    assert os.path.isfile(tmp_path / "hyperbolicity-vqav2-val.json")


def test_middle_layers():
    assert list(analyses.middle_layers(32)) == [14, 15, 16, 17]
    assert list(analyses.middle_layers(2)) == [0, 1]
