"""Table 6's synthetic prompts (python -m lab benchmark --random-weights: lab/studies/efficiency.py:synthetic_prompt)
need each family's images as its processor expands them, made from the model's config alone (no processor): the
image's tokens and random pixels of the shapes its forward takes. A family's record names its function here
(families.Family.synthetic); each takes (config, n images, text(k) -> k random ids, the image token's id) and returns
(image() -> one image's ids, the pixels, whether each token cross-attends to the latest image before it)."""
import torch


def idefics2(cfg, n, text, image_id):
    """<fake_token_around_image>, 64 <image> (the perceiver's latents), <fake_token_around_image>; pixels at COCO's
    typical 480 x 640, which its processor keeps as they are."""
    side = cfg.vision_config.image_size
    h, w = min(480, side), min(640, side)
    image = lambda: torch.cat([text(1), torch.full((cfg.perceiver_config.resampler_n_latents,), image_id), text(1)])
    return image, {"pixel_values": torch.randn(1, n, 3, h, w), "pixel_attention_mask": torch.ones(1, n, h, w).bool()}, \
        False


def idefics(cfg, n, text, image_id):
    """One <image> between two wrappers, each token cross-attending to the latest 224 x 224 image before it."""
    side = cfg.vision_config.image_size
    return lambda: text(3), {"pixel_values": torch.randn(1, n, 3, side, side)}, True


def llava_interleave(cfg, n, text, image_id):
    """One token per SigLIP patch (729 at 384 x 384)."""
    side = cfg.vision_config.image_size
    count = (side // cfg.vision_config.patch_size) ** 2
    return lambda: torch.full((count,), image_id), {"pixel_values": torch.randn(n, 3, side, side)}, False


def llava_onevision(cfg, n, text, image_id):
    """The base 384 x 384 view and a newline (730 tokens), in the multi-image mode of image_layouts.onevision_piece:
    one sample of several images, as MultiImage.batch lays them out."""
    side = cfg.vision_config.image_size
    count = (side // cfg.vision_config.patch_size) ** 2 + 1
    pixels = {"pixel_values": torch.randn(n, 1, 3, side, side), "image_sizes": torch.tensor([[side, side]] * n),
              "batch_num_images": torch.tensor([max(n, 2)])}
    return lambda: torch.full((count,), image_id), pixels, False
