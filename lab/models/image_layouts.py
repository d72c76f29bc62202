"""Image layouts: how a family's images become a piece's tokens and pixels, and how a batch's images are laid out for
its forward. A family names its layout in its record (lab/models/families.py:Family.layout); its processor carries
the layout as `processor.image_layout` (families.formatted), which data.py calls for every image:
- "concat": every image tensor along dim 0 (LLaVA-Interleave [images, 3, H, W]; Qwen's patches and grids);
- "canvas": a row's crops on one canvas [B, crops, 3, H, W] + pixel_attention_mask (Idefics2, Idefics3, SmolVLM);
- "multi-image": LLaVA-OneVision's multi-image mode for every image (onevision_piece);
- "cross-attention": Idefics' processor tensors, and which image each token cross-attends to.
A new layout is one class here and one entry in LAYOUTS."""
import numpy
import torch
from transformers.models.idefics.processing_idefics import (image_attention_mask_for_packed_input_ids,
                                                            incremental_to_binary_attention_mask)



class Concat:
    """Each image through the image processor alone; a batch's images concatenated along dim 0."""
    reuses_pixels = True  # the query's pixels serve its prompt + answer piece too (data.encode_query)
    canvas = False        # a row's crops go on one canvas (Canvas), so none is padded by the image processor

    def piece(self, processor, family, text, image, pixels=None):
        """Token ids and images of one piece (text starting with `<image>`): {"input_ids", "images"}; `pixels`
        (self.pixels) reused where the caller has them."""
        pixels = pixels or self.pixels(processor, image)
        return {"input_ids": piece_ids(processor, text, pixels), "images": pixels}

    def tokens(self, processor, pixels):
        """The text that one image's token expands into (replace_image_token of the processed image)."""
        return processor.replace_image_token(pixels, 0)

    def pixels(self, processor, image):
        """One image through the family's image processor with the processor's own settings (images_kwargs): a raw
        family's stopped before rescaling and normalisation (data.normalised does those on the device), uint8
        (LLaVA-Interleave [1, 3, 384, 384]; Idefics2: its crops [3, h, w], each its own size); another's whole
        output, float32 (Qwen: flattened patches and image_grid_thw; InternVL: tiles; Idefics3: crops, rows, cols)."""
        form, process, canvas = processor.row_format, processor.image_processor, self.canvas
        settings = {**getattr(processor, "images_kwargs", {}), **({"do_pad": False} if canvas else {})}
        if form.raw:
            out = process([[image]] if canvas else [image], do_rescale=False, do_normalize=False, **settings)
            crops = [chw(c) for c in (out["pixel_values"][0] if canvas else out["pixel_values"])]
            return {"pixel_values": crops if canvas else torch.stack(crops)}
        out = dict(process([[image]] if canvas else [image], return_tensors="pt", **settings))
        return {**out, "pixel_values": list(out["pixel_values"][0])} if canvas else out

    def batch(self, rows, processor, input_ids):
        """The image tensors of a batch as the family's forward takes them (images in row order): each of
        row_format.inputs concatenated; raw pixels stay uint8, with "pixel_norm" for data.normalised."""
        images = [p for r in rows for p in r["images"]]
        return {**{k: torch.cat([p[k] for p in images]) for k in processor.row_format.inputs}, **norm(processor)}

    def describe(self, processor):
        """What the image-setting line says of this layout ("" for nothing)."""
        return ""


class Canvas(Concat):
    """A row's crops, each its own size, laid top-left on one zero canvas (crop_canvas)."""
    canvas = True

    def batch(self, rows, processor, input_ids):
        return {**crop_canvas(crops_per_row(rows)), **norm(processor)}


class MultiImage(Concat):
    """LLaVA-OneVision's multi-image mode for every image, its base view and a newline (onevision_piece)."""

    def tokens(self, processor, pixels):
        return processor.image_token * onevision_tokens(processor)

    def pixels(self, processor, image):
        return onevision_piece(processor.image_processor, image)

    def batch(self, rows, processor, input_ids):
        images = [p for r in rows for p in r["images"]]
        out = {k: torch.cat([p[k] for p in images]) for k in processor.row_format.inputs}
        # it tiles exactly the images of one-image samples; none here (onevision_piece), so: one sample of several
        out["pixel_values"] = out["pixel_values"][:, None]  # [images, 1 view, 3, H, W]
        out["image_sizes"] = torch.cat([p["image_sizes"] for p in images])
        out["batch_num_images"] = torch.tensor([max(len(out["image_sizes"]), 2)])
        return {**out, **norm(processor)}

    def describe(self, processor):
        return f"images: multi-image mode, {onevision_tokens(processor)} tokens each (image_layouts.onevision_piece)"


class CrossAttention(Concat):
    """Idefics: its processor's own call on a piece (image and text) and its tensors; each token cross-attends to
    the latest image before it."""
    reuses_pixels = False  # its processor takes the image and the text together

    def piece(self, processor, family, text, image, pixels=None):
        """Its processor's pixel_values [1, 3, H, W] (float) and ids (the processor starts with BOS, the row's own)."""
        out = processor(text=[image, text.removeprefix("<image>")], return_tensors="pt")
        return {"input_ids": out["input_ids"][0, 1:].tolist(), "images": {"pixel_values": out["pixel_values"][0]}}

    def batch(self, rows, processor, input_ids):
        pixel_values = pad_stack([pad_stack(v) for v in crops_per_row(rows)])
        latest, _ = image_attention_mask_for_packed_input_ids(input_ids, processor.tokenizer, "pt")
        mask = incremental_to_binary_attention_mask(latest, "pt", num_classes=pixel_values.shape[1])
        return {"pixel_values": pixel_values, "image_attention_mask": mask}


