"""Every learnable method and every distillation loss by name: one record each, the one place a name of --method or
--anchor is looked up. A method's record says what it learns (its module), where that sits in the backbone (its
plug), its sizes with their defaults, and its loss; a loss's record what it compares, what that needs of the teacher
and which settings it reads. To add a method: its module in a file of lab/methods/ (with its plug if it sits
elsewhere than the decoder's self-attention, and its loss if it brings one), then its record below
(docs/baselines.md, "A method of your own")."""
from dataclasses import dataclass, field
from typing import Literal

import lorentz
import model as M
from adapters import HiFICL, HyperICL, OutputLevel, StaticGate, StaticGateHead
from lab.methods import hificl_ablations, live, lora, mimic


@dataclass(frozen=True)
class Method:
    """One learnable method (train.py --method)."""
    adapter: object                                   # what is learned: sizes -> a module (LoRA: peft's config)
    plug: M.Plug = field(default_factory=M.Plug)      # where it sits: each decoder self-attention (Eq 5), or its own
    sizes: tuple = ("rank",)                          # what model.attach takes (rank: --rank, n: --virtual-tokens)
    rank: int = 4                                     # --rank where none is given
    anchor: str = "hyperbolic"                        # its loss: --anchor where none is given (ANCHORS)
    lr: float = 5e-3                                  # its published learning rate (where --curve's tuning starts)


# Published rates: the papers' 5e-3 (Hyper-ICL, HiFICL, and so the gate ablations of Hyper-ICL); LoRA 5e-4 and MimIC
# 1e-5 (MimIC's public configs, peft/lora.yaml and peft/mimic.yaml); LIVE 1e-3 (its VQAv2 runs).
METHODS = {
    "hyper-icl": Method(HyperICL),                                             # Eq 5-9, L_H-anchor (Eq 16-17)
    "hificl": Method(HiFICL, sizes=("rank", "n"), rank=8, anchor="none"),       # HiFICL: the task loss alone
    # HiFICL's component ablation (its paper's Idefics2 table). + teacher: the teacher-student paradigm HiFICL drops is
    # MimIC's, in its words "the student aligns the teacher's hidden states layer by layer", so MimIC's layer-wise MSE
    # on h^(l) (not Hyper-ICL's hyperbolic anchor); K, V without their low-rank factors; alpha = 1 (the linear shift)
    "hificl-teacher": Method(HiFICL, sizes=("rank", "n"), rank=8, anchor="mse"),
    "hificl-full-k": Method(hificl_ablations.HiFICLFullK, sizes=("rank", "n"), rank=8, anchor="none"),
    "hificl-full-v": Method(hificl_ablations.HiFICLFullV, sizes=("rank", "n"), rank=8, anchor="none"),
    "hificl-linear": Method(hificl_ablations.HiFICLLinear, sizes=("rank", "n"), rank=8, anchor="none"),
    "static-layer": Method(StaticGate),                                        # Fig 3a: a constant gate a layer
    "static-layer-head": Method(StaticGateHead),                               # and a layer and head
    "output-level": Method(OutputLevel),                                       # Table 11: on the output O
    "mimic": Method(mimic.MimIC, sizes=(), anchor="mse", lr=1e-5),             # MimIC, its layer-wise MSE
    "live": Method(live.LIVE, live.MLPPlug(), sizes=(), anchor="kl", lr=1e-3),  # LIVE, on the MLPs, its KL
    "lora": Method(lora.lora_config, lora.LinearPlug(), rank=16, anchor="none", lr=5e-4),  # LoRA (peft), CE
}

Name = Literal[tuple(METHODS)]  # a method's name, the type of train.py's --method


@dataclass(frozen=True)
class Anchor:
    """One distillation loss L_anchor (train.py --anchor), summed with lambda L_sup as Eq 17 sums L_H-anchor."""
    loss: object = None        # (student, teacher, [query_target], **reads) -> a mean; None: none (L = L_sup)
    teacher: str = None        # what it compares: "states" (h^(l), the query's tokens), "logits" (answers'), None
    reads: tuple = ()          # the train.py settings it takes beside them
    regime: bool = False       # a distance of states: its scale on the backbone shown first (lab/run/anchor_scale.py)


ANCHORS = {
    "hyperbolic": Anchor(lorentz.hyperbolic_anchor_loss, "states", ("kappa",), regime=True),   # Eq 16
    "euclidean": Anchor(lorentz.euclidean_anchor_loss, "states", regime=True),               # Table 4's L2
    "mse": Anchor(mimic.layerwise_mse, "states"),                                             # MimIC's
    "kl": Anchor(live.answer_kl, "logits", ("temperature",)),                                 # LIVE's
    "none": Anchor(),                                                                         # HiFICL's, LoRA's
}


def attach(model, method, **sizes):
    """Attach a fresh adapter of `method` with these sizes (model.attach, by the method's module and plug). Returns
    its parameters' Module."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    return M.attach(model, method, METHODS[method].adapter, METHODS[method].plug, **sizes)


def sizes(method, rank, virtual_tokens):
    """The sizes model.attach takes for `method` from train.py's --rank and --virtual-tokens: those it has."""
    given = {"rank": rank, "n": virtual_tokens}
    return {k: given[k] for k in METHODS[method].sizes}
