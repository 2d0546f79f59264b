from __future__ import annotations

from ddtree.engine.sequence import Sequence


class BlockManager:
    """Paged KV blocks shared by the target cache and the drafter's context cache (both index
    the same slots: slot = block * block_size + offset)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        want = -(-num_slots // self.block_size)
        return max(0, want - len(seq.block_table))

    def reserve(self, seq: Sequence, num_slots: int) -> None:
        """Make sure ``seq`` owns slots for positions 0..num_slots-1 (callers count free blocks first)."""
        if not self.try_reserve(seq, num_slots):
            raise RuntimeError("out of KV blocks")

    def try_reserve(self, seq: Sequence, num_slots: int) -> bool:
        """reserve() if the free blocks allow it; False (and nothing taken) if not."""
        # blocks_needed inlined: called per sequence per scheduled round (~25 % of schedule()).
        need = -(-num_slots // self.block_size) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self.free.pop())
        return True

    def release(self, seq: Sequence) -> None:
        self.free.extend(reversed(seq.block_table))
        seq.block_table = []
