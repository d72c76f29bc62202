"""Adapter files: safetensors holding only the adapter and its settings, the run record that says which task and data
made it, and an adapter attached to a backbone from its file (checked against the backbone and the task)."""
import functools
import hashlib
import json
import os

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
import torch

import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.methods import registry


def fingerprint(backbone):
    """A short hash of the backbone's identity: its family and some of its weights (the first four parameters, the first
    and last decoder self-attention's: the layers the adapters act in) rounded to bf16, so the same checkpoint loaded in
    float32 or bf16, by name or by path, gives the same fingerprint, and tiny twins of different seeds differ. A
    sharded backbone's is read once from its gathered weights and kept (lab/run/shard.py:sharded)."""
    if hasattr(backbone.model, "icl_fingerprint"):
        return backbone.model.icl_fingerprint
    own = lambda module: [p for n, p in module.named_parameters() if "icl_adapter" not in n and "lora_" not in n]
    attns = M.decoder_self_attentions(backbone.model)
    params = own(backbone.model)[:4] + own(attns[0]) + own(attns[-1])  # any attached adapter left out, LoRA's too
    h = hashlib.sha256(backbone.family.encode())
    for p in params:
        h.update(str(tuple(p.shape)).encode())
        p = p.full_tensor() if hasattr(p, "full_tensor") else p  # sharded (lab/run/shard.py): all of it
        h.update(p.detach().flatten()[:4096].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def adapter_shape(backbone):
    """The attention shape an adapter checkpoint records, which load_adapter requires to match."""
    return dict(zip(("layers", "heads", "head_dim"), M.attention_shape(backbone.model)))


def backbone_identity(backbone):
    """What ties an adapter checkpoint to its backbone, which load_adapter requires to match unless --force."""
    return {"family": backbone.family, "fingerprint": fingerprint(backbone)}


def save_adapter(path, backbone, run=None):
    """Save the adapter's parameters alone, with its settings (method, sizes, backbone, shape, family, fingerprint)
    and, from a training run, its record (run_record: which task and data made it)."""
    settings = {**backbone.model.icl_settings, "backbone": backbone.name, **adapter_shape(backbone),
                **backbone_identity(backbone)}
    tensors = {k: v.detach().contiguous().cpu() for k, v in M.adapter_modules(backbone.model).state_dict().items()}
    metadata = {"settings": json.dumps(settings)} | ({"run": json.dumps(run)} if run is not None else {})
    files.atomic_write(path, lambda f: f.write(files.sorted_metadata(save(tensors, metadata=metadata))))


# train.py's settings a run record holds: --resume and --proceed refuse a run whose record differs in one
RESUME_MUST_MATCH = ("model", "task", "method", "image_splitting", "shots", "icds", "rices_encoder", "n_train",
                     "n_heldout", "epochs", "batch_size", "grad_accum", "lr", "weight_decay", "warmup", "clip", "rank",
                     "virtual_tokens", "kappa", "lam", "anchor", "anchor_norm", "temperature", "seed", "icd_task")


def run_record(cfg, queries, heldout, icds):
    """What made a run's adapter, as a plain dict: train.py's settings of RESUME_MUST_MATCH (the method, anchor, lambda,
    kappa, rank, ICDs and their task...: a table's column; the task as tasks.task_id: a task of one's own by its real
    path; the shots as the ICDs a query had where --shots left them to the default), the data's folder (real path),
    `data`: data_fingerprint of its queries and ICDs, and `pool`: a single-file task's training pool (its ids' hash),
    which its evaluation half must not hold. last.pt and the adapter file keep it; --resume and evaluate.py compare it
    (restore, check_task)."""
    shots = cfg.shots if cfg.shots is not None or not queries else len(icds[queries[0].id])
    pool = tasks.pool_ids(cfg.task)
    return {**{k: getattr(cfg, k) for k in RESUME_MUST_MATCH}, "task": tasks.task_id(cfg.task), "shots": shots,
            "data_root": cfg.data_root and os.path.realpath(cfg.data_root),
            "data": data_fingerprint(queries, heldout, icds), "pool": pool and short_hash(sorted(map(str, pool)))}


def data_fingerprint(queries, heldout, icds):
    """A hash (16 hex) of a run's data: each training query (id, question, answers, target, category and its image's
    bytes) with its ICDs ({query id: items}), then the held-out queries, in order."""
    digest = functools.lru_cache(maxsize=None)(files.file_digest)  # an image shared by several items read once
    item = lambda it: [it.id, it.question, list(it.answers), it.target, it.category, digest(it.image_path)]
    return short_hash([[item(q), [item(d) for d in icds[q.id]]] for q in queries] + [item(h) for h in heldout])


def short_hash(obj):
    """sha256 of obj as JSON, its first 16 hex digits."""
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def check_task(path, task, scored, trained_on=None):
    """Check the adapter at `path` against the task it is to be scored on, by its record (read_record; none: nothing
    to check). An adapter of another task than `trained_on` (--checkpoint-task: a transfer's source, as Table 8's) or,
    without it, `task` is refused where it is `scored` on `task` (an evaluation, not an analysis), a ValueError naming
    both and the flag that says so; a single-file task whose training pool is no longer the one the adapter was trained
    on (records added or removed: its evaluation half may now hold the adapter's training queries) is said in a
    line."""
    record = read_record(path)
    if record is None:
        return
    if record.get("task") != tasks.task_id(trained_on or task):
        if scored:
            raise ValueError(f"{path} is an adapter of the task {record.get('task')}, not of {trained_on or task} "
                             f"({tasks.task_id(trained_on or task)}); to score it on {task} (a transfer, as Table 8's) "
                             f"give --checkpoint {path} --checkpoint-task {record.get('task')}")
        return
    pool = tasks.pool_ids(task)
    if pool is not None and record.get("pool") != short_hash(sorted(map(str, pool))):
        print(f"warning: the training pool of {task} is not the one {path} was trained beside (records were added or "
              "removed since, and the split by image moved): its evaluation half may hold the adapter's training "
              "queries; train again, or keep the evaluation items in a file of their own (a folder task)")


def read_record(path):
    """The run record (run_record) an adapter file keeps, or None (an adapter saved without one: not by train.py, or
    before records were kept)."""
    try:
        with safe_open(path, "pt") as f:
            record = json.loads((f.metadata() or {}).get("run", "null"))
    except (SafetensorError, OSError, ValueError):
        return None
    if record is not None and not isinstance(record, dict):
        raise ValueError(f"{path}: its metadata 'run' (the run that made it) is {type(record).__name__}, not a record "
                         "of train.py's; the file is damaged or not this project's: train it again")
    return record


ADAPTER_FIELDS = ("method", "backbone", "layers", "heads", "head_dim")  # what every adapter's settings hold


def read_settings(path):
    """An adapter checkpoint's settings; anything else (a folder, a truncated file, train.py's last.pt): ValueError."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; pass the adapter file in it (train.py writes <out>/adapter.safetensors)")
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable adapter checkpoint (a truncated or other kind of file: {e})") from e
    if "settings" not in metadata:
        raise ValueError(f"{path} is not an adapter checkpoint of this project (no settings in its metadata)")
    try:
        settings = json.loads(metadata["settings"])
    except ValueError as e:
        raise ValueError(f"{path}: its settings (metadata) are not JSON ({e}); the file is damaged or not this "
                         "project's") from e
    missing = [k for k in ADAPTER_FIELDS if not isinstance(settings, dict) or k not in settings]
    if missing:
        raise ValueError(f"{path}: its settings lack {', '.join(missing)}; the file is damaged or not this project's")
    wrong = [(k, "text") for k in ADAPTER_FIELDS[:2] if not isinstance(settings[k], str)] + \
        [(k, "a whole number") for k in ADAPTER_FIELDS[2:] if type(settings[k]) is not int]
    if wrong:
        (k, want), = wrong[:1]
        raise ValueError(f"{path}: its settings' {k} is {settings[k]!r}, not {want}; the file is damaged or not this "
                         "project's")
    return settings


def load_adapter(path, backbone, method=None, force=False):
    """Attach the adapter saved at `path` to `backbone`. A checkpoint of another method (than `method`, when given) or
    attention shape fails; one of another family or weights fails unless force=True (then with a warning)."""
    saved = read_settings(path)
    if method is not None and saved["method"] != method:
        raise ValueError(f"{path} holds a {saved['method']!r} adapter, not a {method!r} one")
    shape = adapter_shape(backbone)
    differ = [f"{k} (saved {saved[k]}, here {v})" for k, v in shape.items() if saved[k] != v]
    if differ:
        raise ValueError(f"adapter {path} was trained on {saved['backbone']!r}, which differs from "
                         f"{backbone.name!r} in " + ", ".join(differ))
    here = backbone_identity(backbone)
    differ = [f"{k} (saved {saved.get(k)}, here {v})" for k, v in here.items() if saved.get(k) != v]
    if differ and not force:
        raise ValueError(f"adapter {path} was trained on another backbone than {backbone.name!r}: "
                         + ", ".join(differ) + "; pass --force to load it anyway")
    if differ:
        print(f"warning: --force: loading adapter {path} onto {backbone.name!r} although its " + ", ".join(differ))
    sizes = {k: v for k, v in saved.items() if k not in (*shape, *here, "method", "backbone")}
    tensors, previous = read_tensors(path), attached(backbone.model)  # read before any adapter is detached
    try:
        try:
            registry.attach(backbone.model, saved["method"], **sizes)
        except (ValueError, TypeError, RuntimeError) as e:  # an unknown method, sizes it does not take or cannot make
            raise ValueError(f"{path}: its settings (method {saved['method']!r}, sizes {sizes}) do not make an "
                             f"adapter ({e})") from e
        load_tensors(path, tensors, backbone.model)
    except ValueError:
        reattach(backbone.model, previous)  # a refused file leaves the adapter attached before it in place
        raise
    return saved


def read_tensors(path):
    """An adapter file's tensors; a damaged tensor section is a ValueError naming the file."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: its tensors cannot be read (a truncated or damaged file: {e})") from e


def attached(model):
    """The attached adapter as (its settings, a copy of its tensors), or None: what reattach puts back."""
    if not hasattr(model, "icl_settings"):
        return None
    return dict(model.icl_settings), {k: v.detach().clone() for k, v in M.adapter_modules(model).state_dict().items()}


def reattach(model, previous):
    """Put back the adapter `attached` recorded (None: leave the backbone without one)."""
    if hasattr(model, "icl_settings"):
        M.detach(model)
    if previous is not None:
        settings, tensors = previous
        registry.attach(model, settings["method"], **{k: v for k, v in settings.items() if k != "method"})
        M.adapter_modules(model).load_state_dict(tensors)


def load_tensors(path, tensors, model):
    """Load an adapter file's tensors into the attached adapter; a missing, extra (renamed) or wrongly shaped tensor,
    or one holding NaN or inf, is a ValueError naming the file and the tensor."""
    expected = M.adapter_modules(model).state_dict()
    wrong = [f"{name} is missing" for name in sorted(expected.keys() - tensors.keys())] + \
        [f"{name} is not one of the adapter's" for name in sorted(tensors.keys() - expected.keys())] + \
        [f"{name} is {tuple(tensors[name].shape)}, not {tuple(t.shape)}" for name, t in sorted(expected.items())
         if name in tensors and tensors[name].shape != t.shape] + \
        [f"{name} is {tensors[name].dtype}, not floating point" for name in sorted(expected.keys() & tensors.keys())
         if not tensors[name].is_floating_point()]  # whole numbers would load rounded: another adapter
    if wrong:
        raise ValueError(f"{path} does not hold the adapter its settings describe: " + "; ".join(wrong[:3]) +
                         (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    broken = [name for name, t in sorted(tensors.items()) if t.is_floating_point() and not t.isfinite().all()]
    if broken:  # it would answer nothing, and be scored
        raise ValueError(f"{path}: its tensor {broken[0]} holds NaN or inf" + (f" (and {len(broken) - 1} more)" if
                         broken[1:] else "") + "; the adapter is damaged or its run diverged")
    M.adapter_modules(model).load_state_dict(tensors)
