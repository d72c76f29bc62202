"""LIVE (Peng et al. 2024), a baseline: a learned vector added to each decoder layer's MLP output, attached by a
forward hook on the MLP (its plug), trained with a tempered KL to the teacher's answer distribution."""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import model as M


class LIVE(nn.Module):
    """LIVE: one vector v (LIVE's, size d) and scale alpha per decoder layer, added to the output h of the layer's
    MLP and renormalised to its norm: h' = (h + alpha v) |h| / |h + alpha v|.

    Initialised as in LIVE's public runs: alpha = 0.1 (their alpha_init_value), v ~ N(0, 0.01^2). Parameters per
    layer: d + 1. Runs as a forward hook on the MLP (MLPPlug), not inside attention.
    """

    def __init__(self, hidden_size):
        super().__init__()
        self.v = nn.Parameter(torch.randn(hidden_size) * 0.01)
        self.alpha = nn.Parameter(torch.tensor(0.1))

    def forward(self, h):
        """h' = (h + alpha v) |h| / |h + alpha v| over the last axis, computed in float32 (or float64)."""
        x = h.to(torch.promote_types(h.dtype, torch.float32))
        shifted = x + self.alpha.to(x.dtype) * self.v.to(x.dtype)
        return (shifted * (x.norm(dim=-1, keepdim=True) / shifted.norm(dim=-1, keepdim=True))).to(h.dtype)


class MLPPlug(M.Plug):
    """LIVE's place: one adapter on each decoder layer's MLP, which a forward hook runs the MLP's output through."""

    def put(self, model, adapter, **sizes):
        device = next(model.parameters()).device
        for layer in model.get_decoder().layers:
            layer.mlp.icl_adapter = adapter(model.config.get_text_config().hidden_size, **sizes).to(device)
        hook(model)

    def modules(self, model):
        return torch.nn.ModuleList(layer.mlp.icl_adapter for layer in model.get_decoder().layers)

    @contextlib.contextmanager
    def bypassed(self, model):
        unhook(model)
        try:
            yield model
        finally:
            hook(model)

    def remove(self, model):
        unhook(model)
        for layer in model.get_decoder().layers:
            del layer.mlp.icl_adapter


def hook(model):
    """Run each decoder MLP's output through its LIVE adapter (a forward hook, its handle kept on the MLP)."""
    for layer in model.get_decoder().layers:
        layer.mlp.icl_hook = layer.mlp.register_forward_hook(lambda mlp, args, out: mlp.icl_adapter(out))


def unhook(model):
    """Remove the LIVE hooks (the adapters stay attached)."""
    for layer in model.get_decoder().layers:
        layer.mlp.icl_hook.remove()
        del layer.mlp.icl_hook


def answer_kl(student_logits, teacher_logits, temperature):
    """LIVE's loss, T^2 KL(softmax(teacher / T) || softmax(student / T)), mean over N answer positions: both [N, V]."""
    t = F.log_softmax(teacher_logits.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1)
    return temperature ** 2 * (t.exp() * (t - s)).sum(-1).mean()
