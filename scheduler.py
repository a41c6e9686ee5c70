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
from collections import deque
from dataclasses import dataclass, field

import torch

from paged_cache import BlockAllocator, BlockTable

POLICIES = ("fcfs", "sjf", "static")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"       # end-of-text or a stop string
    FINISHED_LENGTH = "length"      # max_tokens reached
    FINISHED_ABORTED = "abort"


@dataclass(eq=False)
class Sequence:
    """One request as the engine sees it: its tokens, its progress and its cache blocks."""
    seq_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: "SamplingParams"  # noqa: F821 (nanoserve.SamplingParams)
    block_table: BlockTable
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_step: int = 0
    text: str = ""                            # detokenized output, stop strings cut off

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    def estimated_remaining(self) -> int:
        """SJF's job size: tokens still to prefill plus tokens still to generate."""
        num_generated = len(self.token_ids) - len(self.prompt_token_ids)
        return self.num_uncomputed_tokens + self.params.max_tokens - num_generated


class Scheduler:
    """Picks each step's work under two limits: max_num_seqs and token_budget (tokens/step)."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, token_budget: int,
                 chunked_prefill: bool = True, policy: str = "fcfs", sjf_max_wait_steps: int = 256):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.chunked_prefill = chunked_prefill
        self.policy = policy
        self.sjf_max_wait_steps = sjf_max_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_steps = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.num_steps
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # The policy, in English:
    # 1) Running sequences first, decodes before unfinished prefills: a decode costs one
    #    token of the budget and keeps its request's inter-token latency low. Each takes the
    #    blocks its new tokens need; when none are free, the newest running sequence is
    #    preempted by recompute (blocks freed, back to the front of the waiting queue, its
    #    generated tokens kept) until the blocks are there or the sequence preempted itself.
    # 2) Then, unless this step preempted, admit waiting sequences in policy order (fcfs:
    #    arrival; sjf: shortest remaining job, except that one waiting sjf_max_wait_steps
    #    goes first) while max_num_seqs and the budget allow, giving each as much of its
    #    prompt as the budget has left (a chunk), or none unless all of it fits when
    #    chunked prefill is off. Admission stops at the first that does not fit.
    # static (request-level batching) admits only when nothing runs, a whole batch at once.
    def schedule(self) -> dict[Sequence, int]:
        """The next step's batch: each scheduled sequence -> its number of new tokens."""
        self.num_steps += 1
        if self.policy == "static" and not self.running:
            self._admit_static_batch()
        budget, scheduled = self.token_budget, {}
        num_preemptions = self.num_preemptions
        # 1) running: decodes first (a stable sort keeps admission order within each group)
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1):
            num_new = self._num_new_tokens(seq, budget)
            if seq.status != SequenceStatus.RUNNING or num_new == 0:
                continue
            while not seq.block_table.ensure(seq.num_computed_tokens + num_new, self.allocator):
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
        for seq in self._admission_order():
            num_new = self._num_new_tokens(seq, budget)
            if len(self.running) == self.max_num_seqs or num_new == 0:
                break
            if not seq.block_table.ensure(seq.num_computed_tokens + num_new, self.allocator):
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq] = num_new
            budget -= num_new
        return scheduled

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        if seq.num_uncomputed_tokens > budget and not self.chunked_prefill:
            return 0
        return min(seq.num_uncomputed_tokens, budget)

    def _admission_order(self) -> list[Sequence]:
        if self.policy == "fcfs":
            return list(self.waiting)

        def sjf_key(seq: Sequence):
            starving = self.num_steps - seq.arrival_step >= self.sjf_max_wait_steps
            return (not starving, 0 if starving else seq.estimated_remaining(), seq.arrival_step)
        return sorted(self.waiting, key=sjf_key)

    def _admit_static_batch(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.block_table.release(self.allocator)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (finished or aborted, running or waiting) and free its blocks."""
        seq.block_table.release(self.allocator)
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = status
