"""Packing stage: the official BAGEL packer (bit-exact) and its building blocks."""

from .masks import dense_attention_mask
from .packer import SPECIAL_TOKEN_KEYS, BagelPacker, restore_key_of
from .sequence import PackLayout, SequenceBuilder
from .sources import ListGroupSource

__all__ = [
    "BagelPacker",
    "ListGroupSource",
    "PackLayout",
    "SequenceBuilder",
    "SPECIAL_TOKEN_KEYS",
    "dense_attention_mask",
    "restore_key_of",
]
