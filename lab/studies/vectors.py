"""Training-free in-context vectors (Table 1): task vectors (Hendel et al.) and function vectors (Todd et al.),
with the hooks that record and steer layer and head outputs.

Both are computed once from ICL prompts [ICDs; query] of the training split, saved, and applied to the zero-shot
prompt at the last prompt token of one decoder layer (steer), the layer of lowest target cross-entropy on queries
held out of the training split (layer_losses; never the evaluation split)."""
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import random
from typing import Literal, Optional

import torch
from tqdm import tqdm

import data
import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.models import backbones
from lab.run import adapter_files, prefetch, teacher_cache

VECTOR_SETS = 100  # N ICL prompts averaged (Todd et al.'s 100 prompts for the mean head outputs; the same N for TV)

FV_HEADS = 10      # k: heads summed into a function vector (Todd et al.: |A| = 10)

FV_TRIALS = 25     # corrupted prompts per head for the average indirect effect (Todd et al.: 25)


@dataclasses.dataclass
class Settings:
    """python -m lab evaluate's flags of --vector (Table 1): zero-shot with a training-free in-context vector
    (lab/cli/modes.py:Evaluation gathers them: a field = a flag, its comment the help)."""
    vector: Optional[Literal["tv", "fv"]] = None  # task vector (Hendel et al. 2023), function vector (Todd et al.)
    vector_layer: Optional[int] = None  # its decoder layer (None: the lowest loss on --vector-heldout queries)
    vector_sets: int = VECTOR_SETS    # ICL prompts of --shots ICDs averaged into it
    vector_heldout: int = 32          # training queries held out to choose the layer
    fv_heads: int = FV_HEADS          # k: heads summed into a function vector (Todd et al.'s |A|)
    fv_trials: int = FV_TRIALS        # corrupted prompts for a head's average indirect effect


def vector_sets(pool, args, shots):
    """(queries, ICDs) of the N extraction prompts and the held-out queries that choose the layer: the training split
    shuffled with --seed, its first --vector-heldout items held out, the next N the extraction queries; their ICDs
    are drawn at random from the whole split (never the query itself)."""
    shuffled = random.Random(args.seed).sample(pool, len(pool))
    heldout, queries = shuffled[:args.vector_heldout], shuffled[args.vector_heldout:][:args.vector_sets]
    if len(queries) < args.vector_sets:
        raise ValueError(f"--vector-sets {args.vector_sets} + --vector-heldout {args.vector_heldout} exceed the "
                         f"{len(pool)} training items of {args.task}")
    return queries, data.demonstrations([q.id for q in queries], pool, shots, args.seed), heldout


def target_batches(backbone, kind, queries, icds, batch_size, workers=0):
    """Teacher-forced batches [ICDs; query + target] (icds None: zero-shot) and, per row, the last prompt token; made
    by `workers` DataLoader workers (prefetch.prepared)."""
    icds = icds or [[] for _ in queries]
    specs = [(queries[i:i + batch_size], icds[i:i + batch_size]) for i in range(0, len(queries), batch_size)]
    build = functools.partial(forced_rows, backbone.processor, backbone.family, kind)
    return [(batch, (batch["labels"] != -100).int().argmax(1) - 1)
            for batch in prefetch.prepared(build, specs, workers, backbone.model.device)]


def forced_rows(processor, family, kind, spec):
    """The teacher-forced batch of spec = (queries, their ICDs): data.teacher_batch of their pieces."""
    return data.teacher_batch(processor, family, kind, data.query_pieces(processor, family, kind, spec[0]), spec[1])


