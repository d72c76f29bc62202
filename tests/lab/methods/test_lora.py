"""LoRA's targets (lab/methods/lora.py): the modules the paper's parameter counts pin, not its words."""
import re

import pytest
import torch

from lab.methods import lora
from lab.models import published

PAPER_M = {"idefics": 25.0, "idefics2": 17.6}  # Table 1's # Params (M) of LoRA
ATTENTION = re.compile(r"(q|k|v|o|out)_proj")   # every attention projection, the vision encoder's out_proj too


def lora_count(model, wanted):
    """LoRA's parameters (rank 16: r x (in + out) a linear) on the linear layers whose name `wanted(name)` keeps."""
    return sum(16 * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and wanted(name))


@pytest.mark.parametrize("family", ["idefics", "idefics2"])
def test_lora_targets_give_the_papers_counts_and_the_words_would_not(family):
    """The targets are MimIC's public ones (q/k/v/o_proj by name: the perceiver in, the vision encoder's out_proj
    out), whose count is Table 1's to 0.1 M; the paper's words ("all attention layers in both the vision and
    language encoders": out_proj in, the perceiver out) give 25.5 M on Idefics-9b, not its 25.0 M."""
    assert lora.LORA_TARGETS == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora.lora_config().target_modules == set(lora.LORA_TARGETS)
    model = published.published_model(family)
    leaf = lambda name: name.rsplit(".", 1)[-1]
    ours = lora_count(model, lambda name: leaf(name) in lora.LORA_TARGETS)
    words = lora_count(model, lambda name: ATTENTION.fullmatch(leaf(name)) and "perceiver" not in name)
    assert round(ours / 1e6, 1) == PAPER_M[family]
    assert round(words / 1e6, 1) == {"idefics": 25.5, "idefics2": 17.6}[family]
