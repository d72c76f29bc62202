"""Batches built by torch DataLoader workers while the model runs: the builders of prompts, SEED-Bench's option rows
and student rows, a worker's error raised as the worker raised it, the default number of workers."""
import contextlib
from dataclasses import dataclass, replace
import os
import signal
import threading

import torch

import data


class Prepared(torch.utils.data.Dataset):
    """build(specs[k]) as the k-th item (prepared)."""

    def __init__(self, build, specs, on_host):
        self.build, self.specs, self.on_host = build, specs, on_host

    def __len__(self):
        return len(self.specs)

    def __getitem__(self, k):
        try:
            out = self.build(self.specs[k])
        except Exception as e:  # handed back whole: torch would re-raise it with the worker's traceback in its text
            return Failed(e)
        return on_host(out) if self.on_host else out


@dataclass
class Failed:
    """What a DataLoader worker hands back for an item it could not build: the error, raised again by prepared."""
    error: Exception


def on_host(obj):
    """obj with every batch in it (a dict holding pixel_norm, at any depth of dicts) normalised: for a CPU run, whose
    device is the host, so that the workers do that work too."""
    return data.normalised({k: on_host(v) for k, v in obj.items()}) if isinstance(obj, dict) else obj


WORKER_TIMEOUT = 300  # seconds a DataLoader worker's batch may be waited for (a stopped worker: never, else)


class WorkerFailed(OSError):
    """A DataLoader worker died (killed, out of memory) or stopped answering: named in one line, no traceback."""


def prepared(build, specs, workers, device="cpu"):
    """build(spec) for each spec, in order, made by `workers` DataLoader worker processes ahead of their use (two
    each in flight) while this process computes (0: here, when asked for; the same items); pinned for a CUDA
    `device`, so model_inputs copies them without waiting. build must need no model (a worker has none). An error
    in a worker is raised here as it was raised there (an unreadable image names its item and file, one line); a
    worker that dies, or whose batch takes over WORKER_TIMEOUT seconds, is a WorkerFailed saying so."""
    cuda = str(device).startswith("cuda")
    loader = torch.utils.data.DataLoader(Prepared(build, specs, not cuda), batch_size=None, num_workers=workers,
                                         pin_memory=cuda, prefetch_factor=2 if workers else None,
                                         timeout=WORKER_TIMEOUT if workers else 0,
                                         generator=torch.Generator())  # its seed draw leaves the global RNG alone
    batches = iter(loader)  # with workers, torch's SIGCHLD handler is set: a dead worker raises wherever we are
    with worker_deaths_named(workers, batches):
        for k in range(len(specs)):
            try:
                item = next(batches)
            except (RuntimeError, EOFError) as e:  # Failed carries build's own errors: these are the loader's
                if not workers:
                    raise
                stop_workers(batches)
                raise failed(e, f"batch {k + 1} of {len(specs)}") from None
            if isinstance(item, Failed):
                raise item.error
            yield item


def stop_workers(batches):
    """Kill a failed loader's workers (a stopped worker ignores the loader's SIGTERM) and take their pids from torch's
    SIGCHLD handler, which would otherwise raise for the dead one at every later SIGCHLD."""
    for worker in getattr(batches, "_workers", []):
        worker.kill()
    if getattr(batches, "_worker_pids_set", False):
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False


def failed(error, where):
    """The WorkerFailed that names a DataLoader's error (torch's message: the worker's pid and signal, a timeout)."""
    why = " ".join(str(error).split())[:200] or type(error).__name__
    return WorkerFailed(f"{where}: a DataLoader worker failed ({why}); rerun (train.py: --resume), or with "
                        "--workers 0 to prepare the batches in this process")


@contextlib.contextmanager
def worker_deaths_named(workers, batches):
    """While the batches are used: torch's SIGCHLD handler, which raises a RuntimeError in this process wherever it
    is (in the model's forward, say) when a worker dies, raises WorkerFailed instead. Only in the main thread."""
    previous = signal.getsignal(signal.SIGCHLD)
    if not workers or not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_child(signum, frame):
        try:
            previous(signum, frame)
        except RuntimeError as e:  # named once: the loader is done, torch's handler would raise again at its next
            signal.signal(signal.SIGCHLD, previous)  # SIGCHLD, anywhere, long after the batches were given up
            stop_workers(batches)
            raise failed(e, "while the batches were used") from None
    signal.signal(signal.SIGCHLD, on_child)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


def default_workers():
    """--workers' default. With a GPU: the cores this process may use, shared among the processes torchrun starts on
    the machine, less one for the process itself, at most 8. Without one: 0, for the model's own threads use the
    cores, and a worker beside them made training slower than preparing in-process (docs/efficiency.md, "Feeding the
    accelerator")."""
    if not torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


def student_rows(processor, family, kind, queries):
    """The student batch of queries (their pieces made for it alone): the held-out loss's batches."""
    return data.student_batch(processor, family, kind, data.query_pieces(processor, family, kind, queries))


def prompt_rows(processor, family, kind, spec):
    """The prompt batch of spec = (items, their ICDs or None): data.prompt_batch."""
    return data.prompt_batch(processor, family, kind, *spec)


def option_rows(processor, family, kind, spec):
    """The batch of lab/scores/seed_likelihood.py for spec = (items, their ICDs or None): four rows an item, one per
    option, under the "choice-likelihood" prompt (`kind` is that one)."""
    items, icds = spec
    kind, rows = "choice-likelihood", []
    for it, ds in zip(items, icds or [[] for _ in items]):
        if len(it.answers) != len(data.SEED_LETTERS):
            raise ValueError(f"item {it.id}: --seed-protocol likelihood ranks {len(data.SEED_LETTERS)} options, it has "
                             f"{len(it.answers)}")
        with_text = [replace(d, target=d.answers[data.SEED_LETTERS.index(d.target)]) for d in ds]
        prefix = data.encode_prefix(processor, family, kind, with_text)
        rows += [data.join(prefix, data.encode_query(processor, family, kind, replace(it, target=o)))
                 for o in it.answers]
    return data.collate(rows, processor, family)
