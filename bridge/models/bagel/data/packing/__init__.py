"""Packing stage: the official BAGEL packer (bit-exact), the balanced packer (``packer.strategy: balanced``) and
their building blocks."""

from .balanced_packer import BalancedPacker
from .digest import batch_digest, first_difference
from .masks import dense_attention_mask
from .packer import SPECIAL_TOKEN_KEYS, BagelPacker, restore_key_of
from .sequence import PackLayout, SequenceBuilder
from .sources import ListGroupSource

__all__ = ["BagelPacker", "BalancedPacker", "ListGroupSource", "PackLayout", "SequenceBuilder", "SPECIAL_TOKEN_KEYS",
           "batch_digest", "dense_attention_mask", "first_difference", "restore_key_of"]
