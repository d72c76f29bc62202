"""torchrun: the process group, this process's rank, gathering results, DistributedDataParallel over the adapter
and a mean over the global micro-batch."""
import contextlib
import os

import torch
import torch.distributed as dist


def share_of_global_mean(mean, count):
    """This process's share of a mean over the global micro-batch, from the mean over its `count` items: under
    torchrun, N processes hold parts of the micro-batch and DDP averages their gradients, so mean * count * N /
    (global count), whose average over the processes is the mean over the whole micro-batch. Else `mean` itself."""
    if not dist.is_initialized():
        return mean
    total = count.detach().float().clone()
    dist.all_reduce(total)
    return mean * count * dist.get_world_size() / total


@contextlib.contextmanager
def process_group():
    """Under torchrun (WORLD_SIZE set), join the process group for a while: NCCL, one GPU a process, or gloo on CPU."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    try:
        yield
        dist.barrier()  # all done with each other before any tears the group down (on CPU with gloo, a process that
        # did so while its peer still ran was seen to abort: SIGABRT); not after a failure, which torchrun stops
    finally:
        dist.destroy_process_group()


def rank_and_world():
    """(rank, number of processes): (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def any_of(flag):
    """Whether `flag` is true on any process (itself without torchrun)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([float(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return bool(t.item())


def gathered(local):
    """The union of every process's dict (`local` itself without torchrun)."""
    if not dist.is_initialized():
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def data_parallel(model, batch_size, n_train):
    """The backbone in DistributedDataParallel, synchronising the adapter's parameters only (the frozen backbone is
    neither broadcast nor reduced). Every micro-batch of --batch-size queries must give each process at least one."""
    world = dist.get_world_size()
    smallest = min(batch_size, n_train % batch_size or batch_size)
    if smallest < world:
        raise ValueError(f"{world} processes need at least {world} queries in every micro-batch; the smallest has "
                         f"{smallest} (--batch-size {batch_size}, {n_train} training queries)")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad] + [n for n, _ in model.named_buffers()]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=devices)
