"""Iteration-level scheduling: which tokens of which sequences go into the next forward pass.

There is no separate prefill phase and decode phase. Every sequence has token_ids (prompt
plus generated) and num_computed_tokens (how many of them have their K/V in the cache); a
step gives each scheduled sequence some of its uncomputed tokens. A decode is a sequence with
one uncomputed token (the one it just sampled); a prefill has many, and may be given them in
chunks over several steps. A preempted sequence gave its blocks back, so its next prefill
computes its prompt and the tokens it had generated again, less what the prefix cache still
holds: its full blocks were registered there, so unless evicted meanwhile it takes them back
on readmission and resumes from them. This is vLLM v1's rule, after Orca and Sarathi. Under
--preemption-mode swap or auto a preempted sequence may instead be swapped out: its blocks'
K/V copied to host memory (swap.py), its progress kept, and copied back into fresh blocks
when it is readmitted; SchedulerOutput lists the copies for the engine to make. With a KV
connector (kv_connector.py, disaggregated prefill), an admitted sequence starts past the
blocks the connector holds too, after its prefix-cache hit: a hit that came from outside. It
takes fresh blocks for them and waits out of both queues (WAITING_FOR_REMOTE_KVS, `loading`)
while they are read in the background; once they are, it runs from past them.

In this file, in order: Sequence (one sample of a request), BeamGroup (a beam-search request's
live beams, which are admitted and preempted together), SchedulerOutput (what a step runs
and what scheduling it changed) and scheduled_phase (what a sequence's new tokens are),
WaitingQueue (admission order: fcfs, sjf, priority), Scheduler, whose schedule() is the policy
and whose update() applies a step's results, and check_stop, the one place that says why a
sequence finishes. The engine (nanoserve.py) calls schedule(), runs the model on its output, calls
update(), then check_stop() on each new token. Blocks come from paged_cache.py.

Left out: lookahead slots.
"""
import enum
import heapq
import itertools
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from paged_cache import BlockPool, BlockTable, cdiv
from swap import SwapSpace

POLICIES = ("fcfs", "sjf", "priority", "static")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # vLLM V0's, auto ours (_swaps)
MAX_PRIORITY = 2**31 - 1  # a request's priority is an integer in [-MAX_PRIORITY, MAX_PRIORITY]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"       # end-of-text or a stop string
    FINISHED_LENGTH = "length"      # max_tokens reached
    FINISHED_ABORTED = "abort"      # cancelled by the caller (a client gone, Ctrl-C, shutdown)
    FINISHED_ERROR = "error"        # failed: an error while running it (Sequence.error says)
    # admitted with blocks for K/V that a KV connector loads in the background: it waits for
    # them out of both queues (vLLM's name; Scheduler.loading)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"


UNFINISHED = (SequenceStatus.WAITING, SequenceStatus.RUNNING,  # read once, not at every check
              SequenceStatus.WAITING_FOR_REMOTE_KVS)


# slots: the features' state took a sequence to 33 attributes, past the 30 for which CPython
# shares one key table among a class's instances: each had a dict of its own, 1.6 kB. Slots
# are fixed offsets, read about a fifth faster than a dict's attributes (issue 47)
@dataclass(eq=False, slots=True)
class Sequence:
    """One sample of a request as the engine sees it: its tokens, its progress and its cache
    blocks (a request of n samples is n sequences)."""
    seq_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: "SamplingParams"  # noqa: F821 (sampling.SamplingParams)
    block_table: BlockTable
    detokenizer: "Detokenizer" = None         # noqa: F821 (tokenizer.Detokenizer)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0              # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_step: int = 0                     # Scheduler.num_schedule_calls when it arrived
    stop_reason: str | int | None = None      # the stop string or stop token id that ended it
    error: str | None = None                  # why it failed (FINISHED_ERROR)
    num_sent_tokens: int = 0                  # output tokens already returned in outputs
    stream: bool = True                       # an output each step it makes a token; False:
                                              # one output, when it finishes (vLLM's
                                              # FINAL_ONLY; Engine.add_request)
    returned_prompt_token_ids: list[int] | None = None  # the copy its outputs carry
    logprobs: list = field(default_factory=list)         # per output token: {token id: logprob}
    prompt_logprobs: list = field(default_factory=list)  # per prompt token, the first's None
    queue_entry: int | None = None            # its live entry in the waiting queue
    num_cached_tokens: int | None = None      # prompt tokens the prefix cache supplied at its
                                              # first admission (None: not admitted yet)
    request_id: str | None = None             # its request's (one of params.n samples); None:
                                              # the same as seq_id (n = 1)
    index: int = 0                            # which of the request's samples it is
    num_preemptions: int = 0                  # times it was preempted (recompute or swap)
    recompute_until: int = 0                  # its first tokens that a preemption by recompute
                                              # forgot after computing them (scheduled_phase)
    # speculative decoding (spec_decode.py): the draft tokens proposed for its next step, and
    # the proposer's distribution of each, (k, vocab) on the device (None: one-hot, ngram's)
    spec_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    grammar: "Grammar | None" = None          # noqa: F821 its structured output's matcher
                                              # (structured_output.Grammar); None: unconstrained
    host_block_ids: list[int] = field(default_factory=list)  # swapped out: the host blocks of
                                              # its computed tokens' K/V (swap.py)
    priority: int = 0                         # lower first (vLLM's); --policy priority reads it
    lora_request: "LoRARequest | None" = None  # noqa: F821 (lora.LoRARequest) its adapter
    beams: "BeamGroup | None" = None          # beam search: its request's live beams
    cum_logprob: float = 0.0                  # beam search: its output's log-probability
    num_external_computed_tokens: int = 0     # prompt tokens the KV connector loaded at its
                                              # first admission (vLLM's name; kv_connector.py)
    # len(prompt_token_ids), kept beside the sequence's other numbers: every step reads it,
    # and a long prompt's list sits far from them in memory (BENCHMARKS.md, section 8)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.request_id is None:
            self.request_id = self.seq_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED

    @property
    def is_swapped_out(self) -> bool:
        """Waiting with its K/V in host blocks, its progress kept (swap.py)."""
        return bool(self.host_block_ids)

    def estimated_remaining(self) -> int:
        """SJF's job size: tokens still to prefill plus tokens still to generate."""
        return self.num_uncomputed_tokens + self.params.max_tokens - self.num_output_tokens


