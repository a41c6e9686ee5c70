"""swap.py's guarantees: preemption by swapping keeps a sequence's work exactly, its host
blocks are accounted like the device's, and auto swaps when copying is cheaper.
"""
import dataclasses

import pytest
import torch

from conftest import (GREEDY, PROMPTS, assert_no_leaks, http, run_to_end, running_seq,
                      server_in_process, tiny, token_ids)
from nanoserve import EngineConfig
from paged_cache import BlockPool
from sampling import SamplingParams
from scheduler import Scheduler, SequenceStatus
from swap import SwapSpace

TIGHT = dict(kv_cache_tokens=192, block_size=16, max_num_batched_tokens=64)  # preempts often


@pytest.fixture(scope="module")
def unconstrained() -> list[list[int]]:
    """Greedy outputs of PROMPTS with room for all: nothing is preempted."""
    return token_ids(tiny(max_num_batched_tokens=64).generate(PROMPTS, GREEDY))


# ----------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_greedy_output_survives_preemption_by_swapping(unconstrained, policy, mode):
    llm = tiny(policy=policy, preemption_mode=mode, **TIGHT)
    priority = [(i + 1) % 2 for i in range(len(PROMPTS))]
    assert token_ids(llm.generate(PROMPTS, GREEDY, priority=priority)) == unconstrained
    assert llm.engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert llm.engine.scheduler.num_swapped_out > 0
    assert_no_leaks(llm.engine)


def test_seeded_sampling_survives_preemption_by_swapping():
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    want = token_ids(tiny().generate(PROMPTS, params))
    llm = tiny(preemption_mode="swap", **TIGHT)
    assert token_ids(llm.generate(PROMPTS, params)) == want
    assert llm.engine.scheduler.num_swapped_out > 0


def test_a_full_swap_space_falls_back_to_recompute(unconstrained):
    """Room for 2 host blocks: a sequence of more computed blocks is recomputed instead."""
    block_bytes = 16 * tiny(kv_cache_tokens=16).engine.model_runner.kv_bytes_per_token
    llm = tiny(preemption_mode="swap", swap_space=2 * block_bytes / 2**30, **TIGHT)
    assert llm.engine.model_runner.swap_space.num_blocks == 2
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == unconstrained
    scheduler = llm.engine.scheduler
    assert scheduler.num_swapped_out < scheduler.num_preemptions
    assert_no_leaks(llm.engine)


def test_aborting_a_swapped_out_request_frees_its_host_blocks():
    engine = tiny(preemption_mode="swap", **TIGHT).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.scheduler.num_swapped_out == 0:
        engine.step()
    swapped = [seq for seq in engine.seqs.values() if seq.is_swapped_out]
    assert swapped and engine.swap_blocks_used > 0
    for seq in swapped:
        engine.abort(seq.request_id)
    assert engine.swap_blocks_used == 0
    for request_id in ids:
        engine.abort(request_id)
    run_to_end(engine)
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- the mechanism

def small_swap_space(num_host_blocks=8, num_device_blocks=8) -> tuple[SwapSpace, torch.Tensor,
                                                                        torch.Tensor]:
    """A SwapSpace over random device caches of 2 layers, blocks of 4, 2 heads of 3."""
    shape = (2, num_device_blocks + 1, 4, 2, 3)
    k_caches, v_caches = torch.randn(shape), torch.randn(shape)
    return SwapSpace(num_host_blocks, k_caches, v_caches), k_caches, v_caches


def test_copies_out_and_back_in_restore_the_blocks_k_and_v_elsewhere():
    swap_space, k_caches, v_caches = small_swap_space()
    k_before, v_before = k_caches[:, [1, 5]].clone(), v_caches[:, [1, 5]].clone()
    swap_space.copy_out(k_caches, v_caches, [(1, 3), (5, 0)])
    k_caches[:, [1, 5]] = 0
    v_caches[:, [1, 5]] = 0
    swap_space.copy_in(k_caches, v_caches, [(3, 6), (0, 2)])
    assert torch.equal(k_caches[:, [6, 2]], k_before) and torch.equal(v_caches[:, [6, 2]],
                                                                        v_before)


def test_every_host_block_can_be_handed_out_once():
    swap_space, _, _ = small_swap_space(num_host_blocks=4)
    assert sorted(swap_space.allocate(4)) == [0, 1, 2, 3]
    assert not swap_space.can_allocate(1)
    with pytest.raises(RuntimeError, match="asked for 1 host blocks; 0 are free"):
        swap_space.allocate(1)


def swapping_scheduler(num_blocks=4, num_host_blocks=8, mode="swap"):
    swap_space, _, _ = small_swap_space(num_host_blocks, num_blocks)
    block_pool = BlockPool(num_blocks, block_size=4)
    scheduler = Scheduler(block_pool, 8, 512, True, "fcfs", preemption_mode=mode,
                          swap_space=swap_space)
    return scheduler, block_pool, swap_space


