"""Helpers of the model / training tests: the demo data at small images, so CPU training steps take a second."""

from __future__ import annotations

from pathlib import Path

import yaml

#: 2K-token packs, 1K per sample, for the small-image demo groups below (every group fits; nothing is over-length)
SMALL_BUDGETS = ["data.packer.expected_num_tokens=1536", "data.packer.max_num_tokens=2048",
                 "data.packer.max_num_tokens_per_sample=1024", "data.packer.prefer_buffer_before=512"]


def small_image_groups(out: Path, dest: Path) -> Path:
    """The demo's groups YAML with images resized to at most 256 px (VAE) / 224 px (ViT): a few hundred tokens
    per image, so 2K-token packs hold several samples of every group and a CPU step of the tiny model is short."""
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    for name, group in groups.items():
        vae_or_vlm = 256 if name != "vlm_sft" else 224
        for key, size in (("image_transform_args", vae_or_vlm), ("vit_image_transform_args", 224)):
            if key in group:
                group[key].update(max_image_size=size, min_image_size=size // 2)
                group[key].pop("max_pixels", None)
    dest.write_text(yaml.safe_dump(groups))
    return dest


def valid_groups(out: Path, dest: Path) -> Path:
    """A validation split for ``data.valid.groups``: the demo's t2i group alone at small images (its own grouped
    YAML; the training registry names its dataset)."""
    groups = yaml.safe_load(small_image_groups(out, dest.with_name(dest.stem + "_all.yaml")).read_text())
    dest.write_text(yaml.safe_dump({"t2i_pretrain": groups["t2i_pretrain"]}))
    return dest
