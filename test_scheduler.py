"""scheduler.py's guarantees: the token budget, admission, preemption and policies.
"""

import pytest

from conftest import GREEDY, PROMPTS, assert_no_leaks, running_seq, tiny
from paged_cache import BlockPool, BlockTable
from sampling import SamplingParams
from scheduler import Scheduler, Sequence, SequenceStatus, WaitingQueue


# ----------------------------------------------------------------------------- scheduler rules

def make_scheduler(num_blocks=64, budget=512, max_num_seqs=8, policy="fcfs", **kwargs):
    block_pool = BlockPool(num_blocks, block_size=4)
    kwargs.setdefault("speculative", True)  # its tests give sequences drafts by hand
    return Scheduler(block_pool, max_num_seqs, budget, True, policy, **kwargs), block_pool


def test_decodes_are_scheduled_before_prefills():
    scheduler, block_pool = make_scheduler(budget=8)
    prefill = running_seq(scheduler, block_pool, "p", 30, 8)  # admitted first
    decode = running_seq(scheduler, block_pool, "d", 5, 4)     # one uncomputed token
    assert list(scheduler.schedule().num_scheduled_tokens.items()) == [(decode, 1), (prefill, 7)]


def test_newest_running_sequence_is_preempted_first():
    scheduler, block_pool = make_scheduler(num_blocks=4)
    old, mid, new = (running_seq(scheduler, block_pool, s, 5, 4) for s in "omn")  # 1 block each
    output = scheduler.schedule()  # each needs a 2nd block for token 5; none is free
    assert new.status == SequenceStatus.WAITING and new.block_table.block_ids == []
    assert output.num_scheduled_tokens == {old: 1, mid: 1} and output.preempted == [new]
    assert scheduler.num_preemptions == 1


def test_scheduler_output_names_each_scheduled_sequences_phase():
    """decode: the newest token, sampled at the step before; verify: that token and drafts
    after it; prefill: prompt tokens (the last one too); recompute: tokens a preemption
    freed."""
    scheduler, block_pool = make_scheduler()
    decoding = running_seq(scheduler, block_pool, "d", 5, 5)
    decoding.token_ids.append(7)  # sampled at the step before
    verifying = running_seq(scheduler, block_pool, "v", 5, 5)
    verifying.token_ids.append(7)
    verifying.spec_token_ids = [8, 9]
    last_prompt_token = running_seq(scheduler, block_pool, "p", 5, 4)
    recomputed = running_seq(scheduler, block_pool, "r", 6, 0)
    recomputed.recompute_until = 4
    assert scheduler.schedule().phases == {decoding: "decode", verifying: "verify",
                                           last_prompt_token: "prefill",
                                           recomputed: "recompute"}


def test_only_tokens_computed_before_a_preemption_are_recomputed():
    """A sequence preempted by recompute halfway through its prompt computes its first half
    again ("recompute") and then the half it never computed ("prefill"); a sequence swapped
    out recomputes nothing."""
    scheduler, block_pool = make_scheduler(budget=8)
    seq = running_seq(scheduler, block_pool, "s", 16, 8)
    scheduler._preempt(seq)
    assert seq.recompute_until == 8 and seq.num_preemptions == 1
    phases = []
    for _ in range(2):
        output = scheduler.schedule()
        phases.append(output.phases[seq])
        scheduler.update(output.num_scheduled_tokens, {})
    assert phases == ["recompute", "prefill"]


def test_a_sequence_preempted_after_it_was_scheduled_leaves_the_step():
    """The newer sequence, a decode, is scheduled first; the older one's prompt chunk then
    needs its blocks: it is preempted, and leaves the step, its tokens and its phase both."""
    scheduler, block_pool = make_scheduler(num_blocks=3)
    older = running_seq(scheduler, block_pool, "o", 12, 4)  # 8 prompt tokens to go
    newer = running_seq(scheduler, block_pool, "n", 5, 4)   # its last prompt token
    output = scheduler.schedule()
    assert output.preempted == [newer]
    assert output.num_scheduled_tokens == {older: 8} and output.phases == {older: "prefill"}


