"""Vision-language prompts at training time: the processor's rows of token ids and image tensors, batched for a
forward."""

import re
from typing import Optional

import torch

from rloo_utils.data import row_images, with_image_placeholders
from rloo_utils.errors import RunError
from rloo_utils.lora import transformers_model


def image_token_ids(config) -> list[int]:
    """The ids that stand for an image in a VLM's input (LLaVA's <image>; Qwen2-VL's <|image_pad|>, its vision
    start/end and video tokens): a completion must never hold one, so generation never samples them."""
    names = re.compile(r"(image|video|vision|boi|eoi)\w*_token_(id|index)")
    text_config = getattr(config, "text_config", config)
    return sorted(
        {
            v
            for k, v in config.to_dict().items()
            if names.fullmatch(k) and isinstance(v, int) and 0 <= v < getattr(text_config, "vocab_size", 1 << 62)
        }
    )


def image_prompt_rows(
    processor, prompts: list, images: list, max_prompt_length: int, chat_template_kwargs: Optional[dict] = None
):
    """Per prompt: its token ids, each image placeholder expanded by the processor into that image's tokens, and its
    image tensors (pixel_values; image_grid_thw for Qwen2-VL; ...) on the CPU. Adjacent copies of one prompt (a
    group's G rows) are encoded once and share their tensors. A prompt is never truncated (cut image tokens would no
    longer match the pixels, as TRL warns): a longer one is refused."""
    rows, tensors = [], []
    for i, (prompt, value) in enumerate(zip(prompts, images)):
        if i and prompt is prompts[i - 1] and value is images[i - 1]:
            rows.append(rows[-1])
            tensors.append(tensors[-1])
            continue
        row_imgs = [image.convert("RGB") for image in row_images(value)]
        text = processor.apply_chat_template(
            with_image_placeholders(prompt, len(row_imgs)),
            tokenize=False,
            add_generation_prompt=True,
            **(chat_template_kwargs or {}),
        )
        encoded = processor(text=[text], images=row_imgs, return_tensors="pt")
        ids = encoded["input_ids"][0].tolist()
        if len(ids) > max_prompt_length:
            raise RunError(
                f"a prompt with its image tokens is {len(ids)} tokens, over --max_prompt_length "
                f"{max_prompt_length}, and cutting image tokens would break it: raise --max_prompt_length, "
                "or filter the dataset"
            )
        rows.append(ids)
        tensors.append(
            {
                k: v
                for k, v in encoded.items()
                if torch.is_tensor(v)
                and k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
            }
        )
    return rows, tensors


def images_batch(images: Optional[list[dict]], rows, device, dtype) -> dict:
    """The image tensors of some rows (a slice, or a tensor of indices) for one forward: each key's tensors of the
    rows concatenated (LLaVA's (images, 3, H, W) pixels, LLaVA-NeXT's (images, patches, 3, H, W) and sizes, Qwen2-VL's
    (patches, D) pixels and (images, 3) grid), floats in the model's dtype. {} for text prompts."""
    if images is None:
        return {}
    picked = images[rows] if isinstance(rows, slice) else [images[i] for i in rows.tolist()]
    return {
        k: padded_cat([r[k] for r in picked]).to(device, dtype if picked[0][k].is_floating_point() else None)
        for k in picked[0]
    }


def padded_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated along dim 0; rows that differ in a later dim (LLaVA-NeXT's patches per image, by its aspect ratio)
    zero-padded to the largest, as its processor pads a batch: the model reads each image's own patches only."""
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    return torch.cat(
        [
            torch.nn.functional.pad(t, [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])])
            for t in tensors
        ]
    )


def vision_inputs(model, input_ids: torch.Tensor, images: dict) -> dict:
    """The keyword arguments of a VLM's forward for `images` (images_batch): those tensors, and for a family whose
    rotary positions read each token's modality (Qwen2-VL's mrope: mm_token_type_ids, 1 at an image token) that mark
    for these ids."""
    if not images:
        return {}
    config = getattr(model, "config", None)
    if "image_grid_thw" in images and getattr(config, "image_token_id", None) is not None:
        images = {**images, "mm_token_type_ids": (input_ids == config.image_token_id).int()}
    return images


def builds_own_positions(model) -> bool:
    """A family whose rotary positions are its own (Qwen2-VL's 3-axis mrope, from the image grid and the attention
    mask): it must be given no position_ids."""
    return hasattr(getattr(transformers_model(model), "model", None), "get_rope_index")
