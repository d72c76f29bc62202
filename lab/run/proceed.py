"""--proceed: what a run's folder holds decides what train.py does with it (start, continue, or skip a finished run),
each finished run checked against the settings and data of the command that finds it."""
import dataclasses
import os

import data
from lab.datasets import tasks
from lab.models import families
from lab.run.adapter_files import read_record, RESUME_MUST_MATCH, run_record
from lab.run.resume import read_run, record_differences


def differences(state, args):
    """The settings of RESUME_MUST_MATCH in which a saved run's state (read_run) differs from args, as flags."""
    return [f"--{k.replace('_', '-')} {state['args'].get(k)} (now {getattr(args, k)})" for k in RESUME_MUST_MATCH
            if state["args"].get(k) != getattr(args, k)]


def proceeding(args):
    """What --proceed does with --out: None if it holds this run finished (last.pt of these settings and data, every
    epoch scored or --max-steps taken, history.json and its best adapter written): nothing to do; args with --resume
    if it holds this run stopped (or finished with RICES's ICDs, which need the backbone: restore checks them); args
    with --overwrite if it holds none (no last.pt: without_last_pt). A run of other settings or data, or a finished one
    without its best adapter, is refused (a ValueError naming them), as --resume refuses it."""
    path, adapter = os.path.join(args.out, "last.pt"), os.path.join(args.out, "adapter.safetensors")
    if not os.path.exists(path):
        return without_last_pt(args)
    state = read_run(path)
    differ, step, scored = differences(state, args), state["progress"]["step"], len(state["progress"]["history"])
    done = scored == args.epochs or args.max_steps is not None and step >= args.max_steps
    if done and scored and not differ and not os.path.exists(adapter):
        raise ValueError(f"--proceed: {args.out} holds a finished run ({scored} epoch(s) scored) without its best "
                         f"adapter {adapter} (removed since?); train it again with --overwrite")
    if not differ and (not done or args.icds == "rices" or not os.path.exists(os.path.join(args.out, "history.json"))):
        return dataclasses.replace(args, resume=True)
    if not differ:  # finished: its record against this run's data
        differ = record_differences(state, this_record(args), path)
    if differ:
        raise ValueError(f"--proceed: {path} was made with " + ", ".join(differ) + "; give another --out, or "
                         "--overwrite to replace it")
    return None


def this_record(args):
    """The run record (run_record) of the run these flags start, its ICDs drawn as train.py draws random ones."""
    queries, heldout, support, shots = tasks.split_pool(args, families.family_of(args.model))
    ids = [q.id for q in queries]
    icds = dict(zip(ids, data.demonstrations(ids, support, shots, args.seed)))
    return run_record(args, queries, heldout, icds)


def without_last_pt(args):
    """What --proceed does with an --out that holds no last.pt: start the run (args with --overwrite) where it holds
    no run file either, or only this run's adapter (a run killed before its first checkpoint: said in a line); None
    (finished) where its adapter's run record and history.json are this run's settings and data (last.pt removed to
    save disk). Anything else (an adapter of other settings or data or without a record, the history alone, a
    finished RICES run, whose ICDs only last.pt checks) is refused, a ValueError naming the file, which is kept."""
    adapter, history = (os.path.join(args.out, f) for f in ("adapter.safetensors", "history.json"))
    if not os.path.exists(adapter) and not os.path.exists(history):
        return dataclasses.replace(args, overwrite=True)
    if not os.path.exists(adapter):
        raise ValueError(f"--proceed: {args.out} holds a finished run (history.json) without its best adapter "
                         f"{adapter} nor its last.pt (removed since?); train it again with --overwrite, or give "
                         "another --out")
    record = read_record(adapter)
    if args.icds == "rices" and os.path.exists(history):
        raise ValueError(f"--proceed: {args.out} holds a finished RICES run without its last.pt, which alone checks "
                         "its ICDs; keep its adapter with another --out, or train it again with --overwrite")
    differ = ["no run record (not a train.py adapter of this project)"] if record is None else \
        record_differences({"run": record}, this_record(args), adapter)
    if differ:
        raise ValueError(f"--proceed: {adapter} was made with " + ", ".join(differ) + "; it is kept: give another "
                         "--out, or --overwrite to replace it")
    if os.path.exists(history):
        return None
    print(f"note: {args.out} holds the adapter of this run but no last.pt nor history.json (killed before its first "
          "checkpoint, or both removed): training it again")
    return dataclasses.replace(args, overwrite=True)