def test_chunks_never_exceed_the_token_budget():
    llm = tiny(max_num_batched_tokens=24)
    sizes = []
    real_schedule = llm.engine.scheduler.schedule

    def schedule():
        output = real_schedule()
        sizes.append(sum(output.num_scheduled_tokens.values()))
        return output
    llm.engine.scheduler.schedule = schedule
    llm.generate(PROMPTS, GREEDY)
    assert max(sizes) == 24 and len(sizes) > 40


def test_drafts_count_against_the_token_budget():
    """With n-gram drafts at any batch size and a budget of 16, no step computes more than
    16 tokens, drafts included (6 decodes with 4 drafts each would be 30)."""
    llm = tiny(max_num_batched_tokens=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1024})
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_request(prompt * 2, GREEDY)  # each prompt repeats: the n-grams find drafts
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes.append(sum(engine.last_step.scheduled.values()))
    assert engine.stats.spec_decode_num_draft_tokens > 0
    assert max(sizes) == 16


def test_sjf_runs_the_shortest_job_first_and_bounds_starvation():
    scheduler, _ = make_scheduler(max_num_seqs=1, policy="sjf", sjf_max_wait_steps=2)
    jobs = {name: Sequence(name, "", [1, 2], SamplingParams(max_tokens=n), BlockTable(_))
            for name, n in [("long", 50), ("short", 5), ("medium", 10)]}
    for seq in jobs.values():
        scheduler.add(seq)
    order = []
    for _ in range(3):
        order += [seq.seq_id for seq in scheduler.schedule().num_scheduled_tokens]
        scheduler.finish(scheduler.running[0], SequenceStatus.FINISHED_LENGTH)
    assert order == ["short", "long", "medium"]  # at step 2 "long" has waited 2 steps


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_waiting_queue_in_order_is_the_order_peek_admits_them_in(policy):
    """in_order(step) lists the queue as peek(step) would give it, one admission after
    another: preempted first, then by policy; under sjf, the jobs that have waited
    max_wait_steps before all (here 0 and 1, at step 4). One removed (aborted) is not listed."""
    queue = WaitingQueue(policy, max_wait_steps=3)
    seqs = []
    for arrival, max_tokens in [(0, 30), (1, 5), (2, 20), (3, 1), (4, 9)]:
        seq = Sequence(str(arrival), "", [1, 2], SamplingParams(max_tokens=max_tokens),
                       BlockTable(None))
        seq.arrival_step = arrival
        queue.push(seq)
        seqs.append(seq)
    queue.remove(seqs[3])
    queue.push(seqs[4], front=True)  # re-queued: preempted
    listed = queue.in_order(step=4)
    peeked = []
    while (seq := queue.peek(step=4)) is not None:
        peeked.append(seq)
        queue.remove(seq)
    assert listed == peeked and seqs[3] not in listed and len(listed) == 4
    assert [seq.seq_id for seq in listed] == {"fcfs": ["4", "0", "1", "2"],
                                              "sjf": ["0", "1", "4", "2"]}[policy]


def decoding_seq(scheduler, block_pool, seq_id, prompt_len, drafts=()) -> Sequence:
    """A running sequence whose prompt is computed and whose first output token is not: it
    decodes at the next step, verifying `drafts`."""
    seq = running_seq(scheduler, block_pool, seq_id, prompt_len, prompt_len)
    seq.token_ids.append(0)
    seq.spec_token_ids = list(drafts)
    return seq


def test_a_draft_never_takes_the_block_of_another_sequences_token():
    """Four blocks of 4 tokens, one free. A (6 tokens computed, 2 blocks) decodes its 7th with
    2 drafts, which would need a 3rd block; B (4 computed, 1 block) decodes its 5th token,
    which needs a 2nd. B's real token takes the free block; A's drafts get what is left: room
    for one more token in its 2nd block. Nobody is preempted."""
    scheduler, block_pool = make_scheduler(num_blocks=4)
    a = decoding_seq(scheduler, block_pool, "a", 6, drafts=[5, 6])
    b = decoding_seq(scheduler, block_pool, "b", 4)
    output = scheduler.schedule()
    assert output.preempted == []
    assert output.num_scheduled_tokens == {a: 2, b: 1}
    assert output.scheduled_spec_decode_tokens == {a: [5]}


