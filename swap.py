"""Preemption by swapping: a preempted sequence's KV blocks copied to host memory, and copied
back into free device blocks when it resumes (vLLM V0's swap space, --swap-space GiB).

Preemption by recompute (the scheduler's default, and vLLM V1's only way) frees a sequence's
blocks and computes its tokens again when it is readmitted: a prefill of its whole context.
Swapping keeps the work: the blocks' K/V go to a pool of host blocks (pinned memory on CUDA,
so the copies run at the bus's speed and in stream order) and come back when it is readmitted,
into whatever device blocks are free then, its block table rewritten. What it costs is the
copy out and the copy in, and host memory while it waits; what it saves is the prefill.

    device blocks                host blocks (SwapSpace)
    seq A: [7, 2, 9]  --out-->   [0, 1, 2]        preempted: A's table emptied, 7, 2, 9 freed
    seq A: [4, 11, 5] <--in---   [0, 1, 2]        readmitted: fresh blocks, host blocks freed

The scheduler decides and keeps the accounting (which host blocks are free, which sequence
holds which); its SchedulerOutput lists each step's swaps as (from block, to block) pairs, and
the engine copies them before the step's forward (ModelRunner.swap): every copy out first,
then every copy in, so a device block freed by a swap-out and taken by a swap-in in the same
step is read before it is written.

`--preemption-mode auto` swaps when the copy costs less than the recompute (swap_is_cheaper),
from rates measured here: the copy's seconds a block, timed when the pool is made, and a
prefill's seconds a token, timed on the engine's large steps.

In this file: SwapSpace (the host tensors, their free blocks, the copies, the rates), and
copy_blocks, the device-to-device copy that copy-on-write uses (paged_cache.py, beam search).
Left out: swapping to disk, copying on a side stream while the model runs (the copies here
are on the step's stream: simple, and correct without events).
"""
import time

import torch

import cuda_runtime
from paged_cache import cdiv

MIN_TIMED_TOKENS = 64  # a step times the prefill rate only if this many of its tokens are
                       # prefill tokens: a decode step is slower a token (the weights read
                       # for each sequence's one token), and would make recomputing look
                       # dearer than a readmission's prefill is
RATE_WEIGHT = 0.2      # each timed step's share of the moving average of the prefill rate
NUM_TIMED_BLOCKS = 8   # blocks copied out and in to time the copy when the pool is made