LAYOUTS = {"concat": Concat(), "canvas": Canvas(), "multi-image": MultiImage(), "cross-attention": CrossAttention()}


def norm(processor):
    """{"pixel_norm": ...} for a raw family's uint8 pixels (pixel_norm), else {}."""
    return {"pixel_norm": pixel_norm(processor.image_processor)} if processor.row_format.raw else {}


def crops_per_row(rows):
    """Each row's crops (or images), in order."""
    return [[x for p in r["images"] for x in p["pixel_values"]] for r in rows]


def crop_canvas(per_row):
    """A canvas family's crops of each row, [3, h, w] of any size (uint8 raw, or float32), laid top-left on one zero
    canvas [B, crops, 3, H, W] (the batch's largest), with pixel_attention_mask bool [B, crops, H, W] on real pixels."""
    n, (h, w) = max(map(len, per_row)), (max(x.shape[k] for v in per_row for x in v) for k in (1, 2))
    pixels = torch.zeros(len(per_row), n, 3, h, w, dtype=per_row[0][0].dtype)
    mask = torch.zeros(len(per_row), n, h, w, dtype=torch.bool)
    for b, crops in enumerate(per_row):
        for k, x in enumerate(crops):
            pixels[b, k, :, :x.shape[1], :x.shape[2]] = x
            mask[b, k, :x.shape[1], :x.shape[2]] = True
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def onevision_tokens(processor):
    """The tokens of one LLaVA-OneVision image in multi-image mode: its base view and a newline (less CLS under the
    "default" feature strategy)."""
    return processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")


def onevision_piece(process, image):
    """A LLaVA-OneVision image as one of several, the model's multi-image mode: its base 384 x 384 view,
    num_image_tokens + 1 (newline) = 730 tokens (alone in a prompt, anyres tiles it: 2,929 tokens for 640 x 480). A
    teacher row holds several images, so the student's lone query image must be in that mode too, or the query's tokens
    would differ between the rows (Eq 16 compares them token by token): every image, in training and evaluation
    (MultiImage.batch tells the model), padded to a square of the mean colour and resized, as the image processor does
    for an image among several. Returns {"pixel_values": uint8 [1, 3, H, W], "image_sizes": [1, 2]}."""
    pixels = process.process_image(image, do_convert_rgb=True)
    square = process.pad_to_square(pixels, tuple(int(x * 255) for x in process.image_mean))
    view = process.resize(square, process.size, resample=process.resample)
    return {"pixel_values": chw(view)[None], "image_sizes": torch.tensor([pixels.shape[-2:]])}



def piece_ids(processor, text, pixels):
    """The ids of a piece's text, its `<image>` the family's placeholder, expanded into the tokens its processor gives
    the image: the processor's call on the text (expand "text": Idefics2), else the image layout's tokens for the
    processed image (replace_image_token: LLaVA-Interleave a token a patch, Qwen merged patches; LLaVA-OneVision's base
    view)."""
    form = processor.row_format
    text = text.replace("<image>", form.placeholder, 1)
    if form.expand == "text":
        return processor(text=text, add_special_tokens=False)["input_ids"][0]
    one = processor.image_layout.tokens(processor, pixels)
    return processor.tokenizer(text.replace(processor.image_token, one, 1), add_special_tokens=False)["input_ids"]

# ------------------------------------------------------------------------------ pixels: as the processors make them

def chw(array):
    """A processor's [3, h, w] uint8 array (a view of PIL's h x w x 3 pixels) as a contiguous tensor, transposed by
    numpy on one thread: torch splits such a copy over its threads, slower on a busy CPU (docs/efficiency.md)."""
    return torch.from_numpy(numpy.ascontiguousarray(array))


def pad_stack(tensors):
    """Stack tensors of equal rank, zero-padding every dimension at its end to the largest size."""
    shape = [max(sizes) for sizes in zip(*(t.shape for t in tensors))]
    out = tensors[0].new_zeros(len(tensors), *shape)
    for o, t in zip(out, tensors):
        o[tuple(slice(0, n) for n in t.shape)] = t
    return out


def pixel_norm(process):
    """[3, 3] float32, per channel (divisor, mean, std): an image processor's rescaling and normalisation, as
    (x / divisor - mean) / std in float32. With transformers' rescale by 1/255 (in float64, then rounded to float32),
    x / 255 in float32 is the same number for every uint8 x: the processor's pixels to the bit (tests/test_data.py)."""
    divisor = 1 / process.rescale_factor if process.do_rescale else 1.0
    mean, std = (process.image_mean, process.image_std) if process.do_normalize else (0.0, 1.0)
    return torch.stack([torch.tensor(v, dtype=torch.float32).expand(3) for v in (divisor, mean, std)], 1)