@dataclass(eq=False)
class BeamGroup:
    """The live beams of a beam-search request (beam_search.py), each a Sequence: they advance
    together (a step chooses among all their next tokens), so the scheduler admits a request
    only with room for beam_width sequences, and preempts and readmits its beams together:
    a beam waiting alone for its preempted siblings would hold its blocks and never run."""
    beam_width: int
    seqs: list[Sequence] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What schedule() decided for one step, so that nobody has to work it out afterwards by
    comparing states (vLLM v1's SchedulerOutput, in small)."""
    # each scheduled sequence -> its new tokens this step, in batch order: running decodes,
    # running prefills, then the sequences admitted this step
    num_scheduled_tokens: dict[Sequence, int] = field(default_factory=dict)
    # admitted for the first time this step -> prompt tokens the prefix cache supplied
    newly_admitted: dict[Sequence, int] = field(default_factory=dict)
    # sent back to the waiting queue this step, their blocks freed
    preempted: list[Sequence] = field(default_factory=list)
    # each scheduled sequence -> what its new tokens are (scheduled_phase): "decode",
    # "verify", "prefill" or "recompute"
    phases: dict[Sequence, str] = field(default_factory=dict)
    # decoding sequences that verify draft tokens this step -> the drafts (vLLM's name); they
    # are among num_scheduled_tokens' tokens: a decode with k drafts runs 1 + k tokens
    scheduled_spec_decode_tokens: dict[Sequence, list[int]] = field(default_factory=dict)
    # of the preempted, those swapped out -> (device block, host block) pairs to copy out;
    # readmitted from host memory -> (host block, device block) pairs to copy in. The engine
    # copies them before the step's forward, every copy out first (ModelRunner.swap).
    swapped_out: dict[Sequence, list[tuple[int, int]]] = field(default_factory=dict)
    swapped_in: dict[Sequence, list[tuple[int, int]]] = field(default_factory=dict)
    # copy-on-write (beam search): each sequence that writes into a block it shared this step
    # -> (shared block, its new block) pairs, copied after the swaps out, before the swaps in
    block_copies: dict[Sequence, list[tuple[int, int]]] = field(default_factory=dict)
    # whose K/V the KV connector finished loading (kv_connector.py) -> how many tokens; the
    # engine has them copied into their blocks first thing in the step
    num_external_tokens: dict[Sequence, int] = field(default_factory=dict)

    def schedule(self, seq: Sequence, num_new: int) -> None:
        """seq runs num_new of its uncomputed tokens this step."""
        self.phases[seq] = scheduled_phase(seq, num_new)
        self.num_scheduled_tokens[seq] = num_new

    def add_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        """seq, scheduled to decode, verifies drafts after its token: 1 + k tokens."""
        self.phases[seq] = "verify"
        self.scheduled_spec_decode_tokens[seq] = drafts
        self.num_scheduled_tokens[seq] += len(drafts)

    def unschedule(self, seq: Sequence) -> int:
        """seq, preempted, does not run after all: the tokens it had been given (0 if none)."""
        self.phases.pop(seq, None)
        self.scheduled_spec_decode_tokens.pop(seq, None)
        return self.num_scheduled_tokens.pop(seq, 0)


def scheduled_phase(seq: Sequence, num_new: int) -> str:
    """What seq computes when it is given num_new tokens: "decode", its one newest token,
    sampled at the step before; "recompute", a chunk starting in tokens it had computed
    before a preemption by recompute forgot them; else "prefill", a chunk of its prompt (or of
    output it never computed). Decided when the step is scheduled, where it is known, not
    worked out afterwards from how the sequence changed. A decode given drafts becomes
    "verify" (SchedulerOutput.add_drafts): "decode" means one token everywhere (is_decode,
    num_decodes, the decode kernels and graphs).

    Example: a sequence preempted with 40 of its 50 prompt tokens computed (recompute_until
    40) is readmitted with a budget of 32 tokens a step: 0-31 "recompute", 32-49 "recompute"
    (the chunk starts at 32 < 40, 8 of its tokens new), then its first decode "decode"."""
    start = seq.num_computed_tokens
    is_newest_token = start + 1 == len(seq.token_ids)
    if num_new == 1 and is_newest_token and start >= seq.num_prompt_tokens:
        return "decode"
    if start < seq.recompute_until:
        return "recompute"
    return "prefill"


class WaitingQueue:
    """Waiting sequences in admission order, in a heap: taking the next costs O(log n), not a
    sort of everything waiting. A preempted sequence goes back to the front under every
    policy (the most recently preempted first), since it was admitted before everything that
    waits. Then fcfs: arrival order. sjf: shortest estimated remaining job first, except that
    the oldest arrival goes first once it has waited `max_wait_steps` (a second heap, by
    arrival, finds it). priority: by priority (lower first), then as fcfs within a priority:
    the preempted first, then by arrival (vLLM's (priority, arrival) order). Removal is lazy:
    an entry is live only while it is its sequence's `queue_entry`."""

    def __init__(self, policy: str, max_wait_steps: int):
        self.policy = policy
        self.max_wait_steps = max_wait_steps
        self._heap: list = []        # (policy key, entry, seq)
        self._by_arrival: list = []  # sjf: (arrival_step, entry, seq)
        self._entries = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, seq: Sequence, front: bool = False) -> None:
        entry = next(self._entries)
        seq.queue_entry = entry
        if front:  # keys (0, ...) sort before every (1, ...); the newest entry first
            key = (0, -entry)
        elif self.policy == "sjf":
            key = (1, seq.estimated_remaining(), seq.arrival_step)
        else:
            key = (1, entry)
        if self.policy == "priority":
            key = (seq.priority, *key)
        heapq.heappush(self._heap, (key, entry, seq))
        if self.policy == "sjf":
            heapq.heappush(self._by_arrival, (seq.arrival_step, entry, seq))
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        seq.queue_entry = None
        self._len -= 1

    def peek(self, step: int, passed_over: set[str] = frozenset()) -> Sequence | None:
        """The sequence to admit next when the scheduler's clock reads `step`
        (num_schedule_calls), or None if none waits; the samples of the requests named in
        passed_over are passed over (they wait for a sibling or a LoRA slot) and keep their
        places."""
        if self.policy == "sjf":
            oldest = self._live_top(self._by_arrival, passed_over)
            if oldest is not None and self._waited_too_long(oldest, step):
                return oldest
        return self._live_top(self._heap, passed_over)

    def in_order(self, step: int) -> list[Sequence]:
        """Every waiting sequence, in the order peek(step) would give them if none were
        admitted meanwhile: under sjf those that have waited max_wait_steps first, oldest
        first, then the rest by the heap's key (the key each was pushed with). For showing the
        queue (watch.py); the heap is left as it is."""
        live = sorted(item for item in self._heap if is_live(item))
        waiting = [seq for _, _, seq in live]
        if self.policy != "sjf":
            return waiting
        overdue = []
        rest = []
        for seq in waiting:
            if self._waited_too_long(seq, step):
                overdue.append(seq)
            else:
                rest.append(seq)
        overdue.sort(key=arrival_order)
        return overdue + rest

    def _waited_too_long(self, seq: Sequence, step: int) -> bool:
        """sjf: whether seq has waited max_wait_steps by scheduler step `step`, and goes first."""
        return step - seq.arrival_step >= self.max_wait_steps

    @staticmethod
    def _live_top(heap: list, passed_over: set[str]) -> Sequence | None:
        """The heap's first live sequence not of a request in passed_over. Those passed over
        are popped to look beneath them, then pushed back as they were: same key, same entry,
        so they keep their places."""
        set_aside = []
        while heap:
            if not is_live(heap[0]):
                heapq.heappop(heap)  # stale: its sequence was admitted, aborted or re-queued
            elif heap[0][2].request_id in passed_over:
                set_aside.append(heapq.heappop(heap))
            else:
                break
        top = heap[0][2] if heap else None
        for item in set_aside:
            heapq.heappush(heap, item)
        return top


