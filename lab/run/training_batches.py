"""One training micro-batch, from its queries to what the loss reads: the student's rows and what the teacher cache
holds for them, prepared by DataLoader workers (prepared); then, once train.py's loop has run the teacher on the
queries the cache lacked, the pair on the device: the student batch and the teacher's tensor, stored and laid at the
student's positions (pair)."""
import errno
import functools
from dataclasses import dataclass

import torch

import data
from lab.disk import files
from lab.models import backbones
from lab.run import anchor_scale, prefetch, teacher_cache

KEY = ("id", "images", "processor", "task", "output", "folder")  # the cache's identity (teacher_cache.identity)


@dataclass
class Setup:
    """What a DataLoader worker needs to prepare micro-batches (no model, no Config): the processor, family and task
    kind, the teacher cache's identity (KEY: its keys, tensor and folder) and the teacher states' shape."""
    processor: object
    family: str
    kind: str
    cache: dict
    shape: tuple

    @classmethod
    def of(cls, backbone, kind, cache):
        """The setup of `backbone` for a task of `kind` and the run's teacher cache."""
        return cls(backbone.processor, backbone.family, kind, {k: cache[k] for k in KEY},
                   teacher_cache.teacher_shape(backbone.model))


def prepared_micro_batch(setup, spec):
    """Everything of one micro-batch spec = (queries, their ICDs) that needs no model, as a DataLoader worker makes it:
    the student batch, the queries and ICDs, what the teacher cache holds for them ("found": cached_states; None
    where no teacher runs) and the teacher batch of the queries it lacks ("teacher"; None where it lacks none)."""
    (queries, icds), s = spec, setup
    pieces = data.query_pieces(s.processor, s.family, s.kind, queries)
    out = {"student": data.student_batch(s.processor, s.family, s.kind, pieces), "queries": queries, "icds": icds,
           "found": None, "teacher": None}
    if s.cache["output"] is None:
        return out
    found = teacher_cache.cached_states(s.cache, s.shape, queries, icds, pieces)
    missing = [i for i, state in enumerate(found["states"]) if state is None]
    teacher = data.teacher_batch(s.processor, s.family, s.kind, [pieces[i] for i in missing],
                                 [icds[i] for i in missing]) if missing else None
    return out | {"found": found, "teacher": teacher}


def prepared(run, specs, workers):
    """prepared_micro_batch of each spec = (queries, their ICDs), in order: made by `workers` DataLoader workers while
    the accelerator runs the ones before (0: here, when asked for)."""
    setup = Setup.of(run.backbone, run.kind, run.cache)
    return prefetch.prepared(functools.partial(prepared_micro_batch, setup), specs, workers, run.device)


def pair(run, prepared, computed):
    """(student batch, teacher tensor) of a prepared micro-batch on run.device: the teacher's tensors the cache held
    and `computed`, those the loop's teacher computed for the queries it lacked (in their order), stored (stored);
    LIVE's answer logits concatenated, states laid at the student's positions (align_teacher). Not in the paper:
    a fresh run's first pair shows the anchor's scale on the backbone (anchor_scale.anchor_regime)."""
    student = {**backbones.to_device(prepared["student"], run.device),
               "window": data.answer_window(prepared["student"]["labels"])}
    if prepared["found"] is None:
        return student, None
    states = [s.to(run.device, non_blocking=True) for s in stored(run.cache, prepared, computed, run.cfg.epochs)]
    if run.cache["output"] == "logits":
        return student, torch.cat(states)  # answer logits, in the order of answer_positions
    teacher = align_teacher(states, student["query_target"])
    if run.regime:
        run.regime = False
        anchor_scale.anchor_regime(run.cfg.anchor, run.cfg.kappa, student["query_target"], teacher)
    return student, teacher


def stored(cache, prepared, computed, epochs):
    """prepared["found"]'s tensors (cached_states) with the run's tensor of `computed` (train.run_teacher's "both")
    put where the cache had none, and both tensors written to it (not with --no-teacher-cache), so that a method
    distilling from the other reads this pass; the hits and misses counted in `cache`. A full disk is an OSError
    naming the cache's size and folder (teacher_cache.no_room, over --epochs)."""
    queries, found, output = prepared["queries"], prepared["found"], cache["output"]
    states, missing = list(found["states"]), [i for i, s in enumerate(found["states"]) if s is None]
    cache["misses"] += len(missing)
    cache["hits"] += len(queries) - len(missing)
    for i, both in zip(missing, computed):
        states[i] = both[output]
        if cache["folder"] is not None:
            key = found["keys"][i]
            try:
                for name, tensor in both.items():
                    files.write_cache(teacher_cache.tensor_file(cache["folder"], key, name), {name: tensor.cpu()},
                                      key + name)
            except OSError as e:  # a full disk mid-run: the sentence of the room check before the first step
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                need = sum(t.nbytes for t in both.values()) * len(missing)
                room = cache.get("room") or teacher_cache.no_room(cache["folder"], epochs, need, len(missing),
                                                                  len(queries))
                raise OSError(e.errno, f"{e.strerror} writing {found['paths'][i]}: {room}") from None
    return states


def align_teacher(states, query_target):
    """Eq 16's alignment: per-query teacher states [L, T_q, d] laid at their student rows' query_target, [L, B, W, d]
    (0 elsewhere). collate pads on the left, so they are each row's last T_q positions: sliced, no wait for a device."""
    out = states[0].new_zeros(states[0].shape[0], *query_target.shape, states[0].shape[-1], device=query_target.device)
    for b, s in enumerate(states):
        out[:, b, query_target.shape[1] - s.shape[1]:] = s.to(query_target.device)
    return out
