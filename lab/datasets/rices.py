"""Demonstrations chosen at random or by RICES (the most similar images under a frozen image encoder), with the
encoders (the backbone's vision tower, as its family's record reads it, or CLIP) and their cached features."""
import hashlib
import json
import math
import os

import torch
import torch.nn.functional as F
from tqdm import tqdm

import data
from lab.disk import files


def choose_demonstrations(backbone, args, queries, support, shots):
    """The ICDs of each query: random (demonstrations) or RICES (rices_demonstrations on the features of
    image_encoder, cached by image_features)."""
    ids = [q.id for q in queries]
    if args.icds == "random":
        return data.demonstrations(ids, support, shots, args.seed)
    encode, encoder_id = image_encoder(backbone, args.rices_encoder)
    features = lambda items: image_features(encode, encoder_id, items, args.rices_cache)
    return rices_demonstrations(ids, features(queries), support, features(support), shots)


def rices_demonstrations(query_ids, query_features, support, support_features, m):
    """RICES (Yang et al. 2022): per query, the m support items whose image features are most cosine-similar, never
    the query itself (same id), as `demonstrations` returns them. Order: least to most similar, so the most similar
    ICD is the last one, right before the query; equal similarities rank in support order."""
    if len(support) <= m:
        raise ValueError(f"a support set of {len(support)} items is too small for {m} ICDs per query (need {m + 1}; "
                         "--shots sets the ICDs)")
    sim = F.normalize(query_features.double(), dim=-1) @ F.normalize(support_features.double(), dim=-1).T
    number = {i: k for k, i in enumerate(dict.fromkeys([it.id for it in support] + list(query_ids)))}  # text ids too
    ids = torch.tensor([number[it.id] for it in support])
    if sim.isnan().any():
        raise ValueError("RICES: the image features contain NaN")
    sim[ids[None, :] == torch.tensor([number[q] for q in query_ids])[:, None]] = -math.inf  # never its own ICD
    order = torch.argsort(-sim, dim=-1, stable=True)[:, :m]  # most similar first
    return [[support[j] for j in reversed(row.tolist())] for row in order]


def image_features(encode, encoder_id, items, cache_dir, batch_size=32):
    """Each item's image features under a frozen encoder (encode(PIL images) -> [n, d]), [len(items), d] float32, each
    distinct image encoded once. The cache file is named by a hash of encoder_id and of every item's id, image path,
    file size and modification time: a change of the encoder or of the data is another file (never a stale read)."""
    stat = lambda p: (os.stat(p).st_size, os.stat(p).st_mtime_ns) if os.path.exists(p) else None
    spec = {"encoder": encoder_id, "items": [[it.id, it.image_path, stat(it.image_path)] for it in items]}
    key = hashlib.sha256(json.dumps(spec).encode()).hexdigest()
    path = os.path.join(cache_dir, key[:32] + ".safetensors")
    files.remove_stale_tmp(cache_dir)
    cached = files.read_cache(path, key, {"features": ((len(items), None), torch.float32)})
    if cached is not None:
        return cached["features"]
    paths = list(dict.fromkeys(it.image_path for it in items))
    by_path = {it.image_path: it for it in items}  # an item that shows each image
    feats = []
    for i in tqdm(range(0, len(paths), batch_size), desc=f"image features ({encoder_id})", unit="batch"):
        feats.append(encode([data.load_image(by_path[p]) for p in paths[i:i + batch_size]]).float().cpu())
    row = {p: k for k, p in enumerate(paths)}
    features = torch.cat(feats)[[row[it.image_path] for it in items]].contiguous()
    files.write_cache(path, {"features": features}, key)
    return features


def encoder_missing(record, hub_id):
    """Why RICES has no image encoder for a family (None if it has one): no --rices-encoder, and a family whose record
    (lab/models/families.py:Family) names no vision tower to read. Checked with the flags, before anything loads."""
    if hub_id or record.tower is not None:
        return None
    return (f"--icds rices: the backbone's own vision tower is read where its family's record names one, not "
            f"{record.name}; give --rices-encoder, a CLIP checkpoint")


def image_encoder(backbone, hub_id=None):
    """RICES's frozen image encoder: (encode(images) -> [n, d] features, an id that changes with the encoder).
    Default: the backbone's own vision tower, pooled as its family's record says (lab/models/vision_towers.py; its id
    hashes the tower's weights); hub_id: a CLIP checkpoint (clip_encoder)."""
    if hub_id:
        return clip_encoder(hub_id, next(backbone.model.parameters()).device), f"clip:{hub_id}"
    if missing := encoder_missing(backbone.record, hub_id):
        raise ValueError(missing)
    tower, h = backbone.record.tower, hashlib.sha256(f"{backbone.name}:{backbone.family}".encode())
    for p in tower.module(backbone.model).parameters():
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    encoder_id = f"vision-tower:{backbone.name}:{h.hexdigest()[:16]}"
    return (lambda images: tower.features(backbone, images)), encoder_id


def clip_encoder(hub_id, device="cpu"):
    """A CLIP checkpoint's image encoder (hub id or local path), loaded with transformers: images -> its projected
    image embedding [n, d] float32. A checkpoint that cannot be loaded is a ValueError naming it."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModel
    instead = "leave out --rices-encoder to use the backbone's own vision tower, which works offline"
    try:  # the config first: a checkpoint of another kind is refused before its weights load
        kind = AutoConfig.from_pretrained(hub_id, trust_remote_code=False).model_type
        if kind != "clip":
            raise ValueError(f"its config's model_type is {kind!r}, not 'clip'")
        clip = AutoModel.from_pretrained(hub_id, trust_remote_code=False).to(device).eval()
        process = AutoImageProcessor.from_pretrained(hub_id, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as e:
        why = " ".join(str(e).split())[:200]  # one line: transformers' messages may hold several
        raise ValueError(f"cannot load the RICES image encoder {hub_id!r} as a CLIP checkpoint ({why}); {instead}") \
            from e

    @torch.no_grad()
    def encode(images):
        out = clip.get_image_features(pixel_values=process(images, return_tensors="pt")["pixel_values"].to(device))
        return (out if torch.is_tensor(out) else out.pooler_output).float()
    return encode
