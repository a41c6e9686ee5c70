"""Iteration-level scheduling: which tokens of which sequences go into the next forward pass.

There is no separate prefill phase and decode phase. Every sequence has token_ids (prompt
plus generated) and num_computed_tokens (how many of them already have K/V in the cache);
a step gives each scheduled sequence some of its uncomputed tokens. A decode is a sequence
with one uncomputed token (the one it just sampled); a prefill has many, and may be given
them in chunks over several steps. A recomputed (preempted) sequence is just a prefill of
its prompt and the tokens it had generated. This is vLLM v1's rule, after Orca and Sarathi.

Left out: swapping to CPU, priorities set by the client, lookahead slots.
"""
import enum
import heapq
import itertools
from dataclasses import dataclass, field

import torch

from paged_cache import BlockPool, BlockTable

POLICIES = ("fcfs", "sjf", "static")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"       # end-of-text or a stop string
    FINISHED_LENGTH = "length"      # max_tokens reached
    FINISHED_ABORTED = "abort"      # aborted by the caller, or failed


@dataclass(eq=False)
class Sequence:
    """One request as the engine sees it: its tokens, its progress and its cache blocks."""
    seq_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: "SamplingParams"  # noqa: F821 (nanoserve.SamplingParams)
    block_table: BlockTable
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    detokenizer: "Detokenizer" = None         # noqa: F821 (model.Detokenizer)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_step: int = 0
    stop_reason: str | None = None            # the stop string that ended it, or why it aborted
    num_sent_tokens: int = 0                  # output tokens already returned in outputs
    logprobs: list = field(default_factory=list)         # per output token: {token id: logprob}
    prompt_logprobs: list = field(default_factory=list)  # per prompt token, the first's None
    queue_entry: int | None = None            # its live entry in the waiting queue
    num_cached_tokens: int | None = None      # prompt tokens found cached at first admission

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    def estimated_remaining(self) -> int:
        """SJF's job size: tokens still to prefill plus tokens still to generate."""
        return self.num_uncomputed_tokens + self.params.max_tokens - self.num_output_tokens


class WaitingQueue:
    """Waiting sequences in admission order, in a heap: taking the next costs O(log n), not a
    sort of everything waiting. fcfs: arrival order, but a preempted sequence goes back to
    the front. sjf: shortest estimated remaining job first, except that the oldest arrival
    goes first once it has waited `max_wait_steps` (a second heap, by arrival, finds it).
    Removal is lazy: an entry is live only while it is its sequence's `queue_entry`."""

    def __init__(self, policy: str, max_wait_steps: int):
        self.policy, self.max_wait_steps = policy, max_wait_steps
        self._heap: list = []        # (policy key, entry, seq)
        self._by_arrival: list = []  # sjf: (arrival_step, entry, seq)
        self._entries, self._len = itertools.count(), 0

    def __len__(self) -> int:
        return self._len

    def push(self, seq: Sequence, front: bool = False) -> None:
        entry = seq.queue_entry = next(self._entries)
        if self.policy == "sjf":
            key = (seq.estimated_remaining(), seq.arrival_step)
            heapq.heappush(self._by_arrival, (seq.arrival_step, entry, seq))
        else:  # the most recently preempted first, then arrivals in order
            key = (0, -entry) if front else (1, entry)
        heapq.heappush(self._heap, (key, entry, seq))
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        seq.queue_entry = None
        self._len -= 1

    def peek(self, step: int) -> Sequence | None:
        """The sequence to admit next at scheduler step `step`, or None if none waits."""
        if self.policy == "sjf":
            oldest = self._live_top(self._by_arrival)
            if oldest is not None and step - oldest.arrival_step >= self.max_wait_steps:
                return oldest
        return self._live_top(self._heap)

    @staticmethod
    def _live_top(heap: list) -> Sequence | None:
        while heap and heap[0][2].queue_entry != heap[0][1]:
            heapq.heappop(heap)  # a stale entry: its sequence was admitted, aborted or re-queued
        return heap[0][2] if heap else None


