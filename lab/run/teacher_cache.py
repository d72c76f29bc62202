"""The teacher cache: one file per query of the teacher's states (or answer logits), keyed by everything they
depend on, read by DataLoader workers, refused and recomputed when truncated, foreign or damaged."""
import hashlib
import json
import os
import shutil

import torch

import data
import model as M
from lab.disk import files
from lab.models import backbones, families
from lab.run import adapter_files


def teacher_key(backbone_id, task, query, icds, images=None, processor=None):
    """The cache key of one query's teacher states: backbone, task, query, its ICDs and each one's image file (the
    sha256 of its bytes, image_digest: an image replaced at the same path is another key, even of the same size and
    modification time), the prompt format, how images are encoded
    (`images`: Idefics2's image splitting, which changes the query's tokens; `processor`: processor_settings) and the
    version of what the states are (model.LAYER_OUTPUTS_VERSION), so states cached under another definition are never
    read."""
    item = lambda it: [it.id, it.image_path, image_digest(it.image_path), it.question, it.target]
    spec = {"backbone": backbone_id, "task": task, "query": item(query), "icds": [item(d) for d in icds],
            "prompts": data.PROMPTS, "separator": data.SEPARATOR, "states": M.LAYER_OUTPUTS_VERSION, "images": images,
            "processor": processor}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def image_digest(path):
    """The sha256 of an image file's bytes (files.file_digest: a small cost beside the tens of MB of teacher states
    its key reads, docs/efficiency.md), None where there is no file."""
    try:
        return files.file_digest(path)
    except (OSError, TypeError, ValueError):
        return None


def processor_settings(processor):
    """A short hash of the processor's settings (to_dict: the image processor's size, mean, std, resizing, rescaling,
    splitting, the image tokens...), what the teacher's states depend on besides the weights and the text."""
    settings = processor.to_dict() if hasattr(processor, "to_dict") else None
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_teacher(path, key, shape, output="states"):
    """One query's cached teacher tensor `output` ("states" or "logits") of `shape` (None: any size), or None if there
    is no file or it is unusable (truncated, another shape, key or checksum: reported), so it is computed again."""
    cached = files.read_cache(path, key + output, {output: (shape, None)})
    return None if cached is None else cached[output]


def identity(backbone, task, output, folder):
    """A run's teacher cache: what its keys hold besides the query (the backbone's id, the image setting, the
    processor's settings, the task: teacher_key), the tensor it keeps ("states" or "logits", registry.Anchor.teacher)
    and its folder (--teacher-cache; None: --no-teacher-cache, nothing read or kept); with the counts of the teacher's
    tensors computed and reused. All a DataLoader worker needs of it is plain values (training_batches.Setup)."""
    return {"id": adapter_files.fingerprint(backbone), "images": image_key(backbone.processor),
            "processor": processor_settings(backbone.processor), "task": task, "output": output, "folder": folder,
            "hits": 0, "misses": 0}


TENSORS = ("states", "logits")  # what one teacher pass caches of a query: every distilling method reads one of them


def teacher_file(cache, query, icds):
    """One query's cache key and file in the cache's folder: its teacher states, or LIVE's answer logits."""
    key = teacher_key(cache["id"], cache["task"], query, icds, cache.get("images"), cache.get("processor"))
    return key, tensor_file(cache["folder"], key, cache["output"])


def tensor_file(folder, key, output):
    """The file of one query's teacher tensor `output` (TENSORS), both written by the one pass that computed them."""
    return os.path.join(folder, key + ("-logits" if output == "logits" else "") + ".safetensors")  # states: none


def query_sizes(pieces):
    """(T_q, answer tokens) of each query piece (data.query_pieces): the sizes of its teacher tensor."""
    return [(len(p["input_ids"]), sum(x != -100 for x in p["labels"])) for p in pieces]


def query_tokens(processor, family, kind, queries):
    """query_sizes of every query without loading its image: one query encoded in full (data.query_pieces) gives the
    tokens its image stands for, a count fixed per family and setting (Idefics2 66 or 326, LLaVA-Interleave 729,
    LLaVA-OneVision 730), and each query adds the tokens of its own text (text_tokens)."""
    (reference, _), = query_sizes(data.query_pieces(processor, family, kind, queries[:1]))
    image = reference - text_tokens(processor, family, kind, queries[0])[1]
    return [(image + whole, whole - prompt) for prompt, whole in (text_tokens(processor, family, kind, q)
                                                                  for q in queries)]


