"""A family's own vision tower as RICES's image encoder (lab/datasets/rices.py): where the tower sits in the model,
and how an image's features are pooled from it. A family's record names its Tower (families.Family.tower); one without
a Tower needs --rices-encoder (a CLIP checkpoint)."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tower:
    """The vision tower at model.model.<attribute>, its last hidden states averaged over an image's patches: [n, d]
    float32. first_view: the processor gives each image several views and the first is the whole image, resized
    (LLaVA-OneVision's base view)."""
    attribute: str = "vision_tower"
    first_view: bool = False

    def module(self, model):
        """The tower's module (whose weights RICES's cache id hashes)."""
        return getattr(model.model, self.attribute)

    @torch.no_grad()
    def features(self, backbone, images):
        """The pooled features of PIL images, [len(images), d] float32."""
        device, dtype = next(backbone.model.parameters()).device, next(backbone.model.parameters()).dtype
        out = backbone.processor.image_processor(images, return_tensors="pt")
        pixels = out if torch.is_tensor(out) else out["pixel_values"]  # Idefics' processor returns the tensor itself
        pixels = pixels[:, 0] if self.first_view else pixels
        return self.module(backbone.model)(pixel_values=pixels.to(device, dtype)).last_hidden_state.mean(1).float()


@dataclass(frozen=True)
class PaddedTower(Tower):
    """Idefics2's tower: each image encoded whole (no splitting), padded as its processor pads it, and only its real
    (unpadded) patches averaged."""
    attribute: str = "vision_model"

    @torch.no_grad()
    def features(self, backbone, images):
        model = backbone.model
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        out = backbone.processor.image_processor([[im] for im in images], do_image_splitting=False, return_tensors="pt")
        pixels, mask = out["pixel_values"][:, 0], out["pixel_attention_mask"][:, 0]
        p = model.config.vision_config.patch_size
        real = mask.unfold(1, p, p).unfold(2, p, p).flatten(-2).any(-1).to(device)  # [n, H/p, W/p]: any real pixel
        hidden = self.module(model)(pixel_values=pixels.to(device, dtype), patch_attention_mask=real).last_hidden_state
        keep = real.flatten(1)[..., None].to(hidden.dtype)
        return ((hidden * keep).sum(1) / keep.sum(1)).float()
