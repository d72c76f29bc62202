"""The plan past one GPU (--plan with --shard, or a backbone one GPU cannot hold): the memory of each of N GPUs when
the backbone is sharded over them (lab/run/shard.py), the fewest of --accelerator that hold the run, and the torchrun
line that launches it.

Each of N processes holds its shard of the weights and two units (layers, embeddings, the head) gathered whole at a
time (shard.weight_bytes), the whole adapter and its AdamW state, and the activations of its own queries, about
1/N of each micro-batch (run_plan.memory at that batch; the batch's pixels counted whole)."""
import math

from lab.disk.files import size
from lab.run import shard
from lab.studies import roofline


COUNTS = (1, 2, 4, 8)  # the GPUs a plan considers: one node's


def per_gpu(memory, model, n, batch):
    """{phase: bytes} on each of `n` GPUs (phases "train", "eval_adapter", "eval_icl"): `memory(params, batch)`
    (run_plan.memory with the plan's rows) at each process's share of the batch, its parameters those of
    shard.weight_bytes."""
    mem = memory(shard.weight_bytes(model, n, itemsize=1), math.ceil(batch / n))
    return {k: mem[k] for k in ("train", "eval_adapter", "eval_icl")}


def launch_line(args, script, n):
    """The torchrun line of this run on `n` GPUs of one node, sharded (with --batch-size raised to n where it is
    smaller: every process needs a query of each micro-batch)."""
    flags = f"--model {args.model} --task {args.task}" + (f" --data-root {args.data_root}" if args.data_root else "")
    flags += f" --batch-size {n}" if args.batch_size < n else ""
    return f"torchrun --nproc_per_node={n} {script} {flags} --shard"


def plan(args, memory, model, batch, training):
    """Print each count of COUNTS' memory a GPU under --shard, the fewest --accelerator GPUs that hold the run
    (run_plan.memory's peak within shard.HEADROOM of a GPU) and its torchrun line; return {"gpus": {n: {phase:
    bytes}}, "fewest": n or None, "line": the line or None}. Printed only with --shard or where one GPU is too small
    (train.py and evaluate.py refuse such a backbone unsharded before loading it: shard.loading)."""
    capacity = getattr(roofline.ACCELERATORS.get(args.accelerator), "memory", None)  # the data sheet's bytes
    phase, script = ("train", "train.py") if training else ("eval_icl", "evaluate.py")
    gpus = {n: per_gpu(memory, model, n, batch) for n in COUNTS}
    if capacity is None or (not args.shard and gpus[1][phase] <= shard.HEADROOM * capacity):
        return {"gpus": gpus, "fewest": None, "line": None}
    fits = [n for n in COUNTS if gpus[n][phase] <= shard.HEADROOM * capacity]
    fewest = fits[0] if fits else None
    line = fewest and launch_line(args, script, fewest)
    print(f"--shard on N {args.accelerator} GPUs ({size(capacity)} each, {shard.HEADROOM:.0%} of it planned), a GPU's "
          f"peak ({'training' if training else 'evaluation, n-shot ICL'}): "
          + "; ".join(f"{n}: ~{size(gpus[n][phase])}" for n in COUNTS))
    print(f"fewest that hold it: {fewest} -> {line}" if fewest else
          f"not even {COUNTS[-1]} {args.accelerator} GPUs hold it: lower --batch-size or --image-memory")
    if not args.shard and line:
        print(f"one {args.accelerator} does not hold --model {args.model} (~{size(gpus[1][phase])}): run it sharded")
    return {"gpus": gpus, "fewest": fewest, "line": line}
