"""Paged KV cache bookkeeping: which cache blocks each sequence owns."""
from __future__ import annotations

from engine_templates.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the sequence's table to hold `num_tokens` positions."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        assert need <= len(self.free_blocks), "allocate without can_allocate"
        for _ in range(need):
            seq.block_table.append(self.free_blocks.pop())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)
