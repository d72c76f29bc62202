"""A run's plumbing around train.py's loop (lab/run/runs.py): the NaN stop names its step, its part and every setting
that can cause it, and keeps the checkpoint."""
import pytest
import torch

import train
from helpers import lab_train, small_run, TRAIN
from lab.run import anchor_scale


def test_nan_loss_stops_with_its_step_and_part_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    losses, calls = train.losses, []

    def poisoned(*a, **k):
        calls.append(1)
        part = losses(*a, **k)
        return part | {"anchor": part["anchor"] * (float("nan") if len(calls) == 3 else 1)}
    monkeypatch.setattr(train, "losses", poisoned)
    with pytest.raises(FloatingPointError, match="step 3: loss part 'anchor' is nan"):
        lab_train(small_run(tmp_path))
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=False)
    assert state["progress"]["step"] == 2
    assert all(torch.isfinite(v).all() for v in state["adapter"].values())


def test_the_nan_stop_names_every_setting_that_can_cause_it(tmp_path, monkeypatch):
    nan = torch.tensor(float("nan"), requires_grad=True)  # the step reads the parts after backward (once a step)
    monkeypatch.setattr(train, "losses", lambda *a, **k: {"anchor": nan, "sup": nan, "loss": nan})
    monkeypatch.setattr(anchor_scale, "anchor_regime", lambda *a: None)
    with pytest.raises(FloatingPointError, match=r"step 1: loss part 'anchor' is nan; stopping\. The last good "
                                                 r"checkpoint is untouched\. Settings that can cause it: --lr 0\.005, "
                                                 r"--weight-decay 1e-06, --clip 1\.0, --lam 0\.5, --kappa 0\.1"):
        lab_train([*TRAIN, "--weight-decay", "1e-6", "--out", str(tmp_path / "run"), "--teacher-cache",
                   str(tmp_path / "teacher")])
