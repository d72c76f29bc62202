"""A run's folder over time: its last.pt written for --resume and read back (checked against the run record), and a
folder claimed by one run (what --proceed does with a folder: lab/run/proceed.py)."""
import os
import pickle

import torch

import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.run import adapter_files, torchrun


def save_run(run):
    """Everything a resumed run needs, written to <out>/last.pt (by the first process alone under torchrun)."""
    if torchrun.rank_and_world()[0] != 0:
        return
    state = {"adapter": M.adapter_modules(run.backbone.model).state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "progress": run.progress, "args": vars(run.cfg),
             "rng": torch.get_rng_state(), "processes": torchrun.rank_and_world()[1], "run": run.record,
             "fingerprint": run.cache["id"]}  # the backbone's weights (fingerprint): a resume needs the same
    files.atomic_write(os.path.join(run.cfg.out, "last.pt"), lambda f: torch.save(state, f))


def restore(out, backbone, optimizer, scheduler, record):
    """Load <out>/last.pt into the run; refuse if it was made with other settings or other data than this run's record
    (run_record), naming the file; last.pt is left as it is."""
    path = os.path.join(out, "last.pt")
    if not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path}")
    state = read_run(path)
    differ = record_differences(state, record, path)
    if state.get("processes", 1) != torchrun.rank_and_world()[1]:
        differ.append(f"{state.get('processes', 1)} processes (now {torchrun.rank_and_world()[1]}; a resume is exact "
                      "only with as many as before)")
    here = adapter_files.fingerprint(backbone)
    if state.get("fingerprint", here) != here:
        differ.append(f"other weights of --model {record['model']} (fingerprint {state['fingerprint']}, now {here})")
    if differ:
        raise SystemExit(f"--resume: {path} was made with " + ", ".join(differ) + "; it is left as it is")
    M.adapter_modules(backbone.model).load_state_dict(state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["progress"]


def record_differences(state, record, path):
    """What differs between the run record a last.pt holds (a last.pt of before records: its args) and this run's
    (run_record): the settings of RESUME_MUST_MATCH as flags, and its data (a last.pt without a fingerprint of them:
    a warning, assumed to be this run's)."""
    must = adapter_files.RESUME_MUST_MATCH
    saved = state.get("run") or {**{k: state["args"].get(k) for k in must},  # a last.pt of before run records
                                 "task": tasks.task_id(state["args"].get("task", ""))}
    differ = [f"--{k.replace('_', '-')} {saved.get(k)} (now {record[k]})" for k in must
              if saved.get(k) != record[k]]
    if "data" not in saved:
        print(f"warning: {path} holds no fingerprint of its data (made before they were kept); its training queries "
              "and ICDs are assumed to be this run's")
    elif saved["data"] != record["data"]:
        differ.append(f"other training data (its training or held-out queries, their answers, images or ICDs differ: "
                      f"fingerprint {saved['data']}, now {record['data']}; --data-root {saved.get('data_root')}, now "
                      f"{record['data_root']}; was the task changed since?)")
    return differ


def read_run(path):
    """The state a last.pt holds, unpickled with weights_only=True (tensors, numbers, strings, lists, dicts: no code
    of the file runs); anything else (a truncated, corrupt or crafted file) is a ValueError naming it."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")  # not rank 0's GPU on every process
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        if "weights only" in str(e).lower():  # torch's message would suggest weights_only=False: not repeated
            raise ValueError(f"--resume: {path} is not a checkpoint of this project (it holds more than tensors, "
                             "numbers, strings, lists and dicts); start over with --overwrite") from None
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise ValueError(f"--resume: {path} is unreadable (truncated or corrupt: {why}); start over with "
                         "--overwrite") from None
    if not isinstance(state, dict) or not {"adapter", "optimizer", "scheduler", "progress", "args", "rng"} <= \
            state.keys():
        raise ValueError(f"--resume: {path} is not a checkpoint of this project (not the dict train.py saves); "
                         "start over with --overwrite")
    return state


def claim(args):
    """Make --out this run's folder: one that holds another run is refused unless --resume (continue it) or
    --overwrite (its run files are deleted first, so none of them is left beside the new run's). Temporary files of
    interrupted writes are cleaned up here and in the teacher cache."""
    found = [f for f in ("last.pt", "adapter.safetensors", "history.json") if os.path.exists(os.path.join(args.out, f))]
    if found and not (args.resume or args.overwrite):
        raise ValueError(f"{args.out} holds a run ({', '.join(found)}); continue it with --resume or replace it "
                         "with --overwrite")
    if torchrun.rank_and_world()[0] != 0:
        return
    for f in found if args.overwrite else []:
        os.remove(os.path.join(args.out, f))
    if found and args.overwrite:
        print(f"--overwrite: removed {', '.join(found)} of the run in {args.out}; training it again")
    files.remove_stale_tmp(args.out)
    files.remove_stale_tmp(args.teacher_cache)


def default_out(model, task, method):
    """The default output folder of a run: runs/<model>-<task>-<method>."""
    return os.path.join("runs", f"{os.path.basename(model.rstrip('/'))}-{tasks.file_name(task)}-{method}")
