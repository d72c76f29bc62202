"""Memory as planned (lab/models/chunks.py): the forward keeps only what it uses (the teacher's query positions layer
by layer, images encoded in chunks) with the same numbers."""
import pytest
import torch

import benchmarks
import data
import model as M
import train
from lab.datasets import tasks
from lab.models import backbones, chunks, families


def teacher_rows(backbone, n=3, shots=2):
    """n VQAv2 queries with `shots` ICDs each, as the teacher reads them: (queries, icds, pieces, batch)."""
    pool = tasks.load_task("vqav2", "train", benchmarks.ROOT)
    queries = pool[:n]
    icds = data.demonstrations([q.id for q in queries], pool[n:], shots, 0)
    pieces = data.query_pieces(backbone.processor, backbone.family, "vqa", queries)
    return queries, icds, pieces, data.teacher_batch(backbone.processor, backbone.family, "vqa", pieces, icds)


def calls_of(modules):
    """Count the calls of each module's first child (once per chunk of images), and record the images (the leading
    size of its first tensor) each module is called on."""
    counts, images = [0] * len(modules), [[] for _ in modules]
    for k, module in enumerate(modules):
        first = next(module.children())
        first.register_forward_hook(lambda *a, k=k: counts.__setitem__(k, counts[k] + 1))
        module.register_forward_pre_hook(lambda m, args, kwargs, k=k: images[k].append(
            next(v for v in [*args, *kwargs.values()] if torch.is_tensor(v)).shape[0]), with_kwargs=True)
    return counts, images


@pytest.mark.parametrize("family", families.available())
def test_images_in_chunks_give_the_numbers_of_one_call(family):
    """One image a call (a budget of 1 byte) against every image in one call: float64 to 1e-12, the arithmetic the
    same; float32 to 1e-6 (MKL's GEMM picks another kernel for fewer rows at some widths: Idefics2's projection at
    K = 128 differs by 2e-7, the LLaVA models' towers are bit-identical here)."""
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        backbone = backbones.load_backbone(f"tiny-{family}", dtype=dtype, image_memory=1e18)
        batch = data.model_inputs(teacher_rows(backbone)[3])
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        modules = chunks.image_modules(backbone.model)
        counts, images = calls_of(modules)
        with torch.no_grad():
            whole = backbone.model(**batch).logits
            once = list(counts)
            chunks.chunk_images(backbone.model, 1)
            chunked = backbone.model(**batch).logits
        n = [seen[0] for seen in images]  # the paper's families: 3 rows x 3 images; InternVL tiles, Idefics3 crops
        assert once == [1] * len(modules) and counts == [1 + k for k in n]  # then one image a call
        assert family not in ("idefics2", "idefics", "llava-interleave", "llava-onevision") or n == [9] * len(n)
        scale = whole.abs().max()
        assert (whole - chunked).abs().max() <= tolerance * scale, (dtype, (whole - chunked).abs().max())


@pytest.mark.parametrize("family", families.available())
def test_the_teacher_keeps_only_the_query_positions_as_each_layer_runs(family):
    """run_teacher's states equal the query + target positions of every layer's whole output, bit for bit, and the
    hooks never hold a layer's whole [B, W, d]: each keeps [kept positions, d] only."""
    backbone = backbones.load_backbone(f"tiny-{family}")
    queries, icds, pieces, batch = teacher_rows(backbone)
    keep = batch["query_target"]
    with torch.no_grad():
        full = torch.stack(M.layer_outputs(backbone.model, **data.model_inputs(batch), logits_to_keep=1)[1])
        kept = M.layer_outputs(backbone.model, keep=keep, **data.model_inputs(batch), logits_to_keep=1)[1]
    assert [tuple(h.shape) for h in kept] == [(int(keep.sum()), full.shape[-1])] * full.shape[0]
    states = train.run_teacher(backbone, batch)
    assert len(states) == len(queries)
    for b, s in enumerate(states):
        assert torch.equal(s, full[:, b, keep[b]]) and s.is_contiguous()
