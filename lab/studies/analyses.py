"""The appendix analyses: where the gate opens (the attention shift ICDs cause) and the hyperbolicity of the
states (Eq 18)."""
import functools
import json
import os
import statistics
from dataclasses import dataclass

import torch
from tqdm import tqdm

import data
import lorentz
import model as M
from adapters import HyperICL
from lab.disk import files
from lab.datasets import tasks
from lab.run import prefetch, torchrun
from lab.scores import results


@dataclass
class Settings:
    """The appendix analyses, python -m lab gates and hyperbolicity (lab/cli/modes.py:Evaluation gathers them: a
    field = a flag, its comment the help)."""
    gates: bool = False               # Table 10: a Hyper-ICL checkpoint's gates and Corr(g, Delta A)
    hyperbolicity: bool = False       # Table 9: delta-hyperbolicity of teacher and student (--checkpoint) states


def analysis_batches(backbone, args, items):
    """(teacher, student) prompt batches per --batch-size items: [ICDs; query] and [query], as model inputs, with
    each row's number of query tokens (the last positions of both rows, since both are left-padded)."""
    shots = args.shots or tasks.default_shots(args.task, backbone.family)
    support = tasks.load_task(args.task, "train", args.data_root)
    kind, device = tasks.spec(args.task).kind, backbone.model.device
    groups = [items[i:i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    specs = [(qs, data.demonstrations([q.id for q in qs], support, shots, args.seed)) for qs in groups]
    build = functools.partial(paired_prompts, backbone.processor, backbone.family, kind)
    for teacher, student in tqdm(prefetch.prepared(build, specs, args.workers, device), total=len(specs),
                                 desc=f"{backbone.name} {args.task}", unit="batch"):
        inputs = lambda b: {**data.model_inputs(b, device), "logits_to_keep": 1}  # hidden states only: no vocabulary
        yield (inputs(teacher), inputs(student)), student["query_target"].sum(1).tolist()


def paired_prompts(processor, family, kind, spec):
    """(teacher, student) prompt batches of spec = (queries, their ICDs): with the ICDs and without."""
    return tuple(data.prompt_batch(processor, family, kind, spec[0], d) for d in (spec[1], None))


def aligned_shift(A_icd, A_plain, n_icd, n_plain, T):
    """Eq 19 for one example: Delta A = || A^ICD - A^noICD ||_1 per layer, head and query token, [L, H, T].
    A_icd: [L, H, T, S_icd], A_plain: [L, H, T, S_plain], query-token rows of left-padded rows with n_icd / n_plain
    real tokens. Keys are aligned as the rows are built: the shared start (BOS + instruction) first, the query last;
    the ICD keys have no counterpart, so A^noICD is zero there."""
    start = n_plain - T  # BOS + instruction
    aligned = torch.zeros_like(A_icd)
    first_icd, first_plain = A_icd.shape[-1] - n_icd, A_plain.shape[-1] - n_plain
    aligned[..., first_icd:first_icd + start] = A_plain[..., first_plain:first_plain + start]
    aligned[..., -T:] = A_plain[..., -T:]
    return (A_icd - aligned).abs().sum(-1)


@torch.no_grad()
def gate_analysis(backbone, batches, n):
    """Table 10: mean gate g per layer (over heads and query tokens), early-layer (first quarter) and late-layer
    (last quarter) means, average per-layer std, and Pearson Corr(g, Delta A) (Eq 19) over layers, heads, query
    tokens and the n examples of `batches` (analysis_batches). g is the adapter's (Eq 9) on the query-only prompt;
    Delta A compares the teacher's attention ([ICDs; query], no adapter) with the query-only prompt's (no adapter)."""
    model, gates = backbone.model, []
    if type(M.adapter_modules(model)[0]) is not HyperICL:  # the gate of Eq 9, query-adaptive
        raise ValueError(f"the gate analysis needs a Hyper-ICL adapter, not {model.icl_settings['method']!r}")
    hooks = [a.register_forward_pre_hook(lambda mod, inp: gates.append(mod.gate(inp[0])[..., 0]))
             for a in M.adapter_modules(model)]
    g_all, dA_all = [], []
    with M.hooked(*hooks):
        for (teacher, student), lengths in batches:
            gates.clear()
            model(**student)
            g = torch.stack(gates)                                            # [L, B, H, S_student]
            with M.attention_as(model, "eager"):
                A_icd = model(**teacher, output_attentions=True).attentions   # L x [B, H, S, S]
                A_plain = model(**student, output_attentions=True).attentions
            for b, T in enumerate(lengths):
                rows = lambda A: torch.stack([a[b, :, -T:].float() for a in A])  # [L, H, T, S]
                dA = aligned_shift(rows(A_icd), rows(A_plain), int(teacher["attention_mask"][b].sum()),
                                   int(student["attention_mask"][b].sum()), T)
                g_all.append(g[:, b, :, -T:].flatten(1).float().cpu())
                dA_all.append(dA.flatten(1).cpu())
    g, dA = torch.cat(g_all, 1), torch.cat(dA_all, 1)                         # [L, all heads x tokens]
    quarter, per_layer = max(1, g.shape[0] // 4), g.mean(1)
    return {"per_layer_mean": per_layer.tolist(), "early_mean": per_layer[:quarter].mean().item(),
            "late_mean": per_layer[-quarter:].mean().item(), "per_layer_std": g.std(1).mean().item(),
            "corr_g_delta_attention": torch.corrcoef(torch.stack([g.flatten(), dA.flatten()]))[0, 1].item(),
            "n": n}


def middle_layers(n_layers, k=4):
    """The k middle decoder layers (0-based; all of them when there are fewer)."""
    first = max(0, n_layers // 2 - k // 2)
    return range(first, min(n_layers, first + k))


def query_states(hidden_states, b, T, layers):
    """The metric space of Appendix C for row b: query-token states of the given layers, one point per
    (layer, token): [len(layers) * T, d] in float32."""
    return torch.cat([hidden_states[l + 1][b, -T:] for l in layers]).float()


@torch.no_grad()
def hyperbolicity_analysis(backbone, batches, n, seed, n_samples=1000):
    """Table 9: relative delta-hyperbolicity (Eq 18) of the teacher's ([ICDs; query], no adapter) and the student's
    (query only, with the adapter if one is attached) query-token hidden states in the four middle decoder layers,
    per example of the n of `batches` (analysis_batches) on n_samples quadruples drawn with the same seed (seed + the
    example's number) for teacher and student; mean and std over examples."""
    model = backbone.model
    layers = middle_layers(len(M.decoder_self_attentions(model)))
    deltas, i = {"teacher": [], "student": []}, 0
    for (teacher, student), lengths in batches:
        with M.without_adapter(model):
            h_teacher = model(**teacher, output_hidden_states=True).hidden_states
        h_student = model(**student, output_hidden_states=True).hidden_states
        for b, T in enumerate(lengths):
            for name, h in (("teacher", h_teacher), ("student", h_student)):
                X = query_states(h, b, T, layers)
                gen = torch.Generator(X.device).manual_seed(seed + i)
                deltas[name].append(lorentz.delta_hyperbolicity(torch.cdist(X, X), n_samples, gen).item())
            i += 1
    return {name: {"mean": statistics.mean(d), "std": statistics.pstdev(d)} for name, d in deltas.items()} | \
        {"layers": list(layers), "n": n}


def analysis(backbone, args, items, setting):
    """--gates (Table 10) or --hyperbolicity (Table 9) on `items`: writes <out>/<gates | hyperbolicity>-<task>-<split>
    .json (the result_settings and the result; a file of other settings is refused first, before any work), prints the
    result but its per-layer means, and returns it. Under torchrun the first process writes."""
    name = f"{'gates' if args.gates else 'hyperbolicity'}-{tasks.file_name(args.task)}-{args.split}.json"
    path = os.path.join(args.out, name)
    settings = results.result_settings(backbone, args, setting, items)
    results.check_replaceable(path, {k: settings[k] for k in results.RESULT_SETTINGS if k in settings})
    batches = analysis_batches(backbone, args, items)
    result = gate_analysis(backbone, batches, len(items)) if args.gates else \
        hyperbolicity_analysis(backbone, batches, len(items), args.seed)
    if torchrun.rank_and_world()[0] != 0:
        return result
    files.write_json(path, {**settings, **result}, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "per_layer_mean"}), f"-> {path}")
    return result
