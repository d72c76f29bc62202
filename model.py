"""The plug: an adapter inside a frozen backbone's attention, h^(l) of each decoder layer, L_sup at the target tokens.

A backbone is a frozen Hugging Face vision-language model (loaded by name: lab/models/backbones.py:load_backbone).
The adapters of `adapters.py` act inside the *text decoder's self-attention* only (not the vision tower, the
perceiver, or Idefics' gated cross-attention). They reach it through transformers' attention-function registry: one
attention function, `calibrated_attention`, registered as "icl" (with the stock SDPA mask builder, without which
transformers would silently pass no padding mask), the decoder's config switched to it, one adapter on each
self-attention module. The function hands the module's (rotary-embedded) queries, keys and values to its adapter;
every other module falls through to the stock SDPA forward. No transformers forward is copied. A method that sits
elsewhere (LIVE on the MLPs, LoRA on linear layers) brings its own Plug (lab/methods/).
"""
import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import data

ATTN_NAME = "icl"  # the attention implementation name our adapters run under


# ---------------------------------------------------------- the plug: an adapter inside each decoder self-attention

def calibrated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for one layer (Eq 3-8): the module's adapter if it has one, else transformers' SDPA forward.

    query: [B, H, T, d_h]; key, value: [B, H_kv, S, d_h] (after rotary embedding and the KV cache);
    attention_mask: bool [B, 1, T, S] (True = attend) or None for plain causal. Returns ([B, T, H, d_h], None).
    Transformers calls it from each decoder self-attention's forward: ALL_ATTENTION_FUNCTIONS[_attn_implementation].
    """
    adapter = getattr(module, "icl_adapter", None)
    if adapter is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = adapter(query, key, value, attention_mask, scaling)  # grouped key/value heads stay grouped
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, calibrated_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def decoder_self_attentions(model):
    """The text decoder's self-attention modules, in layer order (the only places adapters go)."""
    return [layer.self_attn for layer in model.get_decoder().layers]


def attention_shape(model):
    """(layers, query heads, head size) of the text decoder's self-attention."""
    attns = decoder_self_attentions(model)
    cfg = attns[0].config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return len(attns), cfg.num_attention_heads, head_dim


class Plug:
    """Where a method's adapter sits in a backbone, and how it is put in, bypassed and taken out. This one is the
    paper's: one adapter on each decoder self-attention, reached through calibrated_attention (Eq 5). A method that
    sits elsewhere brings its own (lab/methods: LIVE's on the MLPs, LoRA's on linear layers); model.icl_plug holds
    the attached method's."""

    def put(self, model, adapter, **sizes):
        """adapter(heads, head_dim, **sizes) on each decoder self-attention; transformers then calls
        calibrated_attention from each (the registry's ATTN_NAME)."""
        _, heads, head_dim = attention_shape(model)
        device = next(model.parameters()).device
        for attn in decoder_self_attentions(model):
            attn.icl_adapter = adapter(heads, head_dim, **sizes).to(device)
        decoder_self_attentions(model)[0].config._attn_implementation = ATTN_NAME

    def modules(self, model):
        """The adapters, one per decoder self-attention."""
        return torch.nn.ModuleList(attn.icl_adapter for attn in decoder_self_attentions(model))

    def bypassed(self, model):
        """A context manager: the stock SDPA attention, the adapters in place but not called."""
        return attention_as(model, "sdpa")

    def remove(self, model):
        """Take the adapters out; the stock SDPA attention again."""
        attns = decoder_self_attentions(model)
        for attn in attns:
            del attn.icl_adapter
        attns[0].config._attn_implementation = "sdpa"


def attach(model, method, adapter, plug=Plug(), **sizes):
    """Attach a fresh adapter (replacing any attached one) and route the backbone through it: by default (`plug`)
    adapter(heads, head_dim, **sizes) on each decoder self-attention (Eq 5-9: adapters.HyperICL, adapters.HiFICL).
    method: its name, kept with its sizes in model.icl_settings (what a checkpoint records). Returns
    adapter_modules(model), trainable. The methods by name, with their plugs and sizes: lab/methods/registry.py."""
    if hasattr(model, "icl_settings"):
        detach(model)
    plug.put(model, adapter, **sizes)
    model.icl_plug, model.icl_settings = plug, {"method": method, **sizes}
    return adapter_modules(model).requires_grad_(True)


def detach(model):
    """Remove the adapter and restore the backbone exactly as it was (stock SDPA attention, original modules)."""
    model.icl_plug.remove(model)
    del model.icl_settings, model.icl_plug


def adapter_modules(model):
    """The attached adapter: a Module holding exactly its trainable parameters (one entry per adapted module)."""
    return model.icl_plug.modules(model)


@contextlib.contextmanager
def attention_as(model, implementation):
    """Run the text decoder's attention through another registered implementation for a while: "sdpa", the backbone
    as it was, adapters bypassed; "eager", which also returns attention probabilities."""
    cfg = decoder_self_attentions(model)[0].config
    before, cfg._attn_implementation = cfg._attn_implementation, implementation
    try:
        yield model
    finally:
        cfg._attn_implementation = before


@contextlib.contextmanager
def without_adapter(model):
    """The backbone as it was, the adapter of any method bypassed (the teacher's forward): a context manager."""
    with (model.icl_plug.bypassed(model) if hasattr(model, "icl_plug") else attention_as(model, "sdpa")):
        yield model


# ------------------------------------------------------------------ h^(l) of Eq 12-16: each decoder layer's own output

LAYER_OUTPUTS_VERSION = 2  # what layer_outputs returns; 1 was hidden_states[1:], the last entry after the final norm


def layer_outputs(model, forward=None, keep=None, **inputs):
    """model(**inputs) and h^(1), ..., h^(L), the output of each decoder layer (Eq 16 aligns these), read by forward
    hooks on the decoder layers: (output, L x [B, T, d]). Unlike `output_hidden_states`, whose last entry is the L-th
    output after the model's final norm, every h^(l) here is the layer's own output. forward: what runs the model
    (a wrapper of it, such as DistributedDataParallel; default the model itself). keep: a bool mask [B, T]; then each
    hook keeps only those positions as its layer produces them, L x [kept positions, d] in row order (h[keep]), and
    no layer's whole output outlives the next layer."""
    layers = model.get_decoder().layers
    keep = None if keep is None else keep.to(next(layers[0].parameters()).device)  # once, where the layers run
    states = []

    def record(layer, args, out):
        h = out[0] if isinstance(out, tuple) else out  # [B, T, d]
        states.append(h if keep is None else h[keep])
    with hooked(*(layer.register_forward_hook(record) for layer in layers)):
        return (forward or model)(**inputs), states


@contextlib.contextmanager
def hooked(*handles):
    """Keep the given forward (pre-)hooks registered for a while: each handle is removed on exit."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ------------------------------------------------------- L_sup: the student's logits at its target tokens

def target_logits(model, batch, **kwargs):
    """model's logits [B, K, V] at `batch`'s data.answer_window and the labels [B, K] they line up with."""
    keep = batch.get("window") or data.answer_window(batch["labels"])  # "window": counted on the host (finished)
    return model(**data.model_inputs(batch), logits_to_keep=keep, use_cache=False, **kwargs).logits, \
        batch["labels"][:, -keep:]


def supervised_loss(logits, labels):
    """L_sup: next-token cross-entropy on the target tokens (labels -100 elsewhere)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def answer_positions(labels):
    """Bool [B, W]: the positions whose logits predict an answer token (labels -100 elsewhere; next-token shift)."""
    return F.pad(labels[:, 1:] != -100, (0, 1))