@torch.no_grad()
def icl_means(backbone, kind, queries, icds, batch_size, workers=0):
    """Means over the ICL prompts of each decoder layer's output at the last prompt token, [L, d] (the task vector
    of every layer, Hendel et al.), and of each head's output there, [L, H, d_h] (Todd et al.'s mean activations)."""
    model, states, heads = backbone.model, {}, {}
    specs = [(queries[i:i + batch_size], icds[i:i + batch_size]) for i in range(0, len(queries), batch_size)]
    build = functools.partial(prefetch.prompt_rows, backbone.processor, backbone.family, kind)
    batches = prefetch.prepared(build, specs, workers, model.device)
    for batch in tqdm(batches, total=len(specs), desc="ICL means", unit="batch"):
        with layer_states_at(model, states), head_outputs(model, heads):
            model(**data.model_inputs(batch, model.device), logits_to_keep=1)
    mean = lambda store: torch.stack([torch.cat(store[l]).double().mean(0) for l in sorted(store)]).float().cpu()
    return mean(states), mean(heads)


def answer_probability(backbone, batch, positions):
    """Probability of each row's first answer token at its last prompt token: [B]."""
    device = backbone.model.device
    logits, labels = M.target_logits(backbone.model, backbones.to_device(batch, device))
    at = positions.to(device) - (batch["labels"].shape[1] - labels.shape[1])  # within the kept answer window
    rows = torch.arange(len(positions), device=device)
    return logits[rows, at].float().softmax(-1)[rows, labels[rows, at + 1]]


@torch.no_grad()
def indirect_effects(backbone, kind, queries, icds, mean_heads, batch_size, seed):
    """Average indirect effect of every head (Todd et al. 2024), [L, H]: on ICL prompts whose ICD labels are
    shuffled, the rise of the first answer token's probability when the head's output at the last prompt token is
    replaced by its mean over clean prompts (set_head_output), averaged over the prompts."""
    rng = random.Random(seed)  # the corrupted prompts: each ICD list with its targets shuffled among its ICDs
    shuffled = [[dataclasses.replace(d, target=t) for d, t in zip(ds, rng.sample([d.target for d in ds], len(ds)))]
                for ds in icds]
    batches = target_batches(backbone, kind, queries, shuffled, batch_size)
    base = [answer_probability(backbone, b, p) for b, p in batches]
    layers, heads, _ = M.attention_shape(backbone.model)
    aie = torch.zeros(layers, heads, dtype=torch.float64)
    with tqdm(total=layers * heads * len(batches), desc="indirect effects", unit="head x batch") as bar:
        for (batch, positions), p0 in zip(batches, base):
            batch = backbones.to_device(batch, backbone.model.device)  # once, not once per head
            for l, h in itertools.product(range(layers), range(heads)):
                with set_head_output(backbone.model, l, h, mean_heads[l, h], positions):
                    aie[l, h] += (answer_probability(backbone, batch, positions) - p0).double().sum().item()
                bar.update()
    return aie / len(queries)


