"""The paged KV cache: fixed-size blocks, a block pool with a prefix cache, and per-sequence
block tables.

The cache is one preallocated tensor for K and one for V, shaped
(n_layer, num_blocks, block_size, n_kv_head, head_dim). A sequence never owns a contiguous
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
is aborted or is preempted; a block returns to the free queue when its reference count
reaches zero.

Automatic prefix caching: once a full block's K/V are computed, the block is registered
under its block hash, a hash of its tokens chained with the hash of the block before it,
so equal hashes mean equal whole prefixes. A new sequence starts from the longest run of
its prompt's blocks found in the cache, sharing them (reference count above 1) instead of
computing them again. A shared block is never written: only full blocks are shared, and a
sequence writes only past its computed tokens. A freed block keeps its hash and stays
findable in the free queue, which is also the eviction order: blocks without a hash at the
front, then cached blocks least recently used first; a cached block is evicted (its hash
forgotten) only when it is handed out again.

    prompt "abcd efgh ijkl mn", block_size 4   hashes  h1 = H(-, abcd)   h2 = H(h1, efgh)
    cached: h1 -> block 5, h2 -> block 3       h3 = H(h2, ijkl): not cached
    block table [5, 3, new, new]  (5 and 3 shared), num_computed_tokens 8

In this file, in order: cdiv and hash_block, BlockPool (reference counts, the free queue,
the prefix cache), BlockTable (one sequence's blocks), and allocate_kv_cache (the tensors).
The scheduler (scheduler.py) grows, shares and releases block tables; the engine's input
batch (input_batch.py) keeps them on the device as the block_tables that the attention
kernels (kernels.py) read, and works out the step's slot_mapping from them there.

Names as in vLLM v1: BlockPool, block hashes, the free queue; BlockTable ~ the request's
block ids; slot_mapping is the same. A "slot" is always a token's flat index in the cache.
Copy-on-write (beam search, beam_search.py): a forked table (BlockTable.fork) shares every
block of its parent, the last, partly filled one too. Before a step writes into a block with
another owner, ensure() gives the writer a block of its own and records the copy (old block,
new block) in `copies`; the engine makes all of a step's copies in one device op before its
forward (swap.copy_blocks). assert_owned checks the rule where a step's writes are laid out.

Elsewhere: swapping blocks to host memory (swap.py).
"""
import hashlib
from array import array
from collections import OrderedDict

import torch

