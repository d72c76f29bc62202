"""Helpers shared by the model tests (test_model.py, test_baselines.py, paper/test_plug.py): prompts for the tiny
twins, randomised adapters and the cached-decoding check."""
import torch
from PIL import Image

import data
import model as M

PAPER = ("idefics2", "idefics", "llava-interleave", "llava-onevision")  # the paper's four: their processors' own calls


def images(texts):
    """One image per prompt, determined by the prompt (so a prompt alone and in a batch sees the same image)."""
    return [Image.new("RGB", (28, 28), (7 * len(t) % 255, 200, 90)) for t in texts]


def randomise(model, seed=0):
    """Every adapter parameter of `model` drawn from N(0, 0.3^2): an adapter far from its identity start."""
    torch.manual_seed(seed)
    for p in M.adapter_modules(model).parameters():
        torch.nn.init.normal_(p, std=0.3)


def prompts(backbone, texts, positions=True):
    """A left-padded batch, one image per prompt, through the family's own processor; positions skip padding."""
    p, imgs = backbone.processor, images(texts)
    if backbone.family not in PAPER:
        return rows_of(backbone, texts, imgs, positions)
    p.tokenizer.padding_side = "left"
    if backbone.family == "idefics":
        batch = p(text=[[im, t] for im, t in zip(imgs, texts)], return_tensors="pt", padding=True)
    else:
        imgs = [[im] for im in imgs] if backbone.family == "idefics2" else imgs
        batch = p(text=["<image>" + t for t in texts], images=imgs, return_tensors="pt", padding=True)
    if positions:
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


def rows_of(backbone, texts, imgs, positions=True):
    """prompts' batch for the families in use now, as data.py makes rows (BOS, then one piece an image and text, left
    padding; positions as the family takes them: 1-D, or none for M-RoPE, which the model makes itself)."""
    p, tok = backbone.processor, backbone.processor.tokenizer
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    pieces = [data.encode_piece(p, backbone.family, "<image>" + t, im) for t, im in zip(texts, imgs)]
    rows = [{"input_ids": bos + x["input_ids"], "labels": [-100] * (len(bos) + len(x["input_ids"])),
             "images": [x["images"]], "query_len": len(x["input_ids"]), "id": i} for i, x in enumerate(pieces)]
    batch = data.model_inputs(data.collate(rows, p, backbone.family))
    if not positions:
        batch.pop("position_ids", None)
    return batch


TEXTS = ["Question: What colour is the shape? Short answer:", "Question: How many? Short answer:"]


def assert_cached_decoding_equals_full_forward(backbone, new_tokens):
    """generate() runs the attached adapter on one new query token at a time against the KV cache; its logits must
    match one full forward over the prompts and the generated tokens."""
    batch = prompts(backbone, TEXTS, positions=False)
    with torch.no_grad():
        out = backbone.model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        steps = torch.stack(out.logits, 1)                                   # [B, new_tokens, V]
        full = dict(batch, input_ids=out.sequences, attention_mask=torch.cat(
            [batch["attention_mask"], torch.ones_like(out.sequences[:, -new_tokens:])], 1))
        if "image_attention_mask" in batch:                                  # Idefics: new tokens see the image
            last = batch["image_attention_mask"][:, -1:]
            full["image_attention_mask"] = torch.cat([batch["image_attention_mask"]] + [last] * new_tokens, 1)
        for types in ("mm_token_type_ids", "token_type_ids"):                # new tokens are text
            if types in batch:
                full[types] = torch.cat([batch[types], torch.zeros_like(out.sequences[:, -new_tokens:])], 1)
        if backbone.processor.row_format.positions == "1-d":                 # M-RoPE: the model's own
            full["position_ids"] = (full["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = backbone.model(**full).logits[:, -new_tokens - 1:-1]
    torch.testing.assert_close(steps, logits, rtol=1e-4, atol=1e-4)