def function_vector(model, mean_heads, aie, k):
    """Todd et al.'s FV: the sum over the k heads of largest average indirect effect of what each adds to the
    residual stream with its mean output (head_contribution). Returns ([d], the heads as [k, 2] (layer, head))."""
    top = aie.flatten().topk(k).indices
    heads = torch.stack([top // aie.shape[1], top % aie.shape[1]], 1)
    fv = sum(head_contribution(model, l, h, mean_heads[l, h]) for l, h in heads.tolist())
    return fv.float().cpu(), heads


@torch.no_grad()
def layer_losses(backbone, batches, vectors, add):
    """Per decoder layer l: the mean target cross-entropy of the held-out queries (zero-shot, teacher-forced) with
    vectors[l] put in at layer l and the last prompt token (replaced: TV; added: FV). The layer choice."""
    totals, count = [0.0] * len(vectors), 0
    for batch, positions in tqdm(batches, desc="layer choice", unit="batch"):
        batch = backbones.to_device(batch, backbone.model.device)  # once, not once per layer
        for l in range(len(vectors)):
            with steer(backbone.model, l, vectors[l], positions, add):
                logits, labels = M.target_logits(backbone.model, batch)
            totals[l] += M.supervised_loss(logits, labels).item() * len(positions)
        count += len(positions)
    return torch.tensor([total / count for total in totals])


def vector_path(backbone, args, shots):
    """Where a vector is saved, <out>/vectors/<model>-<task>-<tv|fv>-<key>.safetensors, and its key: the hash of
    everything it depends on."""
    spec = dict(backbone=adapter_files.fingerprint(backbone), task=args.task, method=args.vector, shots=shots,
                sets=args.vector_sets, heldout=args.vector_heldout, seed=args.seed, prompts=data.PROMPTS,
                images=teacher_cache.image_key(backbone.processor),  # Idefics2's image splitting changes the prompts
                **({"heads": args.fv_heads, "trials": args.fv_trials} if args.vector == "fv" else {}))
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    name = f"{os.path.basename(args.model.rstrip('/'))}-{tasks.file_name(args.task)}-{args.vector}-{key[:12]}" \
        ".safetensors"
    return os.path.join(args.out, "vectors", name), key


def compute_vector(backbone, args, shots):
    """Extract a TV or FV from the training split and score every layer on the held-out queries. Returns tensors:
    "vectors" [L, d] (TV: the mean state of each layer; FV: the same FV for every layer), "losses" [L]; FV also
    "mean_heads" [L, H, d_h], "aie" [L, H], "heads" [k, 2]."""
    kind, pool = tasks.spec(args.task).kind, tasks.load_task(args.task, "train", args.data_root)
    queries, icds, heldout = vector_sets(pool, args, shots)
    states, mean_heads = icl_means(backbone, kind, queries, icds, args.batch_size, args.workers)
    out = {"vectors": states}
    if args.vector == "fv":
        out["aie"] = indirect_effects(backbone, kind, queries[:args.fv_trials], icds[:args.fv_trials], mean_heads,
                                      args.batch_size, args.seed).float()
        fv, out["heads"] = function_vector(backbone.model, mean_heads, out["aie"], args.fv_heads)
        out |= {"mean_heads": mean_heads, "vectors": fv.expand(len(states), -1).contiguous()}
    batches = target_batches(backbone, kind, heldout, None, args.batch_size, args.workers)
    out["losses"] = layer_losses(backbone, batches, out["vectors"], add=args.vector == "fv")
    return out


def load_vector(backbone, args):
    """The TV or FV for --vector, computed once (compute_vector) and saved, else read back. Returns the steering
    (layer, vector, add) evaluate() applies and the facts the metrics file records."""
    shots, fv = args.shots or tasks.default_shots(args.task, backbone.family), args.vector == "fv"
    layers, heads, _ = M.attention_shape(backbone.model)
    if args.vector_layer is not None and not 0 <= args.vector_layer < layers:
        raise ValueError(f"--vector-layer {args.vector_layer} is out of range: {backbone.name} has decoder layers "
                         f"0..{layers - 1}")
    if fv and not 0 < args.fv_heads <= layers * heads:
        raise ValueError(f"--fv-heads {args.fv_heads} is out of range: {backbone.name} has {layers * heads} heads")
    path, key = vector_path(backbone, args, shots)
    files.remove_stale_tmp(os.path.dirname(path))
    # what the file holds ({name: (shape, dtype)}, None: any), as compute_vector returns it
    shapes = {"vectors": ((layers, backbone.model.config.get_text_config().hidden_size), None),
              "losses": ((layers,), None)}
    if fv:
        shapes |= {"mean_heads": ((layers, heads, None), None), "aie": ((layers, heads), None),
                   "heads": ((args.fv_heads, 2), None)}
    saved = files.read_cache(path, key, shapes)
    if saved is not None:
        print(f"{args.vector}: read {path}")
    else:
        saved = compute_vector(backbone, args, shots)
        files.write_cache(path, saved, key)
        print(f"{args.vector}: computed and saved to {path}")
    layer = args.vector_layer if args.vector_layer is not None else int(saved["losses"].argmin())
    info = {"vector": args.vector, "vector_layer": layer, "vector_file": path, "vector_shots": shots,
            "vector_sets": args.vector_sets, "layer_losses": saved["losses"].tolist(),
            **({"fv_heads": saved["heads"].tolist()} if fv else {})}
    return {"layer": layer, "vector": saved["vectors"][layer], "add": fv, "decoding": fv}, info


def _rows_at(h, positions):
    """(row index, position index) selecting position positions[b] of each row b (the last one when None)."""
    rows = torch.arange(h.shape[0], device=h.device)
    return rows, torch.full_like(rows, h.shape[1] - 1) if positions is None else positions.to(h.device)


@contextlib.contextmanager
def steer(model, layer, vector, positions=None, add=False, decoding=False):
    """Patch the output hidden state of decoder layer `layer` (0-based) at one position per row (positions: [B], or None
    for each row's last token, the last prompt token of a left-padded prompt): replace it by `vector` ([d], or [B, d]
    one per row: task vector, Hendel et al. 2023) or add `vector` to it (function vector, Todd et al. 2024). Forward
    passes over the prompt are patched, and cached decoding steps too if `decoding` (Todd et al. add the FV at every
    generated token; a task vector patches the prompt alone, which later tokens see through the KV cache)."""
    def hook(module, inputs, output):
        h = output[0] if isinstance(output, tuple) else output
        if h.shape[1] == 1 and not decoding:
            return None
        rows, cols = _rows_at(h, positions)
        h = h.clone()
        h[rows, cols] = vector.to(h.device, h.dtype) + (h[rows, cols] if add else 0)
        return (h, *output[1:]) if isinstance(output, tuple) else h
    with M.hooked(model.get_decoder().layers[layer].register_forward_hook(hook)):
        yield


def _recorder(store, layer, positions, shape=(-1,)):
    """A forward hook (a pre-hook: of the input) appending the rows at positions (_rows_at), viewed as [B, *shape],
    to store[layer] on forward passes over the prompt."""
    def hook(module, inputs, output=None):
        h = inputs[0] if output is None else output[0] if isinstance(output, tuple) else output
        if h.shape[1] > 1:
            store.setdefault(layer, []).append(h[_rows_at(h, positions)].view(h.shape[0], *shape).detach())
    return hook


@contextlib.contextmanager
def layer_states_at(model, store, positions=None):
    """Record each decoder layer's output hidden state at one position per row (None: the last): store[l] gets a
    [B, d] tensor per forward pass over the prompt (the states a task vector is made of)."""
    layers = model.get_decoder().layers
    with M.hooked(*(m.register_forward_hook(_recorder(store, l, positions)) for l, m in enumerate(layers))):
        yield store


@contextlib.contextmanager
def head_outputs(model, store, positions=None):
    """Record, per decoder layer, every head's output (the input of the output projection o_proj, head-major) at one
    position per row (None: the last): store[l] gets a [B, H, d_h] tensor per forward pass over the prompt."""
    shape, attns = M.attention_shape(model)[1:], M.decoder_self_attentions(model)
    with M.hooked(*(a.o_proj.register_forward_pre_hook(_recorder(store, l, positions, shape))
                    for l, a in enumerate(attns))):
        yield store


@contextlib.contextmanager
def set_head_output(model, layer, head, value, positions=None):
    """Replace head `head`'s output at decoder layer `layer` (its slice of o_proj's input) by `value` [d_h] at one
    position per row (None: the last), on forward passes over the prompt: Todd et al.'s activation patching."""
    _, _, head_dim = M.attention_shape(model)

    def hook(module, inputs):
        x = inputs[0]
        if x.shape[1] == 1:
            return None
        rows, cols = _rows_at(x, positions)
        x = x.clone()
        x[rows, cols, head * head_dim:(head + 1) * head_dim] = value.to(x.device, x.dtype)
        return (x, *inputs[1:])
    with M.hooked(M.decoder_self_attentions(model)[layer].o_proj.register_forward_pre_hook(hook)):
        yield


def head_contribution(model, layer, head, value):
    """What head `head` of layer `layer` adds to the residual stream when it outputs `value` [..., d_h]: its
    columns of o_proj's weight times value (no bias: that belongs to no head). Returns [..., d]."""
    _, _, head_dim = M.attention_shape(model)
    w = M.decoder_self_attentions(model)[layer].o_proj.weight[:, head * head_dim:(head + 1) * head_dim]
    return value.to(w.device, w.dtype) @ w.T
