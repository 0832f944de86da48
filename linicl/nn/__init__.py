"""Flax Linen modules of the zoo."""

from linicl.nn.attention import Attention
from linicl.nn.block import MLP, Block
from linicl.nn.transformer import Transformer

__all__ = ["Attention", "Block", "MLP", "Transformer"]