class Scheduler:
    """Picks each step's work under two limits: max_num_seqs and max_num_batched_tokens."""

    def __init__(self, block_pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 eos_token_id: int | None = None, sjf_max_wait_steps: int = 256):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        self.block_pool = block_pool
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enable_chunked_prefill, self.policy = enable_chunked_prefill, policy
        self.eos_token_id = eos_token_id
        self.waiting = WaitingQueue(policy, sjf_max_wait_steps)
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_steps = self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.num_steps
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running)

    # The policy, in English:
    # 1) Running sequences first, decodes before unfinished prefills: a decode costs one
    #    token of the budget and keeps its request's inter-token latency low. Each takes the
    #    blocks its new tokens need; when none are free, the newest running sequence is
    #    preempted by recompute (blocks freed, back to the front of the waiting queue, its
    #    generated tokens kept) until the blocks are there or the sequence preempted itself.
    # 2) Then, unless this step preempted, admit waiting sequences in policy order (fcfs:
    #    arrival; sjf: shortest remaining job, except that one waiting sjf_max_wait_steps
    #    goes first) while max_num_seqs and the budget allow, each from the end of its
    #    longest cached prefix, giving each as much of the rest as the budget has left (a
    #    chunk), or none unless all of it fits when chunked prefill is off. A sequence is
    #    admitted only if the blocks that it and the running sequences need to finish their
    #    prompts and take one more token are free (a watermark): otherwise admitting it would
    #    only get it preempted, its work lost. Admission stops at the first that does not fit.
    # static (request-level batching) admits only when nothing runs, a whole batch at once.
    def schedule(self) -> dict[Sequence, int]:
        """The next step's batch: each scheduled sequence -> its number of new tokens."""
        self.num_steps += 1
        if self.policy == "static" and not self.running:
            self._admit_static_batch()
        budget, scheduled = self.max_num_batched_tokens, {}
        num_preemptions = self.num_preemptions
        # 1) running: decodes first (a stable sort keeps admission order within each group)
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1):
            num_new = self._num_new_tokens(seq, budget)
            if seq.status != SequenceStatus.RUNNING or num_new == 0:
                continue
            while not seq.block_table.ensure(seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                scheduled[seq] = num_new
                budget -= num_new
        if self.policy == "static" or self.num_preemptions > num_preemptions:
            return scheduled
        # 2) waiting, in policy order
        while len(self.running) < self.max_num_seqs and (seq := self.waiting.peek(self.num_steps)):
            self._take_cached_prefix(seq)
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0 or not self._fits_above_watermark(seq):
                seq.block_table.release()
                seq.num_computed_tokens = 0
                break
            seq.block_table.ensure(seq.num_computed_tokens + num_new)
            self._admit(seq)
            scheduled[seq] = num_new
            budget -= num_new
        return scheduled

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        n = seq.num_uncomputed_tokens
        return 0 if n > budget and not self.enable_chunked_prefill else min(n, budget)

    def _fits_above_watermark(self, seq: Sequence) -> bool:
        """Whether the blocks that seq and every running sequence need to compute all their
        tokens and one more are free: one admitted on a chunk's blocks would be preempted."""
        return self.block_pool.can_allocate(sum(s.block_table.num_missing_blocks(
            len(s.token_ids) + 1) for s in (seq, *self.running)))

    def _admit_static_batch(self) -> None:
        while len(self.running) < self.max_num_seqs and (seq := self.waiting.peek(self.num_steps)):
            self._take_cached_prefix(seq)
            self._admit(seq)

    def _take_cached_prefix(self, seq: Sequence) -> None:
        if seq.params.prompt_logprobs is None:  # those need every prompt token computed
            seq.num_computed_tokens = seq.block_table.take_cached_prefix(seq.token_ids)

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.num_cached_tokens is None:  # first admission: what the prefix cache held
            seq.num_cached_tokens = seq.num_computed_tokens

    def _preempt(self, seq: Sequence) -> None:
        seq.block_table.release()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.push(seq, front=True)
        self.num_preemptions += 1

    def update(self, scheduled: dict[Sequence, int], sampled: dict[Sequence, int]) -> None:
        """After the model ran: advance each scheduled sequence's num_computed_tokens and cache
        the blocks it filled, append the sampled tokens, finish at end-of-text or max_tokens."""
        for seq, num_new in scheduled.items():
            seq.num_computed_tokens += num_new
            seq.block_table.cache_full_blocks(seq.token_ids, seq.num_computed_tokens)
        for seq, token in sampled.items():
            seq.token_ids.append(token)
            if token == self.eos_token_id and not seq.params.ignore_eos:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.num_output_tokens == seq.params.max_tokens:
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (running or waiting) and free its blocks; an already finished one
        only takes the new status (a stop string found in the token that reached max_tokens)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.block_table.release()
        seq.status = status
