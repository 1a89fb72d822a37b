"""``PackerConfig``: every ``BagelPacker`` knob with the official defaults (the one place they live).

Part of the packing stage so the runtime packer needs no config-time module; ``config`` re-exports it, and
``BagelDataConfig.packer`` is one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from ..grouped_yaml import ConfigError, _is_int, _is_number

__all__ = ["PackerConfig"]

logger = logging.getLogger(__name__)


@dataclass
class PackerConfig:
    """Every BagelPacker knob with the official defaults (``DataConfig`` + ``PackedDataset``).

    The one place these knobs and their defaults live: ``BagelPacker`` and its ``PackLayout`` take this object.
    """

    expected_num_tokens: int = 32768
    max_num_tokens_per_sample: int = 16384
    max_num_tokens: int = 36864
    prefer_buffer_before: int = 16384
    max_buffer_size: int = 50
    interpolate_pos: bool = False
    use_flex: bool = False
    text_cond_dropout_prob: float = 0.1
    vit_cond_dropout_prob: float = 0.4
    vae_cond_dropout_prob: float = 0.1
    vae_image_downsample: int = 16
    max_latent_size: int = 32
    vit_patch_size: int = 14
    max_num_patch_per_side: int = 70
    #: Not an official knob: a group whose samples are dropped as over-length this many times in a row, with
    #: none packed, raises ``DataStallError`` (the official loop would spin forever).
    max_consecutive_drops: int = 100

    def validate(self, where: str = "packer") -> None:
        """Raise ConfigError for values the packer cannot work with (names the key)."""
        for name in ("expected_num_tokens", "max_num_tokens_per_sample", "max_num_tokens", "prefer_buffer_before",
                     "vae_image_downsample", "max_latent_size", "vit_patch_size", "max_num_patch_per_side",
                     "max_consecutive_drops"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{where}.{name}: must be a positive integer, got {v!r}")
        if not _is_int(self.max_buffer_size) or self.max_buffer_size < 0:
            raise ConfigError(f"{where}.max_buffer_size: must be a non-negative integer, got {self.max_buffer_size!r}")
        for name in ("interpolate_pos", "use_flex"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{where}.{name}: must be a bool, got {getattr(self, name)!r}")
        for name in ("text_cond_dropout_prob", "vit_cond_dropout_prob", "vae_cond_dropout_prob"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{where}.{name}: must be a probability in [0, 1], got {v!r}")
        if self.prefer_buffer_before >= self.max_num_tokens:
            raise ConfigError(f"{where}.prefer_buffer_before ({self.prefer_buffer_before}) must be smaller than "
                              f"max_num_tokens ({self.max_num_tokens})")
        if self.expected_num_tokens > self.max_num_tokens:
            raise ConfigError(f"{where}.expected_num_tokens ({self.expected_num_tokens}) exceeds max_num_tokens "
                              f"({self.max_num_tokens}): packs could never reach the target")
        if self.max_num_tokens_per_sample > self.max_num_tokens:
            raise ConfigError(f"{where}.max_num_tokens_per_sample ({self.max_num_tokens_per_sample}) exceeds "
                              f"max_num_tokens ({self.max_num_tokens}): such samples could never be packed")
        if self.prefer_buffer_before + self.max_num_tokens_per_sample > self.max_num_tokens:
            logger.warning("%s: prefer_buffer_before + max_num_tokens_per_sample > max_num_tokens: a buffered "
                           "sample can overflow a pack and is then discarded by the official flush", where)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "PackerConfig":
        """The knobs present in ``values`` (other keys ignored), defaults for the rest; validated."""
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in values.items() if k in names})
        cfg.validate()
        return cfg
