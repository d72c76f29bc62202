"""--shard: the frozen backbone's parameters sharded over torchrun's processes with FSDP2 (torch's fully_shard), so a
backbone too large for one device runs on several. Each decoder layer and vision layer is its own FSDP unit, and so is
each other module that owns parameters (embeddings, heads, norms): gathered whole only while it runs. The adapter,
attached after sharding, is not FSDP's: every process holds it whole and its gradients are averaged here
(average_gradients), as DistributedDataParallel would, so the adapter, its file, last.pt and the teacher cache are an
unsharded run's. A checkpoint is sharded as it loads, each process reading only its shard (loading).

Every process must call each sharded module as often as the others (each call gathers its parameters from all of
them): a process with fewer batches repeats its last one (share), one that lacks a teacher pass runs a stand-in
(teacher_in_step), and generate() keeps the processes in step past their own answers' end (synced_gpus)."""
import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import data
from lab.models import backbones, published
from lab.run import adapter_files, torchrun


def is_sharded(model):
    """Whether `model` is sharded by FSDP2 (sharded)."""
    return isinstance(model, FSDPModule)


def sharded(backbone):
    """backbone.model's parameters sharded over torchrun's processes in place (unless they are: a checkpoint sharded
    as it loaded, or a backbone a table's runner loaded for several runs): each of units() an FSDP unit, then the root;
    its fingerprint read first; generate() keeping the processes in step. Returns the backbone."""
    world, model = processes(), backbone.model
    if not hasattr(model, "icl_fingerprint"):  # read from the weights whole (gathered where they load sharded), kept
        model.icl_fingerprint = adapter_files.fingerprint(backbone)
    if not is_sharded(model):  # a built twin, or a checkpoint this transformers loaded whole
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))
        for unit, _ in units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model._get_fsdp_state()._lazy_init()  # the root now: generate() calls the vision tower before its forward
    model._is_fsdp_managed_module = True  # transformers' generate() then keeps the processes in step
    if "generate" not in vars(model):
        model.generate = functools.partial(root_gathered, model, model.generate)
    return backbone


def processes():
    """torchrun's number of processes, which --shard shares the backbone among; without torchrun a ValueError naming
    the launch line."""
    world = torchrun.rank_and_world()[1]
    if world == 1:
        raise ValueError("--shard shares the backbone among torchrun's processes: launch it as `torchrun "
                         "--nproc_per_node=N train.py ... --shard` (or evaluate.py), N the number of GPUs")
    return world


def root_gathered(model, generate, *args, **kwargs):
    """generate() with the root unit's parameters gathered throughout: transformers runs the vision tower before the
    model's forward, and where transformers sharded the checkpoint as it loaded, the root unit holds its embeddings."""
    model.unshard()
    try:
        return generate(*args, **kwargs)
    finally:
        model.reshard()