def test_drafts_come_after_every_real_token_and_admission_of_the_step():
    """A budget of 5 tokens: A decodes with 3 drafts, and a waiting prompt of 3 tokens is
    admitted first, whole; A's drafts get the one token left."""
    scheduler, block_pool = make_scheduler(budget=5)
    a = decoding_seq(scheduler, block_pool, "a", 4, drafts=[1, 2, 3])
    waiting = Sequence("w", "", [7, 8, 9], SamplingParams(), BlockTable(block_pool))
    scheduler.add(waiting)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {a: 2, waiting: 3}
    assert output.scheduled_spec_decode_tokens == {a: [1]}


def test_static_admits_only_when_nothing_runs():
    scheduler, block_pool = make_scheduler(policy="static", max_num_seqs=2)
    seqs = [Sequence(str(i), "", [1, 2, 3], SamplingParams(), BlockTable(block_pool))
            for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert list(scheduler.schedule().num_scheduled_tokens) == seqs[:2]
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [seqs[1]]  # seqs[2] waits
    scheduler.finish(seqs[1], SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [seqs[2]]


def test_tight_kv_cache_never_preempts_and_computes_each_token_once():
    """16 requests of 8 blocks each (64 + 64 tokens, blocks of 16) on a cache of 9, 16
    tokens a step. The first's prefill spends the budget; once it decodes it holds 5 blocks,
    and the second would need 5 for its prompt and one more token: 5 > 4 free. So each is
    admitted only when the one before has finished, nothing is preempted, and every token is
    computed exactly once. Admitting on a chunk's worth of blocks, or counting the prompt
    without its one more token (4 <= 4), lets the second in, and the two preempt each
    other."""
    prompts = [[i + 1] * 64 for i in range(16)]
    llm = tiny(kv_cache_tokens=144, block_size=16, max_num_batched_tokens=16)
    llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions == 0
    # every token but the last sampled one is computed, once
    assert llm.engine.stats.num_batched_tokens == 16 * (64 + 64 - 1)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("num_blocks, admitted", [(7, True), (6, False)])
def test_admission_needs_blocks_for_its_prompt_and_the_running_ones_next_token(
        num_blocks, admitted):
    """A waiting sequence is admitted only if the free blocks cover its prompt and one more
    token, and every running sequence's tokens and one more: exactly enough admits, one block
    fewer does not. Blocks of 4: the running prefill (12 tokens) takes its 3rd block this step
    and will need a 4th for token 13; the waiting 8-token prompt needs 3 for 9 tokens: 4 free
    blocks are needed, and 7 - 3 = 4 are free. (Both lengths are whole blocks, so that the
    one more token is what takes another block.)"""
    scheduler, block_pool = make_scheduler(num_blocks=num_blocks)
    prefill = running_seq(scheduler, block_pool, "p", 12, 8)
    waiting = Sequence("w", "", [100 + i for i in range(8)], SamplingParams(max_tokens=10),
                       BlockTable(block_pool))
    scheduler.add(waiting)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens[prefill] == 4 and len(prefill.block_table.block_ids) == 3
    assert (waiting in output.num_scheduled_tokens) == admitted


def test_worked_example_of_preemption_runs_the_oldest_and_requeues_the_others_in_order():
    """Scheduler._schedule_running's docstring: four blocks of 4, all held; A (8 computed),
    B (4) and C (3) each decode. C is preempted for A's 3rd block, then B preempts itself for
    its 2nd: A runs alone, and B, then C, are next at the front of the queue."""
    scheduler, block_pool = make_scheduler(num_blocks=4)
    a = running_seq(scheduler, block_pool, "A", 9, 8)
    b = running_seq(scheduler, block_pool, "B", 5, 4)
    c = running_seq(scheduler, block_pool, "C", 4, 3)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {a: 1} and output.preempted == [c, b]
    assert scheduler.running == [a] and block_pool.num_free_blocks == 1
    scheduler.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [b, c]


def test_sjf_puts_a_preempted_sequence_before_shorter_jobs():
    """Under sjf too, a preempted sequence goes back to the front of the waiting queue: it
    was admitted before any job waiting now, even a shorter one."""
    scheduler, block_pool = make_scheduler(num_blocks=4, policy="sjf")
    old, mid, new = (running_seq(scheduler, block_pool, s, 5, 4) for s in "omn")  # 1 block each
    short = Sequence("s", "", [100, 101], SamplingParams(max_tokens=1), BlockTable(block_pool))
    scheduler.add(short)
    assert scheduler.schedule().preempted == [new]
    assert new.estimated_remaining() > short.estimated_remaining()
    scheduler.finish(old, SequenceStatus.FINISHED_LENGTH)
    scheduler.finish(mid, SequenceStatus.FINISHED_LENGTH)
    assert list(scheduler.schedule().num_scheduled_tokens) == [new, short]


def test_failed_admission_leaves_the_lru_order_of_cached_blocks_unchanged():
    """The head of the queue has 3 cached blocks but too few free blocks for the rest: it
    looks up its prefix without taking it, so the free queue (the eviction order) is the
    same after the step. Taking the prefix and giving it back would have moved its blocks
    behind the more recently used one."""
    scheduler, block_pool = make_scheduler(num_blocks=8)
    decode = running_seq(scheduler, block_pool, "d", 14, 13)  # 4 blocks, none needed soon
    prefix = [100 + i for i in range(12)]
    for tokens in (prefix, [200, 201, 202, 203]):  # cache 3 blocks, then 1 used after them
        table = BlockTable(block_pool)
        assert table.ensure(len(tokens))
        table.cache_full_blocks(tokens, len(tokens))
        table.release()
    lru_order = list(block_pool.free_queue)
    waiting = Sequence("w", "", prefix + [7] * 9, SamplingParams(max_tokens=10),
                       BlockTable(block_pool))  # 21 tokens and 1 more: 6 blocks, 3 cached
    scheduler.add(waiting)
    assert scheduler.schedule().num_scheduled_tokens == {decode: 1}
    assert list(block_pool.free_queue) == lru_order and len(block_pool.hash_to_block_id) == 4
    assert waiting.status == SequenceStatus.WAITING and waiting.block_table.block_ids == []


def test_a_preempted_sequences_tokens_go_back_to_the_budget():
    """Six blocks of 4, a budget of 10. C (a decode, admitted last) is scheduled first, 1
    token; A's 9-token chunk needs 3 blocks, so C, the newest, is preempted and its token goes
    back to the budget: B gets the budget's last token."""
    scheduler, block_pool = make_scheduler(num_blocks=6, budget=10)
    a = running_seq(scheduler, block_pool, "a", 20, 4)   # 1 block
    b = running_seq(scheduler, block_pool, "b", 20, 4)   # 1 block
    c = running_seq(scheduler, block_pool, "c", 8, 7)    # 2 blocks, its last token to go
    output = scheduler.schedule()
    assert output.preempted == [c]
    assert output.num_scheduled_tokens == {a: 9, b: 1}


def test_a_sample_waiting_for_its_sibling_holds_back_only_its_own_request():
    """Request r (n = 2, a 3-block prompt): sample 0 computes the prompt in chunks while
    sample 1 waits to share its blocks; request "other", queued behind, is admitted at once."""
    scheduler, block_pool = make_scheduler(budget=9, max_num_seqs=8)
    params = SamplingParams(n=2, max_tokens=4)
    samples = [Sequence(f"{i}_r", "", list(range(13)), params, BlockTable(block_pool),
                        request_id="r", index=i) for i in range(2)]
    other = Sequence("other", "", [7, 8], SamplingParams(max_tokens=4), BlockTable(block_pool))
    for seq in [*samples, other]:
        scheduler.add(seq)
    first = scheduler.schedule()  # sample 0 takes the whole budget: 9 of its 13 prompt tokens
    scheduler.update(first.num_scheduled_tokens, {})
    output = scheduler.schedule()
    assert samples[1].status == SequenceStatus.WAITING
    assert output.num_scheduled_tokens == {samples[0]: 4, other: 2}


# ----------------------------------------------------------------------------- priorities

def queued(scheduler, block_pool, seq_id, prompt_len, priority=0, max_tokens=10) -> Sequence:
    prompt = list(range(100, 100 + prompt_len))  # shares no block with running_seq's prompts
    seq = Sequence(seq_id, "", prompt, SamplingParams(max_tokens=max_tokens),
                   BlockTable(block_pool), priority=priority)
    scheduler.add(seq)
    return seq


def test_priority_policy_admits_by_priority_then_arrival():
    queue = WaitingQueue("priority", max_wait_steps=3)
    seqs = [Sequence(name, "", [1], SamplingParams(), BlockTable(None), priority=priority)
            for name, priority in [("a", 1), ("b", 0), ("c", 1), ("d", -3), ("e", 0)]]
    for seq in seqs:
        queue.push(seq)
    queue.push(seqs[2], front=True)  # preempted: first among its priority, not before a 0
    assert [seq.seq_id for seq in queue.in_order(step=0)] == ["d", "b", "e", "c", "a"]


def test_the_victim_is_the_newest_running_sequence_of_the_lowest_priority():
    scheduler, block_pool = make_scheduler(num_blocks=4, policy="priority")
    old_low, high, new_low, new_high = (running_seq(scheduler, block_pool, s, 5, 4) for s in "abcd")
    old_low.priority, high.priority, new_low.priority, new_high.priority = 2, 0, 2, 0
    output = scheduler.schedule()  # each needs a 2nd block; none is free
    assert output.preempted == [new_low, old_low]
    assert output.num_scheduled_tokens == {high: 1, new_high: 1}


def test_a_waiting_request_of_higher_priority_preempts_a_lower_running_one():
    scheduler, block_pool = make_scheduler(num_blocks=4, policy="priority")
    low = running_seq(scheduler, block_pool, "low", 12, 12)  # 3 blocks; needs a 4th
    low.priority = 1
    high = queued(scheduler, block_pool, "high", 6)          # needs 2 blocks
    output = scheduler.schedule()
    assert output.preempted == [low] and output.num_scheduled_tokens == {high: 6}
    assert low.status == SequenceStatus.WAITING and high.status == SequenceStatus.RUNNING


def test_a_waiting_request_preempts_the_lowest_priority_running_one_first():
    """Running priorities 2 (older) and 1, a priority-0 request waiting that one preemption
    makes room for: the priority-2 sequence gives way, though the other is newer."""
    scheduler, block_pool = make_scheduler(num_blocks=6, policy="priority")
    lowest = running_seq(scheduler, block_pool, "lowest", 8, 7)  # 2 blocks, room for token 8
    lower = running_seq(scheduler, block_pool, "lower", 8, 7)
    lowest.priority, lower.priority = 2, 1
    high = queued(scheduler, block_pool, "high", 9)              # needs 3 blocks; 2 are free
    output = scheduler.schedule()
    assert output.preempted == [lowest]
    assert output.num_scheduled_tokens == {lower: 1, high: 9}


@pytest.mark.parametrize("priority, prompt_len", [(1, 6), (2, 6), (0, 16)],
                         ids=["equal", "lower", "higher-but-too-big"])
def test_only_a_strictly_higher_priority_preempts_and_only_when_that_makes_room(priority,
                                                                                prompt_len):
    """Equals never preempt each other (no turns taken every step), a lower priority never
    preempts a higher one, and nobody is preempted for a request it would not make room for
    (16 tokens and one more need 5 blocks of 4; there are 4)."""
    scheduler, block_pool = make_scheduler(num_blocks=4, policy="priority")
    running = running_seq(scheduler, block_pool, "r", 9, 8)  # 2 blocks; needs a 3rd
    running.priority = 1
    waiting = queued(scheduler, block_pool, "w", prompt_len, priority=priority)
    for _ in range(3):
        output = scheduler.schedule()
        assert output.preempted == [] and list(output.num_scheduled_tokens) == [running]
        scheduler.update(output.num_scheduled_tokens, {running: [1]})
        running.token_ids.append(1)  # the engine appends the sampled token
    assert waiting.status == SequenceStatus.WAITING


def test_priority_is_ignored_by_the_other_policies():
    scheduler, block_pool = make_scheduler(num_blocks=4, policy="fcfs")
    old, new = (running_seq(scheduler, block_pool, s, 5, 4) for s in "on")
    old.priority, new.priority = 5, 0
    queued(scheduler, block_pool, "high", 6, priority=-1)
    third = running_seq(scheduler, block_pool, "t", 5, 4)
    assert scheduler.schedule().preempted == [third]  # the newest, though of priority 0