class SwapSpace:
    """Host blocks for swapped-out K/V: k and v, each (num_blocks, n_layer, block_size,
    n_kv_head, head_dim), a host block contiguous (one copy a block each way), and their
    free list. A block is held by one swapped-out sequence (Sequence.host_block_ids) from its
    swap-out until its swap-in, or until it is aborted."""

    mirror = None  # tensor parallelism: told ("copy_out" or "copy_in", pairs) before each
                   # copy, so the workers copy their heads' blocks too (tensor_parallel.py)

    def __init__(self, num_blocks: int, k_caches: torch.Tensor, v_caches: torch.Tensor):
        n_layer, _, block_size, n_kv_head, head_dim = k_caches.shape
        shape = (num_blocks, n_layer, block_size, n_kv_head, head_dim)
        # empty, not zeros: a host block is always written (swapped out) before it is read,
        # and on a CPU the pages of an unused pool are never touched
        empty = torch.empty
        if cuda_runtime.is_cuda(k_caches.device):  # pinned: fast, asynchronous copies
            empty = cuda_runtime.pinned_empty
        self.k = empty(shape, dtype=k_caches.dtype)
        self.v = empty(shape, dtype=k_caches.dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids = list(range(num_blocks))[::-1]  # pop() hands out block 0 first
        self.copy_seconds_per_block = self._time_copies(k_caches, v_caches)  # out and in
        self.recompute_seconds_per_token: float | None = None  # None: no step timed yet

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_block_ids)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} host blocks; {self.num_free_blocks} are free")
        return [self.free_block_ids.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        assert len(self.free_block_ids) + len(block_ids) <= self.num_blocks, "freed twice"
        self.free_block_ids += block_ids[::-1]

    # --- the copies ----------------------------------------------------------------------

    def copy_out(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                 pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host blocks, for each (device block, host block) of pairs."""
        if self.mirror is not None:
            self.mirror("copy_out", pairs)
        for device_block, host_block in pairs:
            self.k[host_block].copy_(k_caches[:, device_block], non_blocking=True)
            self.v[host_block].copy_(v_caches[:, device_block], non_blocking=True)

    def copy_in(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                pairs: list[tuple[int, int]]) -> None:
        """Host blocks -> device blocks, for each (host block, device block) of pairs."""
        if self.mirror is not None:
            self.mirror("copy_in", pairs)
        for host_block, device_block in pairs:
            k_caches[:, device_block].copy_(self.k[host_block], non_blocking=True)
            v_caches[:, device_block].copy_(self.v[host_block], non_blocking=True)

    def _time_copies(self, k_caches: torch.Tensor, v_caches: torch.Tensor) -> float:
        """Seconds to copy a block out and back in, timed on the first few blocks of an
        empty cache (copied back where they were: nothing changes)."""
        num_timed = min(NUM_TIMED_BLOCKS, self.num_blocks, k_caches.shape[1])
        if num_timed == 0:
            return 0.0
        pairs = [(block, block) for block in range(num_timed)]
        self.copy_out(k_caches, v_caches, pairs)  # a first copy: warm-up
        synchronize(k_caches.device)
        start = time.perf_counter()
        self.copy_out(k_caches, v_caches, pairs)
        self.copy_in(k_caches, v_caches, pairs)
        synchronize(k_caches.device)
        return (time.perf_counter() - start) / num_timed

    # --- when swapping beats recomputing ---------------------------------------------------

    def time_step(self, num_prefill_tokens: int, num_tokens: int, seconds: float) -> None:
        """A step computed num_tokens tokens in `seconds`, num_prefill_tokens of them prefill
        tokens (prompt chunks, recomputes; not decodes nor their drafts): one of at least
        MIN_TIMED_TOKENS prefill tokens updates the prefill rate (a moving average, seconds a
        token); decode steps, however large, never do. A mixed step counts whole, its
        seconds over all its tokens: beside 64 or more prefill tokens the weights are read
        once for all, and a decode riding along costs about what a prompt token does."""
        if num_prefill_tokens < MIN_TIMED_TOKENS:
            return
        per_token = seconds / num_tokens
        if self.recompute_seconds_per_token is None:
            self.recompute_seconds_per_token = per_token
            return
        average = self.recompute_seconds_per_token
        self.recompute_seconds_per_token = average + RATE_WEIGHT * (per_token - average)

    def swap_is_cheaper(self, num_tokens: int) -> bool:
        """--preemption-mode auto: whether copying a sequence's num_tokens computed tokens out
        and back in costs less than computing them again. The copy is paid by the block, the
        recompute by the token, so a sequence's length enters both ways: its last, partial
        block is copied whole.

        Worked example, the tiny preset on this CPU (bench.py --swap): 1,000 tokens in blocks
        of 16 are 63 blocks; at 24 us a block out and in, 1.5 ms to swap; its prefill took
        223 ms, 0.22 ms a token: swap, by far. On a GPU both are faster (pinned copies at some
        25 GB/s; prefills of tens of thousands of tokens a second) and copying still wins
        there by about the same order (README: why vLLM V1 recomputes anyway). Before any
        large step is timed the prefill rate is unknown: swap, which computes nothing twice."""
        if self.recompute_seconds_per_token is None:
            return True
        copy_seconds = cdiv(num_tokens, self.block_size) * self.copy_seconds_per_block
        recompute_seconds = num_tokens * self.recompute_seconds_per_token
        return copy_seconds < recompute_seconds


def copy_blocks(k_caches: torch.Tensor, v_caches: torch.Tensor,
                pairs: list[tuple[int, int]]) -> None:
    """Device blocks -> device blocks, for each (from block, to block) of pairs, in every layer:
    one gather and one scatter for K and for V, all of a step's copies at once (copy-on-write:
    a beam's own copy of a block it shared). The sources are read whole before any is
    written."""
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.int64).T.to(k_caches.device)  # (2, n)
    k_caches[:, index[1]] = k_caches[:, index[0]]  # (n_layer, n, BS, Hkv, D)
    v_caches[:, index[1]] = v_caches[:, index[0]]


def swap_space_blocks(swap_space_gib: float, block_size: int, kv_bytes_per_token: int) -> int:
    """How many host blocks --swap-space GiB holds."""
    return int(swap_space_gib * 2**30) // (block_size * kv_bytes_per_token)


def synchronize(device: torch.device) -> None:
    """Wait for the device's copies (on a CPU they are done when they return)."""
    if cuda_runtime.is_cuda(device):
        cuda_runtime.synchronize(device)