def units(model):
    """The FSDP units of `model` with the parameters each holds, (module or modules, parameters), in the order they
    are sharded (inner ones first): each element of its outermost ModuleLists (decoder layers, vision layers, a
    resampler's layers); then each other module that owns parameters itself (embeddings, norms, heads, a connector's
    pieces: transformers calls some outside the model's forward, as generate() does the vision tower), modules that
    share a parameter (tied embeddings) as one unit."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(f"{p}.") for p, _ in found):
            found += [(f"{name}.{i}", m) for i, m in enumerate(module) if any(True for _ in m.parameters())]
    inside = {id(p) for _, m in found for p in m.parameters()}
    groups = {}  # a parameter's id -> the modules that own it
    for module in reversed([m for m in model.modules() if m is not model]):  # the root's own: the root's unit
        own = [p for p in module.parameters(recurse=False) if id(p) not in inside]
        if own:
            group = next((groups[id(p)] for p in own if id(p) in groups), [])
            group.append(module)
            groups.update({id(p): group for p in own})
    owners = list({id(g): g for g in groups.values()}.values())
    own = lambda group: list({id(p): p for m in group for p in m.parameters(recurse=False)}.values())
    return [(m, list(m.parameters())) for _, m in found] + [(g[0] if len(g) == 1 else g, own(g)) for g in owners]


HEADROOM = 0.9  # the share of a GPU's memory a plan fills: the rest is CUDA's context and the allocator's slack


def weight_bytes(model, n, itemsize=2):
    """Bytes of `model`'s weights one of `n` processes holds under --shard at its peak: its shard of every unit plus
    two units gathered whole (the one running and the next one), in bf16 (itemsize 2)."""
    sizes = sorted((sum(p.numel() for p in params) for _, params in units(model)), reverse=True)
    whole = sum(p.numel() for p in model.parameters())
    return itemsize * (whole if n == 1 else whole / n + sum(sizes[:2]))


def gpus_needed(model, memory, most=64):
    """The fewest processes (a power of two) whose weight_bytes fit HEADROOM of a GPU of `memory` bytes."""
    n = 1
    while n < most and weight_bytes(model, n) > HEADROOM * memory:
        n *= 2
    return n


def loading(load, name, shard):
    """What loads --model `name` and, with --shard, shards it (sharded): `load` (a table's loader) or, None,
    backbones.load_backbone, which with --shard reads only this process's shard of a checkpoint
    (lab/models/families.py:load_checkpoint: transformers shards it with FSDP2 as it loads; a built twin loads whole).
    On CUDA without --shard, a backbone whose weights alone exceed this GPU is refused before anything loads, naming
    the torchrun line that shards it."""
    load = load or backbones.load_backbone
    if shard:
        read = functools.partial(load, shards=processes()) if load is backbones.load_backbone else load
        return lambda *args, **options: sharded(read(*args, **options))
    model = published.meta_model(name) if torch.cuda.is_available() else None
    memory = model and torch.cuda.get_device_properties(0).total_memory
    if model is not None and weight_bytes(model, 1) > HEADROOM * memory:
        n = gpus_needed(model, memory)
        raise ValueError(f"--model {name}: its weights ({weight_bytes(model, 1) / 1e9:.0f} GB in bf16) do not fit "
                         f"this GPU ({memory / 1e9:.0f} GB): shard them over {n} or more, `torchrun "
                         f"--nproc_per_node={n} train.py --model {name} ... --shard` (evaluate.py the same); "
                         f"`python -m lab plan train --model {name} --plan cuda --shard` sizes N with the activations")
    return load


def local_bytes(model):
    """Bytes of `model`'s parameters this process holds: a sharded parameter's local shard, any other whole."""
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    return sum(local(p).numel() * p.element_size() for p in model.parameters())


def share(starts, model):
    """This process's batches of `starts` (each N-th, as torchrun shares them); with a sharded `model` all processes
    take as many, one with fewer repeating its last (or, with none, the last of all): a repeated batch's result is
    the same and is simply written again."""
    rank, world = torchrun.rank_and_world()
    mine = list(starts[rank::world])
    if not is_sharded(model):
        return mine
    return mine + [(mine or list(starts))[-1]] * (-(-len(starts) // world) - len(mine))


def teacher_in_step(run, prepared):
    """The prepared micro-batches of a sharded run (training_batches.prepared), each with a teacher batch wherever
    any process has one to run: a process whose cache holds all of its queries runs its first query's teacher batch
    as a stand-in, whose states nothing reads (training_batches.stored takes as many as the cache lacked)."""
    for micro in prepared:
        if is_sharded(run.backbone.model) and micro["found"] is not None and \
                torchrun.any_of(micro["teacher"] is not None) and micro["teacher"] is None:
            b = run.backbone
            pieces = data.query_pieces(b.processor, b.family, run.kind, micro["queries"][:1])
            micro["teacher"] = data.teacher_batch(b.processor, b.family, run.kind, pieces, micro["icds"][:1])
        yield micro


def average_gradients(parameters):
    """The adapter's gradients averaged over the processes (as DistributedDataParallel averages them), in one
    all-reduce."""
    for p in parameters:
        if p.grad is None:  # unused on this process: its share of the sum is zero
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
