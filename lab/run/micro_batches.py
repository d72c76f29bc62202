"""One training micro-batch as the loop and the first-step diagnostics receive it (pairs): the student's rows and
the teacher's states for them, read from the teacher cache by DataLoader workers where it holds them and computed
by the teacher (handed in: train.py's run_teacher) where not, then laid at the student's aligned positions."""
import errno
import functools
from dataclasses import dataclass

import torch

import data
from lab.disk import files
from lab.models import backbones
from lab.methods import registry
from lab.run import feed, teacher_cache


@dataclass
class Setup:
    """What a DataLoader worker needs to prepare micro-batches (no model): the processor, family, task kind, config,
    the cache's identity (backbone id, image setting) and the shape of the teacher's states (teacher_shape)."""
    processor: object
    family: str
    kind: str
    cfg: object
    cache: dict
    shape: tuple

    @classmethod
    def of(cls, backbone, kind, cfg, cache):
        """The setup of `backbone` for a task of `kind` under `cfg`."""
        return cls(backbone.processor, backbone.family, kind, cfg,
                   {k: cache[k] for k in ("id", "images", "processor") if k in cache},
                   teacher_cache.teacher_shape(backbone.model))


def prepared_micro_batch(setup, spec):
    """Everything of one micro-batch spec = (queries, their ICDs) that needs no model, as a DataLoader worker makes it
    (pairs): the student batch, the queries, and for the anchor what the cache holds (cached_states) and
    the teacher batch of the queries it lacks."""
    (queries, icds), s = spec, setup
    pieces = data.query_pieces(s.processor, s.family, s.kind, queries)
    out = {"student": data.student_batch(s.processor, s.family, s.kind, pieces), "queries": queries, "icds": icds}
    if registry.ANCHORS[s.cfg.anchor].teacher is None:
        return out
    found = teacher_cache.cached_states(s.cfg, s.cache, s.shape, queries, icds, pieces)
    missing = [i for i, state in enumerate(found["states"]) if state is None]
    teacher = data.teacher_batch(s.processor, s.family, s.kind, [pieces[i] for i in missing],
                                 [icds[i] for i in missing]) if missing else None
    return out | {"found": found, "teacher": teacher}


def pairs(run, specs, workers):
    """The (student batch, teacher tensor) of each micro-batch spec = (queries, their ICDs), in order, on run.device:
    prepared by `workers` DataLoader workers while the accelerator runs the ones before (0: here, when asked for),
    then finished (finished), what the cache lacks computed by run.teacher (train.py's run_teacher, handed in),
    bound here once to the run's backbone, task and device."""
    cfg, device, setup = run.cfg, run.device, Setup.of(run.backbone, run.kind, run.cfg, run.cache)
    output = registry.ANCHORS[cfg.anchor].teacher
    teacher = functools.partial(run.teacher, run.backbone, run.kind, pieces=None, device=device, output=output)
    for prepared in feed.prepared(functools.partial(prepared_micro_batch, setup), specs, workers, device):
        yield finished(cfg, prepared, device, run.cache, teacher)


def finished(cfg, prepared, device, cache, teacher):
    """(student batch, teacher tensor for cfg.anchor) of a prepared micro-batch on `device`: the missing teacher
    states computed there by `teacher` (completed_states), the cached ones copied there; laid at the student's
    aligned positions (stack_teacher)."""
    student = {**backbones.to_device(prepared["student"], device),
               "window": data.answer_window(prepared["student"]["labels"])}
    if registry.ANCHORS[cfg.anchor].teacher is None:
        return student, None
    states = completed_states(cfg, prepared, device, cache, teacher)
    if registry.ANCHORS[cfg.anchor].teacher == "logits":
        return student, torch.cat(states)  # answer logits, in the order of answer_positions
    return student, stack_teacher(states, student["query_target"])


def completed_states(cfg, prepared, device, cache, teacher):
    """prepared["found"] (cached_states) with the missing states computed on `device` (where they stay) by
    teacher(queries, icds, batch=their teacher batch, prepared["teacher"]) and stored. The hits and misses are counted
    in `cache`."""
    queries, icds, found, batch = prepared["queries"], prepared["icds"], prepared["found"], prepared["teacher"]
    output = registry.ANCHORS[cfg.anchor].teacher
    states, missing = list(found["states"]), [i for i, s in enumerate(found["states"]) if s is None]
    fresh = teacher([queries[i] for i in missing], [icds[i] for i in missing], batch=batch) if missing else []
    cache["misses"] += len(missing)
    cache["hits"] += len(queries) - len(missing)
    for i, s in zip(missing, fresh):
        states[i] = s
        if not cfg.no_teacher_cache:
            try:
                files.write_cache(found["paths"][i], {output: s.cpu()}, found["keys"][i] + output)
            except OSError as e:  # a full disk mid-run: the sentence of the room check before the first step
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                room = cache.get("room") or teacher_cache.no_room(
                    cfg.teacher_cache, cfg.epochs, s.nbytes * len(missing), len(missing), len(queries))
                raise OSError(e.errno, f"{e.strerror} writing {found['paths'][i]}: {room}") from None
    return [s.to(device, non_blocking=True) for s in states]


def stack_teacher(states, span):
    """Lay per-query teacher states [L, T_q, d] at the student's aligned positions: [L, B, W, d]. Those are each row's
    last T_q positions (data.collate pads on the left), so they are sliced, with no wait for the device."""
    L, d = states[0].shape[0], states[0].shape[-1]
    out = torch.zeros(L, *span.shape, d, dtype=states[0].dtype, device=span.device)
    for b, s in enumerate(states):
        out[:, b, span.shape[1] - s.shape[1]:] = s.to(span.device)
    return out