def text_tokens(processor, family, kind, query):
    """Tokens of the query's prompt and of its prompt + answer by the tokenizer alone, the image placeholder one
    special token (each family's image tokens end in a special token too, so the text after it reads the same)."""
    count = lambda text: len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt = data.prompt_text(kind, query)
    return count(prompt), count(prompt + data.answer_text(processor, family, kind, query.target))


def teacher_shape(model):
    """(layers, width) of the teacher's states: what a cached tensor must have besides its tokens."""
    return M.attention_shape(model)[0], model.config.get_text_config().hidden_size


def cached_states(cache, shape, queries, icds, pieces):
    """What the cache holds for these queries, read without the model (in a DataLoader worker): {"states": each
    query's cached tensor, None where there is none or it is unusable (all None with --no-teacher-cache), "keys",
    "paths"}. shape: teacher_shape."""
    if cache["folder"] is None:
        return {"states": [None] * len(queries), "keys": None, "paths": None}
    output = cache["output"]
    keys, paths = zip(*(teacher_file(cache, q, d) for q, d in zip(queries, icds)))
    shapes = [(answers, None) if output == "logits" else (shape[0], tokens, shape[1])
              for tokens, answers in query_sizes(pieces)]
    states = [read_teacher(p, k, s, output) for p, k, s in zip(paths, keys, shapes)]
    return {"states": states, "keys": list(keys), "paths": list(paths)}


CACHE_HEADER = 300  # bytes of a cache file besides its tensor: safetensors' header with the key and checksum


def image_key(processor):
    """What of the processor's image settings changes the query's tokens: whether it splits or tiles images
    (families.splitting_on: Idefics2, Idefics3, SmolVLM, InternVL3, Gemma 3; None else)."""
    return families.splitting_on(processor)


def cache_bytes(config, sizes, dtype):
    """The mean bytes a query's teacher pass caches (both its files, TENSORS) over `sizes` (query_sizes)."""
    return sum(cache_file_bytes(output, config, sizes, dtype) for output in TENSORS)


def cache_file_bytes(output, config, sizes, dtype):
    """The mean bytes of a query's cache file (files.write_cache) over `sizes` (query_sizes): its teacher tensor, states
    [L, T_q, d] in the training dtype or LIVE's logits [answers, vocabulary] in float32, and CACHE_HEADER."""
    text = config.get_text_config()
    if output == "logits":
        elements, dtype = sum(answers for _, answers in sizes) * text.vocab_size, torch.float32
    else:
        elements = sum(tokens for tokens, _ in sizes) * text.num_hidden_layers * text.hidden_size
    return elements * dtype.itemsize / len(sizes) + CACHE_HEADER


def check_cache_room(backbone, kind, queries, icds, cache, epochs):
    """Stop before the first step if the teacher tensors not yet cached do not fit the free space of --teacher-cache:
    a ValueError naming the size, the folder, --teacher-cache and --no-teacher-cache (and what that costs over
    --epochs)."""
    todo = [q for q in queries if not os.path.exists(teacher_file(cache, q, icds[q.id])[1])]
    if not todo:
        return 0
    sizes = query_tokens(backbone.processor, backbone.family, kind, todo)  # no image loaded
    per_query = cache_bytes(backbone.model.config, sizes,
                            backbones.autocast_dtype(next(backbone.model.parameters()).device))
    need, free = per_query * len(todo), shutil.disk_usage(cache["folder"]).free
    facts = cache["folder"], epochs, need, len(todo), len(queries)
    cache["room"] = no_room(*facts)  # what a full disk mid-run says (training_batches.stored)
    if need > free:
        raise ValueError(no_room(*facts, free))
    return need


def no_room(folder, epochs, need, todo, n_queries, free=None):
    """The sentence that names the cache's size, its folder (--teacher-cache; and its free space), --no-teacher-cache
    and what that costs over --epochs."""
    return (f"the teacher cache needs {files.size(need)} for {todo} queries ({files.size(need / todo)} each) in "
            f"{folder}" + ("" if free is None else f", which has {files.size(free)} free") + "; give "
            f"--teacher-cache DIR on a disk with room, or --no-teacher-cache to recompute the teacher at every step "
            f"({epochs * n_queries} teacher forwards instead of {todo})")
