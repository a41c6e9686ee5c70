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
    """Free list and reference counts of the physical block ids 0..num_blocks-1.

    It owns `block_size` (tokens per block): every other user reads it from here.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
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
    """One sequence's logical -> physical block map, its blocks taken from `allocator`."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_ids: list[int] = []

    def num_missing_blocks(self, num_tokens: int) -> int:
        """Blocks still to allocate before the table holds `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.allocator.block_size) - len(self.block_ids))

    def ensure(self, num_tokens: int) -> bool:
        """Grow to hold `num_tokens` tokens; False (and nothing taken) if blocks ran out."""
        missing = self.num_missing_blocks(num_tokens)
        if not self.allocator.can_allocate(missing):
            return False
        self.block_ids += self.allocator.allocate(missing)
        return True

    def release(self) -> None:
        self.allocator.free(self.block_ids)
        self.block_ids = []

    def slots(self, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions start..end-1."""
        bs = self.allocator.block_size
        return [self.block_ids[t // bs] * bs + t % bs for t in range(start, end)]


def allocate_kv_cache(n_layer: int, n_head: int, head_dim: int, num_tokens: int, block_size: int,
                      device: str, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, BlockAllocator]:
    """K and V, each (n_layer, num_blocks, block_size, n_head, head_dim), for num_tokens tokens,
    and the BlockAllocator of their blocks; a ValueError if that is not one block or does not
    fit in memory."""
    num_blocks = num_tokens // block_size
    if num_blocks == 0:
        raise ValueError(f"block_size ({block_size} tokens) is larger than the KV cache "
                         f"({num_tokens} tokens)")
    shape = (n_layer, num_blocks, block_size, n_head, head_dim)
    try:  # zeros, not empty: padded reads past a sequence's end must be finite to be masked
        k, v = (torch.zeros(shape, device=device, dtype=dtype) for _ in "kv")
    except RuntimeError as e:  # out of memory
        gib = 2 * num_blocks * block_size * n_layer * n_head * head_dim * dtype.itemsize / 2**30
        raise ValueError(f"cannot allocate a KV cache of {num_tokens} tokens ({gib:.1f} GiB): "
                         f"{str(e).splitlines()[0]}") from None
    return k, v, BlockAllocator(num_blocks, block_size)