NO_PARENT = b""  # the parent hash of a sequence's first block


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that a tokens take at b tokens a block."""
    return (a + b - 1) // b


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """A full block's identity: SHA-256 of its parent's hash and its tokens, so it names the
    whole prefix. Stable across processes, and no prompt can be crafted to collide with
    another's prefix and read its K/V, as one could with Python's hash()."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockPool:
    """The physical blocks 0..num_blocks-1: their reference counts, the free queue, and the
    prefix cache, block hash -> block id.

    It owns `block_size` (tokens per block): every other user reads it from here. The free
    queue holds every block nobody owns, in the order they are handed out again: blocks
    without a hash first, then cached blocks in the order they were freed, the earliest first.
    (vLLM calls this order LRU: a block in use is never evicted, so of the free ones the one
    freed first is the one least recently used.)
    With enable_caching False no block is ever cached or looked up."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # the prefix cache, both ways: a cached block's hash, and the block of a hash
        self.block_id_to_hash: list[bytes | None] = [None] * num_blocks  # None: not cached
        self.hash_to_block_id: dict[bytes, int] = {}
        # tables forked so far (beam search): until one is, no block a step writes is shared
        # (the prefix cache shares full blocks, which nobody writes again), and copy-on-write's
        # checks are skipped: they cost a decode step's host ~0.2 ms at batch 256
        self.num_forks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody owns, cached ones included: they are evicted when needed."""
        return len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """n blocks from the front of the free queue, each evicted from the cache if cached."""
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} KV blocks; {self.num_free_blocks} are free")
        block_ids = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for b in block_ids:
            if (block_hash := self.block_id_to_hash[b]) is not None:
                del self.hash_to_block_id[block_hash]
                self.block_id_to_hash[b] = None
            self.ref_counts[b] = 1
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """One more owner for each of these cached blocks; a free one leaves the free queue."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """One owner less each; a block nobody owns joins the free queue: at the back, the
        most recently used, if cached, else at the front, to be handed out before any cached
        one."""
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.block_id_to_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def count_free(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free queue: taking them would shrink it."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def find_cached_prefix(self, token_ids: list[int], cache_salt: bytes = NO_PARENT
                           ) -> tuple[list[bytes], list[int]]:
        """The block hashes and ids of the longest run of token_ids' first full blocks found in
        the cache; nothing is taken (BlockTable.take_cached_prefix takes them).

        The run covers at most len(token_ids) - 1 tokens: the last token is never served from
        the cache, because a step must compute it to get the logits the next token is sampled
        from. Example, block_size 4: a prompt of 8 tokens whose 2 blocks are both cached
        reuses only the first (4 tokens) and computes tokens 4..7 into a block of its own;
        it cannot compute token 7 alone into the cached second block, which others share and
        which must never be written. cache_salt: the parent hash of the first block (a LoRA
        adapter's: the same tokens under another adapter are other K/V)."""
        block_hashes = []
        block_ids = []
        if not self.enable_caching:
            return block_hashes, block_ids
        parent_hash = cache_salt
        for i in range((len(token_ids) - 1) // self.block_size):
            block_tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
            block_hash = hash_block(parent_hash, block_tokens)
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block_hashes.append(block_hash)
            block_ids.append(block_id)
            parent_hash = block_hash
        return block_hashes, block_ids

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash, unless another block with the
        same prefix is cached already (two sequences computed it at once): that one stays."""
        if block_hash not in self.hash_to_block_id:
            self.hash_to_block_id[block_hash] = block_id
            self.block_id_to_hash[block_id] = block_hash


class BlockTable:
    """One sequence's logical -> physical block map, its blocks taken from `block_pool`, and
    the hashes of its first blocks, full and computed (the chain goes on from the last)."""

    def __init__(self, block_pool: BlockPool):
        self.block_pool = block_pool
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # of block_ids[:len(block_hashes)]
        self.cache_salt = NO_PARENT  # its first block's parent hash (a LoRA adapter's)
        # copy-on-write: (shared block, its copy) pairs for the engine to copy before the
        # step that writes them; dropped if the table is released first
        self.copies: list[tuple[int, int]] = []

    def num_missing_blocks(self, num_tokens: int, first_written: int | None = None) -> int:
        """Blocks still to allocate before the table holds `num_tokens` tokens, and, if a step
        writes from token first_written on, a copy of each shared block it writes into."""
        block_size = self.block_pool.block_size
        capacity = len(self.block_ids) * block_size
        num_copies = 0
        if self.block_pool.num_forks:  # copy-on-write: no table shares a block before a fork
            num_copies = len(self.shared_blocks(first_written))
        if num_tokens <= capacity:  # most calls: a decode within its last block
            return num_copies
        return num_copies + cdiv(num_tokens - capacity, block_size)

    def shared_blocks(self, first_written: int | None) -> list[int]:
        """The indices of the blocks from the one holding token first_written to the table's
        end that another table also holds (None: the step writes nothing)."""
        if first_written is None or self.block_pool.num_forks == 0:
            return []
        ref_counts = self.block_pool.ref_counts
        first = first_written // self.block_pool.block_size
        return [i for i in range(first, len(self.block_ids)) if ref_counts[self.block_ids[i]] > 1]

    def ensure(self, num_tokens: int, first_written: int | None = None) -> bool:
        """Grow to hold `num_tokens` tokens and, if a step writes from token first_written on,
        make each block it writes into the table's own (copy-on-write: a shared one is swapped
        for a fresh block, the pair queued in `copies`); False (and nothing taken) if blocks
        ran out."""
        missing = self.num_missing_blocks(num_tokens, first_written)
        if missing == 0:
            return True
        if not self.block_pool.can_allocate(missing):
            return False
        for i in self.shared_blocks(first_written):
            shared = self.block_ids[i]
            self.block_ids[i] = self.block_pool.allocate(1)[0]
            self.copies.append((shared, self.block_ids[i]))
            self.block_pool.free([shared])  # one owner less; the other keeps it
        self.block_ids += self.block_pool.allocate(self.num_missing_blocks(num_tokens))
        return True

    def assert_owned(self, first_written: int) -> None:
        """The copy-on-write rule, where a step's writes are laid out (model_runner.py): no
        block from the one holding token first_written on has another owner (none can, before
        any table is forked)."""
        if self.block_pool.num_forks == 0:
            return
        ref_counts = self.block_pool.ref_counts
        for b in self.block_ids[first_written // self.block_pool.block_size:]:  # most steps: 1
            assert ref_counts[b] == 1, f"block {b} is written but shared"

    def fork(self) -> "BlockTable":
        """A table sharing every block of this one (beam search: a beam continued twice), the
        reference counts up; the first of the two to write into a shared block copies it."""
        child = BlockTable(self.block_pool)
        self.block_pool.num_forks += 1
        self.block_pool.touch(self.block_ids)
        child.block_ids = list(self.block_ids)
        child.block_hashes = list(self.block_hashes)
        child.cache_salt = self.cache_salt
        return child

    def truncate(self, num_tokens: int) -> None:
        """Free the blocks past those that hold num_tokens tokens (speculative decoding's
        rollback: blocks taken for drafts that were rejected), the last first."""
        num_kept = cdiv(num_tokens, self.block_pool.block_size)
        if num_kept >= len(self.block_ids):
            return
        self.block_pool.free(self.block_ids[num_kept:][::-1])
        del self.block_ids[num_kept:]

    def take_cached_prefix(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        """Start an empty table with a cached prefix that BlockPool.find_cached_prefix found,
        sharing its blocks with their other owners."""
        if self.block_ids:
            raise RuntimeError("a cached prefix can only start an empty block table")
        self.block_pool.touch(block_ids)
        self.block_hashes = list(block_hashes)
        self.block_ids = list(block_ids)

    def cache_full_blocks(self, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register in the prefix cache each block that the first num_computed_tokens of
        token_ids fill: full, with its K/V written (call it after the step that computed them).
        Each block's hash is chained to the one before it, so it names the whole prefix."""
        if not self.block_pool.enable_caching:
            return
        block_size = self.block_pool.block_size
        num_full_blocks = num_computed_tokens // block_size
        for i in range(len(self.block_hashes), num_full_blocks):
            parent_hash = self.block_hashes[-1] if self.block_hashes else self.cache_salt
            block_hash = hash_block(parent_hash, token_ids[i * block_size:(i + 1) * block_size])
            self.block_hashes.append(block_hash)
            self.block_pool.cache_block(self.block_ids[i], block_hash)

    def release(self) -> None:
        """Give the blocks back, the last first. The free queue evicts the blocks freed first
        first, and a sequence's last blocks are the least likely to be shared: released front
        to back, a prefix's first block would be evicted first, and with it every later block
        of the prefix, since a lookup stops at the first block it cannot find."""
        self.block_pool.free(self.block_ids[::-1])
        self.block_ids = []
        self.block_hashes = []
        self.copies = []  # its copies' new blocks were just freed: never copy into them


# kv_cache_dtype (vLLM's names) -> the cache's dtype; None: the model's
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: kv_cache_dtype's (fp8: float8_e4m3fn, a byte an element), or for
    auto the model's."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def kv_bytes_per_token(n_layer: int, n_kv_head: int, head_dim: int, dtype: torch.dtype) -> int:
    """The KV cache's memory for one token: a key and a value in every layer and K/V head
    (grouped-query attention's n_kv_head, fewer than the query heads)."""
    return 2 * n_layer * n_kv_head * head_dim * dtype.itemsize


def allocate_kv_cache(n_layer: int, n_kv_head: int, head_dim: int, num_tokens: int,
                      block_size: int, device: str, dtype: torch.dtype,
                      enable_prefix_caching: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, BlockPool]:
    """K and V, each (n_layer, num_blocks + 1, block_size, n_kv_head, head_dim), for num_tokens
    tokens, and the BlockPool of their first num_blocks blocks; a ValueError if that is not one
    block or does not fit in memory. The last block, which the pool never hands out, is the
    null block: a padded step's padding tokens write their K/V there (model_runner.py)."""
    num_blocks = num_tokens // block_size
    if num_blocks == 0:
        raise ValueError(f"block_size ({block_size} tokens) is larger than the KV cache "
                         f"({num_tokens} tokens)")
    shape = (n_layer, num_blocks + 1, block_size, n_kv_head, head_dim)
    try:  # zeros, not empty: padded reads past a sequence's end must be finite to be masked
        k_cache = torch.zeros(shape, device=device, dtype=dtype)
        v_cache = torch.zeros(shape, device=device, dtype=dtype)
    except RuntimeError as e:  # out of memory
        num_bytes = num_blocks * block_size * kv_bytes_per_token(n_layer, n_kv_head, head_dim,
                                                                 dtype)
        raise ValueError(f"cannot allocate a KV cache of {num_tokens} tokens "
                         f"({num_bytes / 2**30:.1f} GiB): {str(e).splitlines()[0]}") from None
    return k_cache, v_cache, BlockPool(num_blocks, block_size, enable_prefix_caching)
