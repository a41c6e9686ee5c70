"""The paged KV cache: fixed-size blocks, a block allocator, and per-sequence block tables.

The cache is one preallocated tensor for K and one for V, shaped
(n_layer, num_blocks, block_size, n_head, head_dim). A sequence never owns a contiguous
region; it owns a list of physical blocks, its block table, grown one block at a time as
it gets longer, so memory is wasted only in each sequence's last, partly filled block.

    sequence A, 37 tokens, block_size 16          physical blocks in the cache
    block table [7, 2, 9]                          +---------+---------+-- ... --+
      logical 0 (tokens  0..15) -> block 7  --->   | block 2 | block 7 | block 9 |
      logical 1 (tokens 16..31) -> block 2         +---------+---------+-- ... --+
      logical 2 (tokens 32..36) -> block 9         (11 slots of block 9 still free)

    slot of token t = block_table[t // block_size] * block_size + t % block_size
    token 36 -> 9 * 16 + 4 = 148;  slot_mapping = the slots of this step's new tokens

Blocks are handed out on demand (`BlockTable.ensure`), freed when a sequence finishes,
is aborted or is preempted. Reference counts let later features (prefix caching) share a
block between sequences; a block returns to the free list when its count reaches zero.

Names as in vLLM v1: BlockAllocator ~ BlockPool, BlockTable ~ the request's block ids,
slot_mapping is the same. Left out: swapping to CPU, prefix hashing, eviction policy.
"""
from collections import deque

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Free list and reference counts of the physical block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_block_ids = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_block_ids)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} KV blocks; {self.num_free_blocks} are free")
        block_ids = [self.free_block_ids.popleft() for _ in range(n)]
        for b in block_ids:
            self.ref_counts[b] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids.append(b)


class BlockTable:
    """One sequence's logical -> physical block map."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_ids: list[int] = []

    def ensure(self, num_tokens: int, allocator: BlockAllocator) -> bool:
        """Grow to hold `num_tokens` tokens; False (and nothing taken) if blocks ran out."""
        missing = cdiv(num_tokens, self.block_size) - len(self.block_ids)
        if missing <= 0:
            return True
        if not allocator.can_allocate(missing):
            return False
        self.block_ids += allocator.allocate(missing)
        return True

    def release(self, allocator: BlockAllocator) -> None:
        allocator.free(self.block_ids)
        self.block_ids = []

    def slots(self, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions start..end-1."""
        bs = self.block_size
        return [self.block_ids[t // bs] * bs + t % bs for t in range(start, end)]


class KVCache:
    """The cache tensors, (n_layer, num_blocks, block_size, n_head, head_dim) for K and for V."""

    def __init__(self, n_layer: int, num_blocks: int, block_size: int, n_head: int,
                 head_dim: int, device: str, dtype: torch.dtype):
        shape = (n_layer, num_blocks, block_size, n_head, head_dim)
        # zeros, not empty: padded reads past a sequence's end must be finite to be masked away
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