def is_live(item: tuple) -> bool:
    """Whether a heap item (key, entry, seq) is still its sequence's entry (removal is lazy)."""
    _, entry, seq = item
    return seq.queue_entry == entry


def arrival_order(seq: Sequence) -> tuple[int, int]:
    """The key of the sjf queue's second heap: arrival step, then entry."""
    return seq.arrival_step, seq.queue_entry


class Scheduler:
    """Picks each step's work under two limits: max_num_seqs and max_num_batched_tokens."""

    def __init__(self, block_pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 sjf_max_wait_steps: int = 256, preemption_mode: str = "recompute",
                 swap_space: SwapSpace | None = None, max_loras: int | None = None,
                 kv_connector=None, speculative: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {preemption_mode!r}; choose one of "
                             f"{PREEMPTION_MODES}")
        if preemption_mode != "recompute" and swap_space is None:
            raise ValueError(f"preemption_mode {preemption_mode} needs a swap space")
        self.block_pool = block_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting = WaitingQueue(policy, sjf_max_wait_steps)
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        self.max_loras = max_loras  # LoRA adapters the running sequences may hold; None: no LoRA
        self.kv_connector = kv_connector  # K/V from other instances (kv_connector.py), or None
        # speculative decoding is configured: running sequences may hold drafts (spec_token_ids)
        # to schedule; without it a step never looks for them
        self.speculative = speculative
        # admitted, their blocks taken, waiting for the connector to load their K/V (in
        # admission order); never preempted: their blocks are reserved like a running
        # sequence's, and they join running as soon as the load is read
        self.loading: list[Sequence] = []
        self.num_schedule_calls = 0  # the queue's clock: arrival_step and sjf's aging read it
        self.num_preemptions = 0   # by recompute and by swapping
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.num_schedule_calls
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running or self.loading)

    # The policy, in English:
    # 1) Running sequences first, decodes before unfinished prefills: a decode costs one
    #    token of the budget and keeps its request's inter-token latency low, where a prefill
    #    chunk can wait a step at little cost. Each takes the blocks its new tokens need;
    #    when none are free, the newest running sequence of the lowest priority is preempted
    #    (see _schedule_running and _victim).
    # 2) Then, unless this step preempted, admit waiting sequences in policy order while
    #    max_num_seqs and the token budget allow, each from the end of its longest cached
    #    prefix, with as much of the rest as the budget has left (a chunk), or none unless all
    #    of it fits when chunked prefill is off. Admission stops at the first that does not
    #    fit (see _schedule_waiting); a request whose sibling sample is still computing the
    #    shared prompt, or whose LoRA adapter has no slot (_has_lora_slot), is passed over,
    #    and those behind it are admitted. Under --policy
    #    priority a request that does not fit preempts running ones of a strictly lower
    #    priority if that makes room (_preempt_lower_priority), and is the step's last.
    # 3) Last, speculative decoding's drafts, for the running sequences that decode, from the
    #    budget and free blocks every real token of the step left (_schedule_drafts): a draft
    #    is a guess, so it never preempts anyone, nor keeps out a decode, a prefill chunk or
    #    an admission. (vLLM schedules a running request's drafts with its token, before
    #    admitting; here admissions rank before drafts too.)
    # static (request-level batching) admits only when nothing runs, a whole batch at once.
    def schedule(self) -> SchedulerOutput:
        """The next step's batch, and who was admitted, preempted and swapped to make it."""
        self.num_schedule_calls += 1
        output = SchedulerOutput()
        self._finish_loads(output)
        self._schedule(output)
        # The host blocks swapped in are free once the step is decided, not before: a swap-out
        # decided after a swap-in in the same step could otherwise take a host block that the
        # engine has yet to copy in from.
        for pairs in output.swapped_in.values():
            self.swap_space.free([host_block for host_block, _ in pairs])
        if self.block_pool.num_forks:  # copy-on-write: only a forked table copies blocks
            self._take_block_copies(output)
        return output

    @staticmethod
    def _take_block_copies(output: SchedulerOutput) -> None:
        """Each scheduled sequence's copy-on-write copies, which its tokens need made first."""
        for seq in output.num_scheduled_tokens:
            if seq.block_table.copies:
                output.block_copies[seq] = seq.block_table.copies
                seq.block_table.copies = []

    def _schedule(self, output: SchedulerOutput) -> None:
        """schedule()'s policy, into output."""
        if self.policy == "static" and not self.running:
            self._admit_static_batch(output)
        budget = self._schedule_running(output)
        # A step that preempted admits no one: memory ran out, and the running sequences need
        # the free blocks for their next tokens. Whoever was admitted now would be the next
        # victim, its work lost (thrashing); the preempted ones wait at the front instead.
        if self.policy != "static" and not output.preempted:
            budget = self._schedule_waiting(output, budget)
        if self.speculative:
            self._schedule_drafts(output, budget)

    def _schedule_running(self, output: SchedulerOutput) -> int:
        """Schedule the running sequences' own tokens (their drafts come last:
        _schedule_drafts), decodes first, preempting the newest running sequence (of the
        lowest priority: _victim) while blocks are short; return the token budget left.

        Worked example: four blocks of 4 tokens, all held. Running in admission order:
        A (8 tokens computed, 2 blocks), B (4 computed, 1 block), C (3 computed, 1 block),
        each decoding one token. A's 9th token needs a 3rd block: none is free, so C, the
        newest, is preempted and its block goes to A. B's 5th token needs a 2nd block: none
        is free, and the newest running sequence is now B itself, so B preempts itself.
        This step runs A alone; B and then C wait at the front of the queue. Had A drafts,
        they would change none of this: they get blocks only once B has its own."""
        budget = self.max_num_batched_tokens
        decodes_first = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
        for seq in decodes_first:  # a stable sort: admission order within each group
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older one
            num_new = self._num_new_tokens(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            while not seq.block_table.ensure(seq.num_computed_tokens + num_new,
                                             seq.num_computed_tokens):
                victim = self._victim()
                budget += self._preempt_in_step(victim, output)
                if seq.status != SequenceStatus.RUNNING:  # nothing newer or of lower
                    break                                  # priority was left to preempt
            if seq.status != SequenceStatus.RUNNING:
                continue
            output.schedule(seq, num_new)
            budget -= num_new
        return budget

    def _schedule_drafts(self, output: SchedulerOutput, budget: int) -> None:
        """Give each running sequence that decodes this step its drafts (spec_token_ids, taken
        from every running sequence), oldest first, from what the budget and the free blocks
        have left once every real token of the step is placed: as many as both have room for
        after its own token. A draft is a guess: it never preempts anyone nor takes a block
        or a token of the budget that a real token needs."""
        for seq in self.running:
            drafts = seq.spec_token_ids
            if not drafts:  # most sequences, and all without speculation: nothing to take
                continue
            seq.spec_token_ids = []
            if output.phases.get(seq) != "decode":
                continue
            num_tokens = seq.num_computed_tokens + 1  # its own token's slot is taken already
            room = self._draft_room(seq, num_tokens)
            drafts = drafts[:min(budget, room)]
            if not drafts:
                continue
            took_blocks = seq.block_table.ensure(num_tokens + len(drafts), num_tokens)
            assert took_blocks, "_draft_room counted these blocks as free"
            output.add_drafts(seq, drafts)
            budget -= len(drafts)

    def _draft_room(self, seq: Sequence, num_tokens: int) -> int:
        """How many tokens past its first num_tokens seq's blocks can hold, with all the free
        blocks added."""
        num_blocks = len(seq.block_table.block_ids) + self.block_pool.num_free_blocks
        return num_blocks * self.block_pool.block_size - num_tokens

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in policy order while max_num_seqs, the budget and the
        blocks allow; each looks up its cached prefix before it takes anything. Returns the
        token budget left."""
        passed_over = set()  # request ids whose samples wait: for a sibling, or a LoRA slot
        # a full batch admits no one, unless under priority a preemption makes room
        while len(self.running) < self.max_num_seqs or self.policy == "priority":
            seq = self.waiting.peek(self.num_schedule_calls, passed_over)
            if seq is None:
                return budget
            if self._waits_for_a_sibling(seq):  # only this request's samples wait
                passed_over.add(seq.request_id)
                continue
            cached_hashes, cached_block_ids = self._find_cached_prefix(seq)
            num_computed = len(cached_block_ids) * self.block_pool.block_size
            if seq.is_swapped_out:  # its blocks come back from host memory
                num_computed = seq.num_computed_tokens
            num_external = self._num_external_tokens(seq, num_computed)
            num_uncomputed = len(seq.token_ids) - num_computed - num_external
            num_new = self._num_new_tokens(num_uncomputed, budget)
            if num_new == 0:
                return budget
            if not self._has_lora_slot(seq):  # as vLLM: passed over, those behind it go on
                passed_over.add(seq.request_id)
                continue
            if seq.beams is not None:  # its beams come in together, or none of them
                budget_left = self._admit_beams(seq, output, budget)
                if budget_left is None:
                    return budget
                budget = budget_left
                continue
            victims = []
            if not self._has_room(seq, cached_block_ids):
                victims = self._lower_priority_victims(seq, cached_block_ids)
                if not victims:
                    return budget
            for victim in victims:
                budget += self._preempt_in_step(victim, output)
            self._admit(seq, output, cached_hashes, cached_block_ids)
            if num_external:  # it waits for them, its blocks taken: no tokens this step
                self._start_loading(seq, num_external)
            else:
                took_blocks = seq.block_table.ensure(num_computed + num_new, num_computed)
                assert took_blocks, "_has_room counted these blocks as free"
                output.schedule(seq, num_new)
                budget -= num_new
            if victims:  # the step's last admission: its victims are not readmitted in it
                return budget
        return budget

    def _admit_beams(self, seq: Sequence, output: SchedulerOutput, budget: int) -> int | None:
        """Admit seq's waiting beams together (BeamGroup), each from its cached prefix, with
        what the budget leaves it; the budget left, or None (none admitted) if they do not all
        fit: the sequence slots of beam_width beams, and the blocks they and every running
        sequence need. A request's first admission is its prompt alone, reserving the slots of
        the beams it forks into."""
        group = seq.beams
        beams = [beam for beam in group.seqs if beam.status == SequenceStatus.WAITING]
        cached = [self._find_cached_prefix(beam) for beam in beams]
        num_seqs = len(self.running) + self._num_reserved_seqs()
        if num_seqs + group.beam_width - len(group.seqs) + len(beams) > self.max_num_seqs:
            return None
        block_size = self.block_pool.block_size
        needed = sum(cdiv(len(beam.token_ids) + 1, block_size) - len(ids)
                     for beam, (_, ids) in zip(beams, cached))
        needed += sum(blocks_to_finish(running) for running in self.running)
        cached_ids = list({b for _, ids in cached for b in ids})
        if needed > self.block_pool.num_free_blocks - self.block_pool.count_free(cached_ids):
            return None
        for beam, (hashes, ids) in zip(beams, cached):
            self._admit(beam, output, hashes, ids)
            num_new = self._num_new_tokens(beam.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            took_blocks = beam.block_table.ensure(beam.num_computed_tokens + num_new,
                                                  beam.num_computed_tokens)
            assert took_blocks, "counted as free above"
            output.schedule(beam, num_new)
            budget -= num_new
        return budget

    def _num_reserved_seqs(self) -> int:
        """Sequence slots held for beams not forked yet: a beam-search request running only
        its prompt will fork into beam_width sequences."""
        groups = {id(seq.beams): seq.beams for seq in self.running if seq.beams is not None}
        num_forks = sum(group.beam_width - len(group.seqs) for group in groups.values())
        return num_forks + len(self.loading)  # and the loading sequences' slots

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Beam search: child, a copy of the running parent sharing its blocks, runs too."""
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def _num_external_tokens(self, seq: Sequence, num_computed: int) -> int:
        """The KV connector's hook (vLLM's get_num_new_matched_tokens): how many of seq's
        tokens past its first num_computed another instance computed and it can load, whole
        blocks, never its last token. None without a connector, when swapped out (its blocks
        come back from host memory) or for prompt log-probabilities (every prompt token
        computed). ExampleConnector always loads asynchronously; a synchronous load (vLLM's
        load_async False) is left out."""
        if self.kv_connector is None or seq.is_swapped_out:
            return 0
        if seq.params.prompt_logprobs is not None:
            return 0
        num_tokens, load_async = self.kv_connector.get_num_new_matched_tokens(seq, num_computed)
        assert load_async or num_tokens == 0, "only asynchronous loads are handled"
        return num_tokens

    def _start_loading(self, seq: Sequence, num_external: int) -> None:
        """seq, just admitted, takes blocks for num_external tokens past its cached prefix and
        hands them to the KV connector (vLLM's update_state_after_alloc), which reads their
        K/V in the background; it leaves running for `loading` until the load has been read
        (_finish_loads). Example, block_size 16, a 40-token prompt of which the folder holds
        blocks 0 and 1: it takes two blocks now and waits; once they are read it runs as a
        prefill of tokens 32-39 from the step their K/V are copied in."""
        num_computed = seq.num_computed_tokens
        took_blocks = seq.block_table.ensure(num_computed + num_external, num_computed)
        assert took_blocks, "_has_room counted these blocks as free"
        first = num_computed // self.block_pool.block_size
        self.kv_connector.update_state_after_alloc(seq, seq.block_table.block_ids[first:],
                                                   num_external)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.loading.append(seq)

    def _finish_loads(self, output: SchedulerOutput) -> None:
        """The loading sequences whose K/V the connector has read (its get_finished) run
        again, from past the tokens that arrived good (a failed entry's are computed); the
        engine copies those into their blocks before this step's forward. Nothing else to
        run or admit: wait for a load rather than step idle."""
        if not self.loading:
            return
        idle = not self.running and not len(self.waiting)
        finished = self.kv_connector.get_finished(wait=idle)
        for seq in list(self.loading):  # in admission order
            if seq not in finished:
                continue
            self.loading.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_loaded = finished[seq]
            if seq.num_preemptions == 0:  # its first admission
                seq.num_external_computed_tokens = num_loaded
            if num_loaded:
                seq.num_computed_tokens += num_loaded
                output.num_external_tokens[seq] = num_loaded
                # in the prefix cache now, not after the step: a sample of its request
                # admitted in this step takes them (their K/V are copied in before any read)
                seq.block_table.cache_full_blocks(seq.token_ids, seq.num_computed_tokens)

    def _num_new_tokens(self, num_uncomputed: int, budget: int) -> int:
        """How many of a sequence's uncomputed tokens this step can take: all that the budget
        has room for, or (chunked prefill off) all of them or none."""
        if num_uncomputed > budget and not self.enable_chunked_prefill:
            return 0
        return min(num_uncomputed, budget)

    def _waits_for_a_sibling(self, seq: Sequence) -> bool:
        """Whether another sample of seq's request is running and has not yet computed the
        prompt's full blocks: then seq waits, and takes them from the prefix cache once they
        are there, so the n samples of a request compute their prompt once. Example, n = 3,
        a 40-token prompt, blocks of 16: sample 0 computes 40 tokens; samples 1 and 2 then
        take its first two blocks and compute the last 8 each: 56 prompt tokens, not 120.
        Nothing waits without the prefix cache, or for prompt log-probabilities (which need
        every prompt token computed), or for a prompt shorter than a block and a token, or
        when swapped out (it brings its own blocks back)."""
        if not self.block_pool.enable_caching or seq.params.prompt_logprobs is not None:
            return False
        if seq.is_swapped_out:
            return False
        block_size = self.block_pool.block_size
        shareable = (seq.num_prompt_tokens - 1) // block_size * block_size  # not the last
        return any(other.request_id == seq.request_id and other.num_computed_tokens < shareable
                   for other in self.running + self.loading)

    def _find_cached_prefix(self, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """The block hashes and ids of seq's longest cached prefix; none for a request that
        asked for prompt log-probabilities, which needs every prompt token computed, or for a
        swapped-out sequence, whose blocks all come back from host memory."""
        if seq.params.prompt_logprobs is not None or seq.is_swapped_out:
            return [], []
        return self.block_pool.find_cached_prefix(seq.token_ids, seq.block_table.cache_salt)

    def _has_lora_slot(self, seq: Sequence) -> bool:
        """LoRA: whether seq's adapter has a device slot for it: the running sequences hold it
        already, or hold fewer than max_loras adapters (one can be freed for it). So a step
        never needs more adapters than there are slots (lora.py). One without is passed over,
        as vLLM does, and the requests of the adapters held are admitted behind it."""
        if seq.lora_request is None:
            return True
        held = {running.lora_request.lora_int_id for running in self.running + self.loading
                if running.lora_request is not None}
        return seq.lora_request.lora_int_id in held or len(held) < self.max_loras

    def _has_room(self, seq: Sequence, cached_block_ids: list[int]) -> bool:
        """Whether seq may be admitted now: a sequence slot is free (max_num_seqs) and the
        blocks are (_blocks_short)."""
        has_seq_slot = len(self.running) + self._num_reserved_seqs() < self.max_num_seqs
        return has_seq_slot and self._blocks_short(seq, cached_block_ids) <= 0

    def _blocks_short(self, seq: Sequence, cached_block_ids: list[int]) -> int:
        """How many blocks the free ones fall short of what seq (starting from its cached
        blocks) and every running sequence need to compute all their tokens and take one
        more; 0 or less: they are enough.

        This is our admission rule. vLLM's watermark holds a fixed share of the blocks free
        (1%); ours reserves exactly the blocks the running sequences will ask for, because a
        sequence admitted on a chunk's worth of blocks would be preempted as soon as the
        others grew, its work lost. Cached blocks that nobody holds count as free until seq
        takes them, so they are subtracted from what is free."""
        block_size = self.block_pool.block_size
        needed = cdiv(len(seq.token_ids) + 1, block_size) - len(cached_block_ids)
        for running in self.running + self.loading:
            needed += blocks_to_finish(running)
        free = self.block_pool.num_free_blocks - self.block_pool.count_free(cached_block_ids)
        return needed - free

    def _victim(self) -> Sequence:
        """The running sequence to preempt when blocks run out: under --policy priority the
        newest of the lowest priority (the largest number); under the others the newest,
        which is the same rule with every priority equal. The newest has the least work to
        redo, and under priority the least important goes first."""
        victim = self.running[-1]
        if self.policy != "priority":
            return victim
        for seq in reversed(self.running):  # newest first: a tie keeps the newer
            if seq.priority > victim.priority:
                victim = seq
        return victim

    # The rule that keeps two priorities from preempting each other every step: a waiting
    # sequence preempts only running ones of a strictly lower priority (a larger number), only
    # when preempting them makes room for it all (else nobody), and its admission is the
    # step's last. The victim waits at the front of its own priority, behind the one that
    # preempted it, which it cannot preempt back; and when blocks run short later, _victim
    # takes the lowest priority running, so it is never the higher one that gives way.
    # Equals never preempt each other: with "lower or equal", two requests of one priority
    # would take turns, each preempting the other and paying its prefill again every step.
    #
    # Worked example, --policy priority, room for two sequences: B1 then B2 (priority 1) run.
    # I1 (priority 0) arrives and does not fit: B2, the newest of the lowest priority, is
    # preempted and I1 admitted, in one step. I2 (priority 0) arrives: B1 goes for it. The
    # queue is now B1, B2 (priority 1, the newest preempted first): neither can preempt I1 or
    # I2, and an I3 (priority 0) arriving waits for I1 or I2 to finish, since it does not
    # outrank them. When I1 finishes, I3 goes first, then B1.
    def _lower_priority_victims(self, seq: Sequence, cached_block_ids: list[int]
                                ) -> list[Sequence]:
        """--policy priority: the running sequences of lower priority than seq whose
        preemption makes room for it, the lowest priority and the newest first (_victim's
        order); none if all of them together would not."""
        if self.policy != "priority":
            return []
        newest_first = self.running[::-1]
        lower = [running for running in newest_first if running.priority > seq.priority]
        lower.sort(key=attrgetter("priority"), reverse=True)  # stable: the newest first still
        num_seqs = len(self.running) + self._num_reserved_seqs()
        short = self._blocks_short(seq, cached_block_ids)
        victims = []
        for victim in lower:
            if num_seqs < self.max_num_seqs and short <= 0:
                break
            victims.append(victim)
            num_seqs -= 1
            short -= blocks_to_finish(victim) + self._blocks_freed(victim, cached_block_ids)
        if num_seqs < self.max_num_seqs and short <= 0:
            return victims
        return []

    def _blocks_freed(self, victim: Sequence, cached_block_ids: list[int]) -> int:
        """The blocks preempting victim would put in the free queue: those it alone holds,
        less any of seq's cached prefix (free, they are still taken by seq)."""
        ref_counts = self.block_pool.ref_counts
        return sum(1 for b in victim.block_table.block_ids
                   if ref_counts[b] == 1 and b not in cached_block_ids)

    def _preempt_in_step(self, victim: Sequence, output: SchedulerOutput) -> int:
        """Preempt victim in this step, and with a beam its running siblings (BeamGroup): each
        leaves the step's output if it was in it; the tokens they had been given, back to the
        budget (0 if none)."""
        victims = [victim]
        if victim.beams is not None:
            victims += [beam for beam in victim.beams.seqs
                        if beam is not victim and beam.status == SequenceStatus.RUNNING]
        num_returned = 0
        for seq in victims:
            num_returned += output.unschedule(seq)
            if self._swaps(seq):
                self._swap_out(seq, output)
            self._preempt(seq)
            output.preempted.append(seq)
        return num_returned

    def _admit_static_batch(self, output: SchedulerOutput) -> None:
        """static: admit up to max_num_seqs at once; _schedule_running then gives them blocks."""
        while len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek(self.num_schedule_calls)
            if seq is None or not self._has_lora_slot(seq):
                return
            cached_hashes, cached_block_ids = self._find_cached_prefix(seq)
            self._admit(seq, output, cached_hashes, cached_block_ids)

    def _admit(self, seq: Sequence, output: SchedulerOutput, cached_hashes: list[bytes],
               cached_block_ids: list[int]) -> None:
        """Move seq from waiting to running, its table and progress starting from the cached
        prefix that _find_cached_prefix found, or, swapped out, from its swapped blocks."""
        if seq.is_swapped_out:
            self._swap_in(seq, output)
        else:
            seq.block_table.take_cached_prefix(cached_hashes, cached_block_ids)
            seq.num_computed_tokens = len(cached_block_ids) * self.block_pool.block_size
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.num_cached_tokens is None:  # its first admission, not a resumption
            seq.num_cached_tokens = seq.num_computed_tokens
            output.newly_admitted[seq] = seq.num_cached_tokens

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and send it to the front of the queue. Swapped out (_swap_out, just
        before), it keeps its progress; else it is preempted by recompute: its progress is
        forgotten, its tokens stay."""
        if not seq.is_swapped_out:
            seq.recompute_until = max(seq.recompute_until, seq.num_computed_tokens)
            seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.block_table.release()
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.push(seq, front=True)
        self.num_preemptions += 1

    def _swaps(self, seq: Sequence) -> bool:
        """Whether seq is preempted by swapping: never under recompute (the default) or static
        (whose admission takes no blocks, so could not take a swapped sequence's back); under
        swap whenever the swap space has room for its computed blocks (full, it falls back to
        recompute); under auto, when it has room and copying is cheaper (swap_is_cheaper)."""
        if self.preemption_mode == "recompute" or self.policy == "static":
            return False
        num_blocks = cdiv(seq.num_computed_tokens, self.block_pool.block_size)
        if num_blocks == 0 or not self.swap_space.can_allocate(num_blocks):
            return False
        if self.preemption_mode == "swap":
            return True
        return self.swap_space.swap_is_cheaper(seq.num_computed_tokens)

    def _swap_out(self, seq: Sequence, output: SchedulerOutput) -> None:
        """Host blocks for seq's computed tokens; output lists the copies (device -> host) for
        the engine to make before the step's forward, which may write the freed blocks."""
        num_blocks = cdiv(seq.num_computed_tokens, self.block_pool.block_size)
        seq.host_block_ids = self.swap_space.allocate(num_blocks)
        # a block it took this step to copy a shared one into is not copied yet (nor will
        # be, now): its K/V are the shared block's, which the copies out read before anything
        # is written
        copied_from = {new: shared for shared, new in seq.block_table.copies}
        device_block_ids = [copied_from.get(b, b) for b in seq.block_table.block_ids[:num_blocks]]
        output.swapped_out[seq] = list(zip(device_block_ids, seq.host_block_ids))
        self.num_swapped_out += 1

    def _swap_in(self, seq: Sequence, output: SchedulerOutput) -> None:
        """Fresh device blocks for a swapped-out seq's computed tokens; output lists the copies
        (host -> device) for the engine to make before the step's forward. Its block table is
        new and holds no hashes yet: update() registers its full blocks in the prefix cache,
        as it does any sequence's blocks once computed."""
        took_blocks = seq.block_table.ensure(seq.num_computed_tokens)
        assert took_blocks, "_has_room counted these blocks as free"
        output.swapped_in[seq] = list(zip(seq.host_block_ids, seq.block_table.block_ids))
        seq.host_block_ids = []
        self.num_swapped_in += 1

    def update(self, num_scheduled_tokens: dict[Sequence, int],
               sampled: dict[Sequence, list[int]],
               spec_decode_tokens: dict[Sequence, list[int]] | None = None) -> None:
        """After the model ran: advance each scheduled sequence's num_computed_tokens past the
        tokens whose K/V are now good, and cache the blocks they fill. A sequence that verified
        drafts keeps the K/V of those accepted (all its emitted tokens but the last); the
        rejected ones' were written but are never read: its progress stops before them and
        its blocks past it are freed. The engine appends the sampled tokens (a run of them
        with drafts), checking each with check_stop.

        Example, block_size 4: 5 tokens computed and 1 new, drafts [a, b, c], emitted [a, x]
        (b rejected): 5 + 4 tokens were computed, 5 + 1 + 1 = 7 are good; the table keeps 2
        blocks of its 3, and blocks full of good tokens are cached."""
        for seq, num_new in num_scheduled_tokens.items():
            drafts = None  # the plain step (no drafts at all): no lookup a sequence
            if spec_decode_tokens:
                drafts = spec_decode_tokens.get(seq)
            if not drafts:
                seq.num_computed_tokens += num_new
                seq.block_table.cache_full_blocks(seq.token_ids, seq.num_computed_tokens)
                continue
            accepted = sampled[seq][:-1]
            num_rejected = len(drafts) - len(accepted)
            seq.num_computed_tokens += num_new - num_rejected
            seq.block_table.truncate(seq.num_computed_tokens)
            seq.block_table.cache_full_blocks(seq.token_ids + accepted, seq.num_computed_tokens)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (running or waiting) and free its blocks; an already finished one
        only takes the new status (a stop string found in the token that reached max_tokens)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
            self.loading.remove(seq)
        seq.block_table.release()
        if self.kv_connector is not None:
            self.kv_connector.request_finished(seq)
        if seq.is_swapped_out:  # aborted while swapped out
            self.swap_space.free(seq.host_block_ids)
            seq.host_block_ids = []
        seq.status = status


def blocks_to_finish(seq: Sequence) -> int:
    """The blocks a running sequence still needs to compute all its tokens and take one
    more (what admission keeps free for it)."""
    return seq.block_table.num_missing_blocks(len(seq.token_ids) + 1, seq.num_computed_tokens)


def check_stop(seq: Sequence, token: int, stop_string: str | None, eos_token_ids: list[int]
               ) -> tuple[SequenceStatus, str | int | None] | None:
    """Why seq finishes with its new token, as (status, stop_reason), or None if it goes on:
    the one place that decides. In order: a stop string its text now holds (stop_string, which
    the Detokenizer found), end-of-text (unless ignore_eos), one of its stop_token_ids, its
    grammar accepting and allowing nothing more (structured output), then max_tokens. Before
    min_tokens nothing here can happen but max_tokens and the grammar's end: the sampler bans
    end-of-text and the stop ids, and the engine does not look for stop strings.

    Example: max_tokens 3 and stop ["!"]; the third token is "!": a stop string ends it
    (stop, "!"), not the length, as vLLM reports it."""
    params = seq.params
    if stop_string is not None:
        return SequenceStatus.FINISHED_STOPPED, stop_string
    if token in eos_token_ids and not params.ignore_eos:
        return SequenceStatus.FINISHED_STOPPED, None
    if token in params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED, token
    if seq.grammar is not None and seq.grammar.is_terminated():  # structured output, complete
        return SequenceStatus.FINISHED_STOPPED, None
    if seq.num_output_tokens == params.max_tokens:
        return SequenceStatus.FINISHED_LENGTH, None
    return None
