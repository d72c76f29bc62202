"""LoRA (Hu et al. 2022), a baseline, by peft: low-rank updates of the attention projections, injected in place of
the linear layers they update (its plug), trained with the task loss alone."""
import contextlib

import torch

import model as M

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # matched as module-name suffixes, as peft does


def lora_config(rank=16):
    """LoRA as the paper's baseline: rank 16, alpha = 2 r, on every module named q/k/v/o_proj, i.e. the attention
    layers of the vision encoder (whose out_proj is not so named), the perceiver and the text decoder (self- and
    Idefics' cross-attention). These are MimIC's public LoRA settings (src/config/peft/lora.yaml), and give the
    paper's counts: 17.6 M on Idefics2-8B, 25.0 M on Idefics-9B. No dropout (the backbone runs in eval mode for every
    method). lora_B = 0 at initialisation: the base model.
    """
    from peft import LoraConfig  # imported here: peft takes seconds to import and only LoRA needs it
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS)


class LinearPlug(M.Plug):
    """LoRA's place: peft's layers injected in place of the linear layers of LORA_TARGETS (adapter: lora_config)."""

    def put(self, model, adapter, **sizes):
        from peft import inject_adapter_in_model
        inject_adapter_in_model(adapter(**sizes), model)
        model.requires_grad_(False)

    def modules(self, model):
        return torch.nn.ModuleList(torch.nn.ModuleList([m.lora_A, m.lora_B]) for _, m in lora_layers(model))

    @contextlib.contextmanager
    def bypassed(self, model):
        with contextlib.ExitStack() as undo:
            for _, m in lora_layers(model):
                m.enable_adapters(False)
                undo.callback(m.enable_adapters, True)
            yield model

    def remove(self, model):
        for name, layer in lora_layers(model):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer.get_base_layer())
        if hasattr(model, "peft_config"):
            del model.peft_config


def lora_layers(model):
    """The (name, module) pairs of peft's LoRA layers in the model, in module order."""
    from peft.tuners.lora import LoraLayer
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