def test_scheduler_output_lists_the_copies_of_each_swap_out_and_swap_in():
    """Two sequences of 2 blocks each fill the 4; the newer is swapped out (its 2 computed
    blocks to host blocks 0 and 1), keeps its progress, and comes back into fresh blocks when
    the older finishes, its table rewritten."""
    scheduler, block_pool, swap_space = swapping_scheduler()
    old = running_seq(scheduler, block_pool, "o", 8, 7)
    new = running_seq(scheduler, block_pool, "n", 9, 8)
    new_blocks = list(new.block_table.block_ids)
    output = scheduler.schedule()  # new's 9th token needs a 3rd block
    assert output.preempted == [new] and output.swapped_out == {new: [(new_blocks[0], 0),
                                                                      (new_blocks[1], 1)]}
    assert new.is_swapped_out and new.num_computed_tokens == 8 and new.num_preemptions == 1
    assert new.recompute_until == 0  # swapped, it recomputes nothing
    assert swap_space.num_free_blocks == 6
    scheduler.update(output.num_scheduled_tokens, {})
    scheduler.finish(old, SequenceStatus.FINISHED_LENGTH)
    output = scheduler.schedule()
    fresh = new.block_table.block_ids
    assert output.swapped_in == {new: [(0, fresh[0]), (1, fresh[1])]} and len(fresh) == 3
    assert output.num_scheduled_tokens == {new: 1} and output.phases == {new: "prefill"}
    assert not new.is_swapped_out and swap_space.num_free_blocks == 8


def test_a_swapped_in_sequence_registers_its_blocks_in_the_prefix_cache_again():
    scheduler, block_pool, _ = swapping_scheduler(num_blocks=4)
    old = running_seq(scheduler, block_pool, "o", 8, 7)
    new = running_seq(scheduler, block_pool, "n", 9, 8)
    scheduler.update(scheduler.schedule().num_scheduled_tokens, {})  # new swapped out
    scheduler.finish(old, SequenceStatus.FINISHED_LENGTH)
    block_pool.free(block_pool.allocate(block_pool.num_free_blocks))  # evict every cached block
    output = scheduler.schedule()
    scheduler.update(output.num_scheduled_tokens, {})
    _, cached = block_pool.find_cached_prefix(new.token_ids + [0])
    assert cached == new.block_table.block_ids[:2]


@pytest.mark.parametrize("copy_seconds, num_tokens, swaps",
                         [(3.0, 1, False), (3.0, 3, False), (3.0, 64, True), (5.0, 64, False)])
def test_auto_swaps_when_the_copy_costs_less_than_the_recompute(copy_seconds, num_tokens, swaps):
    """Recomputing costs 1 s a token; copying a block of 4 out and in, 3 s: up to 3 tokens
    recompute (their partial block costs a whole copy), 64 tokens (16 blocks: 48 s against
    64 s) swap. At 5 s a block, copying costs more than recomputing at any length."""
    swap_space, _, _ = small_swap_space()
    swap_space.recompute_seconds_per_token = 1.0
    swap_space.copy_seconds_per_block = copy_seconds
    assert swap_space.swap_is_cheaper(num_tokens) == swaps


def test_only_prefill_tokens_time_the_recompute_rate(monkeypatch):
    """auto's prefill rate (seconds a token of recompute): 64 decodes in a step, or 16 decodes
    of 1 token and 3 drafts, leave it unknown; a step of 64 prompt tokens sets it; decodes
    after that leave it as it was. (A decode step is dearer a token than a prefill's.)"""
    runner = tiny(preemption_mode="auto").engine.model_runner

    def no_model(num_scheduled_tokens, spec_decode_tokens):
        return None
    monkeypatch.setattr(runner, "execute_model", no_model)
    decodes = {object(): 1 for _ in range(64)}
    verifying = {object(): [1, 2, 3] for _ in range(16)}
    runner.execute_timed(decodes, {})
    runner.execute_timed({seq: 4 for seq in verifying}, verifying)
    assert runner.swap_space.recompute_seconds_per_token is None
    runner.execute_timed({object(): 64}, {})
    rate = runner.swap_space.recompute_seconds_per_token
    assert rate is not None
    runner.execute_timed(decodes, {})
    assert runner.swap_space.recompute_seconds_per_token == rate


def test_preemption_mode_and_swap_space_are_validated_naming_the_field():
    for fields, message in [(dict(preemption_mode="disk"), "unknown preemption_mode 'disk'"),
                            (dict(swap_space=-1.0), "swap_space must be a number in"),
                            (dict(swap_space=float("nan")), "swap_space must be a number in"),
                            (dict(swap_space=True), "swap_space must be a number in")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(preset="tiny", device="cpu", **fields)


def test_streams_of_swapped_sequences_equal_their_unconstrained_streams():
    """Deltas streamed while sequences are swapped out and in: each request's tokens arrive
    once each, in order (run_to_end's deltas joined)."""
    engine = tiny(preemption_mode="swap", **TIGHT).engine
    params = dataclasses.replace(GREEDY, max_tokens=20)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    deltas = run_to_end(engine)
    want = token_ids(tiny().generate(PROMPTS, params))
    got = [[t for d in deltas[i] for t in d.outputs[0].token_ids] for i in ids]
    assert got == want and engine.scheduler.num_swapped_in > 0
    assert_no_leaks(engine)


def test_metrics_count_swaps_out_and_in():
    engine = tiny(preemption_mode="swap", **TIGHT).engine
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    run_to_end(engine)
    scheduler = engine.scheduler
    assert scheduler.num_swapped_out == scheduler.num_swapped_in > 0
    with server_in_process(engine) as url:
        text = http(url, "/metrics")[1]
    assert f"nanoserve:num_swapped_out_total {scheduler.num_swapped_out}" in text
    assert f"nanoserve:num_swapped_in_total {scheduler.num_swapped_in}" in text
    assert "# TYPE nanoserve:swap_blocks_used gauge" in text
