"""paged_cache.py's guarantees: blocks, block tables, the free queue and the prefix cache.
"""
from collections import Counter

import pytest
import torch

from conftest import assert_no_leaks, shared
from nanoserve import LLM, Engine, accumulate
from paged_cache import BlockPool, BlockTable, hash_block
from sampling import SamplingParams
from scheduler import SequenceStatus


# ----------------------------------------------------------------------------- paged cache

def test_a_block_returns_to_the_free_queue_when_its_count_reaches_zero():
    block_pool = BlockPool(4, block_size=16)
    table = BlockTable(block_pool)
    assert table.ensure(40) and block_pool.num_free_blocks == 1  # 40 tokens: 3 blocks
    shared = table.block_ids[0]
    block_pool.ref_counts[shared] += 1  # a second owner, as a prefix-cache hit makes
    table.release()
    assert block_pool.num_free_blocks == 3 and block_pool.ref_counts[shared] == 1
    block_pool.free([shared])
    assert block_pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed twice"):
        block_pool.free([shared])


# ----------------------------------------------------------------------------- prefix caching

CACHE_GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


PREFIX = list(range(40, 40 + 37))  # 37 tokens: 4 full blocks of 8 and 5 tokens of a 5th


def caching_engine(cache: bool, **kwargs) -> Engine:
    """The tiny preset on CPU in fp32, block_size 8, with the prefix cache on or off."""
    return LLM(preset="tiny", **{"kv_cache_tokens": 2048, "device": "cpu", "dtype": "float32",
                                 "block_size": 8, "enable_prefix_caching": cache} | kwargs).engine


def check_books(engine: Engine) -> None:
    """The pool's invariants, at any point between steps."""
    pool, bs = engine.block_pool, engine.block_pool.block_size
    owners = Counter(b for seq in engine.seqs.values() for b in seq.block_table.block_ids)
    assert pool.ref_counts == [owners[b] for b in range(pool.num_blocks)]
    assert set(pool.free_queue) == {b for b in range(pool.num_blocks) if not owners[b]}
    cached_in_order = [pool.block_id_to_hash[b] is not None for b in pool.free_queue]
    assert cached_in_order == sorted(cached_in_order)  # uncached blocks first, then cached
    cached_hashes = {pool.block_id_to_hash[b] for b in pool.hash_to_block_id.values()}
    assert cached_hashes == set(pool.hash_to_block_id)
    assert sum(h is not None for h in pool.block_id_to_hash) == len(pool.hash_to_block_id)
    for seq in engine.scheduler.running:  # the blocks its next tokens go to: its own, uncached
        for b in seq.block_table.block_ids[seq.num_computed_tokens // bs:]:
            assert owners[b] == 1 and pool.block_id_to_hash[b] is None, f"{seq.seq_id} writes {b}"


def serve_steps(engine: Engine, arrivals: dict[int, list], aborts: dict[int, list] | None = None,
                seqs: dict | None = None) -> dict[str, list[int]]:
    """Step the engine; before step i add the requests arrivals[i] ((id, prompt, params)) and
    abort the ids aborts[i]; check the books after every step. Each request's output tokens;
    each one's Sequence into `seqs`."""
    aborts = aborts or {}
    seqs = {} if seqs is None else seqs
    whole = {}  # request id -> its whole output so far
    step = 0
    while engine.has_unfinished() or step <= max(arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            seqs[request_id] = engine.seqs[engine.add_request(prompt, params, request_id)]
        for request_id in aborts.get(step, []):
            engine.abort(request_id)
        for delta in engine.step():
            accumulate(whole, delta)
        check_books(engine)
        step += 1
        assert step < 1000, "the engine stopped making progress"
    assert_no_leaks(engine)
    return {request_id: out.outputs[0].token_ids for request_id, out in whole.items()}


def serve_both(arrivals, aborts=None, probe=None, **kwargs) -> tuple[dict, dict]:
    """serve_steps() with the cache off and on: the same tokens (but of aborted requests, whose
    length depends on the timing). The tokens and the Sequences of the run that cached;
    probe(engine) is called on its engine first."""
    off = serve_steps(caching_engine(False, **kwargs), arrivals, aborts)
    engine = caching_engine(True, **kwargs)
    if probe is not None:
        probe(engine)
    seqs = {}
    on = serve_steps(engine, arrivals, aborts, seqs)
    aborted = sum((aborts or {}).values(), [])
    assert {k: v for k, v in on.items() if k not in aborted} == \
        {k: v for k, v in off.items() if k not in aborted}
    assert engine.stats.num_cached_tokens > 0
    return on, seqs


def spy(engine: Engine, name: str, before) -> None:
    """Call before(*args) ahead of each call of engine.scheduler's method `name`."""
    real = getattr(engine.scheduler, name)

    def spied(*args):
        before(*args)
        return real(*args)
    setattr(engine.scheduler, name, spied)


def test_shared_prefix_outputs_equal_without_the_cache():
    """Long shared prefix; requests diverging mid-block and at a block boundary, identical
    ones (n samples of one prompt, greedy and seeded), some arriving while the first still
    prefills the prefix (16 tokens a step), some after it finished."""
    seeded = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    arrivals = {
        0: [("first", PREFIX + [1, 2, 3], CACHE_GREEDY)],
        1: [("mid-block", PREFIX[:20] + [9] * 30, CACHE_GREEDY),  # diverges inside block 2
            ("same", PREFIX + [1, 2, 3], CACHE_GREEDY)],           # prefix half prefilled
        3: [("boundary", PREFIX[:24] + [7] * 9, CACHE_GREEDY)]
        + [(f"n{i}", PREFIX + [5], p) for i, p in enumerate(seeded)],
        30: [("late", PREFIX + [1, 2, 3], CACHE_GREEDY),
             ("late-longer", PREFIX + [1, 2, 3, 4], CACHE_GREEDY)],
    }
    _, seqs = serve_both(arrivals, max_num_batched_tokens=16)
    assert {k: seq.num_cached_tokens for k, seq in seqs.items()} == {
        "first": 0, "same": 32, "mid-block": 16, "boundary": 24, "n0": 32, "n1": 32, "n2": 32,
        "late": 32, "late-longer": 40}  # "same" waited for the budget while 32 were computed


def test_hit_counts_are_whole_cached_blocks_and_never_the_last_token():
    engine = caching_engine(True)
    cases = [  # (prompt, tokens found cached)
        (PREFIX, 0),                      # nothing cached yet
        (PREFIX, 32),                     # 37 tokens: the 4 full blocks
        (PREFIX[:32], 24),                # a whole-block prompt recomputes its last block
        (PREFIX[:20] + [9, 9], 16),       # diverges in block 2: blocks 0 and 1
        ([9] + PREFIX[1:], 0),            # the first block differs, so every hash does
    ]
    for i, (prompt, expected) in enumerate(cases):
        before, seqs = engine.stats.num_cached_tokens, {}
        serve_steps(engine, {0: [(str(i), prompt, CACHE_GREEDY)]}, seqs=seqs)
        assert seqs[str(i)].num_cached_tokens == expected
        assert engine.stats.num_cached_tokens - before == expected


def test_generated_tokens_are_cached_too():
    """A follow-up whose prompt is an earlier prompt plus its output finds both cached."""
    engine, seqs = caching_engine(True), {}
    follow_up = PREFIX + serve_steps(engine, {0: [("a", PREFIX, CACHE_GREEDY)]})["a"] + [3]
    serve_steps(engine, {0: [("b", follow_up, CACHE_GREEDY)]}, seqs=seqs)
    # computed: 37 + 23 tokens (the last sampled one never is): 7 full blocks of 8
    assert seqs["b"].num_cached_tokens == 56


def test_a_fully_cached_prompt_leaves_its_shared_blocks_untouched():
    """A prompt of 4 whole blocks, served once, then twice at once: the two share 3 cached
    blocks and each computes the 4th into a block of its own; no cached block's K/V change,
    and the outputs are the uncached ones."""
    prompt = PREFIX[:32]
    off = serve_steps(caching_engine(False), {0: [("a", prompt, CACHE_GREEDY)]})
    engine = caching_engine(True)
    serve_steps(engine, {0: [("a", prompt, CACHE_GREEDY)]})
    _, cached = engine.block_pool.find_cached_prefix(prompt + [0])
    assert len(cached) == 4  # the prompt's 4 blocks are cached
    kv = engine.model_runner.k_caches[:, cached].clone(), engine.model_runner.v_caches[:, cached].clone()
    on = serve_steps(engine, {0: [("b", prompt, CACHE_GREEDY), ("c", prompt, CACHE_GREEDY)]},
                     seqs=(seqs := {}))
    assert on["b"] == on["c"] == off["a"]
    assert seqs["b"].num_cached_tokens == seqs["c"].num_cached_tokens == 24
    assert torch.equal(engine.model_runner.k_caches[:, cached], kv[0])
    assert torch.equal(engine.model_runner.v_caches[:, cached], kv[1])


def test_eviction_under_memory_pressure_keeps_outputs_right():
    """A cache of 24 blocks for requests that need up to 9 each, three at a time: cached
    blocks are evicted, least recently used first, to make room; prefixes are still found;
    the outputs do not change."""
    prompts = [PREFIX[:8 * (i % 3 + 1)] + [100 + i] * 20 for i in range(9)]
    arrivals = {2 * i: [(str(i), p, CACHE_GREEDY)] for i, p in enumerate(prompts)}
    evictions = []

    def count_evictions(engine):
        pool, allocate = engine.block_pool, engine.block_pool.allocate

        def counting(n):
            cached, block_ids = len(pool.hash_to_block_id), allocate(n)
            evictions.append(cached - len(pool.hash_to_block_id))
            return block_ids
        pool.allocate = counting
    _, seqs = serve_both(arrivals, probe=count_evictions, kv_cache_tokens=192, max_num_seqs=3)
    assert sum(evictions) > 0 and all(seq.num_cached_tokens for seq in list(seqs.values())[3:])


def test_preemption_of_sequences_sharing_blocks_keeps_counts_and_outputs():
    """A cache too small for the running sequences' outputs: the newest is preempted while
    it shares its prefix blocks, and recomputed later from what is still cached."""
    arrivals = {0: [(str(i), PREFIX + [i] * 3, CACHE_GREEDY) for i in range(4)],
                4: [(str(i), PREFIX + [i] * 3, CACHE_GREEDY) for i in range(4, 8)]}
    preempted = []
    _, seqs = serve_both(arrivals, probe=lambda engine: spy(
        engine, "_preempt", lambda seq: preempted.append(shared(seq))),
        kv_cache_tokens=160, max_num_batched_tokens=32)
    assert any(preempted)


def test_abort_of_sequences_sharing_blocks_keeps_counts_right():
    """Aborts of running sequences that share their prefix and of waiting ones; the others'
    outputs do not change."""
    arrivals = {0: [(str(i), PREFIX + [i], CACHE_GREEDY) for i in range(6)]}
    aborts = {2: ["0"], 3: ["3"], 6: ["1", "5"]}
    aborted = []  # (the state it was aborted in, whether it shared a block then)

    def note_abort(seq, status) -> None:
        if status == SequenceStatus.FINISHED_ABORTED:
            aborted.append((seq.status.value, shared(seq)))

    def probe(engine) -> None:
        spy(engine, "finish", note_abort)
    on, _ = serve_both(arrivals, aborts, probe=probe, max_num_seqs=3, max_num_batched_tokens=24)
    assert ("running", True) in aborted and ("waiting", False) in aborted
    assert {"2", "4"} <= set(on)


def test_free_queue_hands_out_uncached_blocks_first_then_least_recently_used():
    pool = BlockPool(4, block_size=2)
    a, b, c, d = pool.allocate(4)
    for block_id, token in ((a, 1), (b, 2), (c, 3)):
        pool.cache_block(block_id, hash_block(b"", [token, token]))
    pool.free([b, a])         # b used less recently than a
    pool.free([d])            # no hash: handed out first
    pool.free([c])
    pool.touch([b])           # a hit takes b back out of the free queue
    assert pool.num_free_blocks == 3 and pool.ref_counts[b] == 1
    assert pool.allocate(2) == [d, a]
    assert hash_block(b"", [1, 1]) not in pool.hash_to_block_id  # a was evicted
    assert pool.hash_to_block_id == {hash_block(b"", [2, 2]): b, hash_block(b"", [3, 3]): c}


def test_the_first_block_cached_for_a_prefix_stays_cached():
    """Two sequences computed the same block at once: the second copy stays uncached."""
    pool = BlockPool(6, block_size=2)
    one, two = BlockTable(pool), BlockTable(pool)
    for table in (one, two):
        assert table.ensure(5)
        table.cache_full_blocks([1, 2, 3, 4, 5], 4)
    assert list(pool.hash_to_block_id.values()) == one.block_ids[:2]
    assert two.block_hashes == one.block_hashes  # the chain goes on from either
    first = one.block_ids[0]
    one.release()
    two.release()
    assert pool.ref_counts == [0] * 6 and pool.num_free_blocks == 6
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([first])


def test_block_hash_names_the_whole_prefix():
    first = hash_block(b"", [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(hash_block(b"", [9, 2]), [3, 4])
    assert hash_block(first, [3, 4]) == hash_block(hash_block(b"", [1, 2]), [3, 4])


X, Y, B = PREFIX[:8], PREFIX[8:16], PREFIX[16:24]  # blocks of 8 tokens


@pytest.mark.parametrize("arrivals, num_cached_tokens", [
    ({0: [("XY", X + Y + [1, 2, 3], CACHE_GREEDY)],
      2: [("Y", Y + [4, 5, 6], CACHE_GREEDY), ("XY again", X + Y + [7], CACHE_GREEDY)]},
     {"XY": 0, "Y": 0, "XY again": 16}),
    ({0: [("BBBB", B * 4 + [1], CACHE_GREEDY)], 2: [("BBBB again", B * 4 + [2], CACHE_GREEDY)]},
     {"BBBB": 0, "BBBB again": 32}),
], ids=["shifted-by-a-block", "repeated-blocks"])
def test_a_block_is_found_only_behind_the_same_prefix(arrivals, num_cached_tokens):
    """A block's K/V depend on its position and on every token before it, so a cached block
    may serve only the same block behind the same prefix. Block Y, cached at position 1, is
    not served to a prompt that starts with Y; in B B B B, each B is its own block. The
    outputs equal those without the cache (positions are learned embeddings: the K/V of one
    block at two positions differ)."""
    _, seqs = serve_both(arrivals)
    assert {k: seq.num_cached_tokens for k, seq in seqs.items()} == num_cached_tokens


def test_a_released_prefix_is_evicted_from_its_last_block():
    """A released sequence gives its blocks back last first, so memory pressure evicts its
    prefix from the end and the prefix's first blocks are still found. Evicting the first
    block would lose them all: a lookup stops at the first block it cannot find."""
    pool = BlockPool(3, block_size=2)
    table = BlockTable(pool)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert table.ensure(6)
    table.cache_full_blocks(tokens, 6)
    first_two = table.block_ids[:2]
    table.release()
    pool.allocate(1)  # memory pressure: one of the three cached blocks is evicted
    assert pool.find_cached_prefix(tokens)[1] == first_two


def test_prompt_logprobs_requests_compute_every_prompt_token():
    """A request that asks for prompt logprobs does not read the cache: it needs them all."""
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    results = []
    for cache in (False, True):
        engine = caching_engine(cache)
        serve_steps(engine, {0: [("a", PREFIX, CACHE_GREEDY)]})
        serve_steps(engine, {0: [("b", PREFIX, params)]}, seqs=(seqs := {}))
        assert seqs["b"].num_cached_tokens == 0
        results.append(seqs["b"].prompt_logprobs)
    assert len(results[0]) == len(PREFIX) and results[0] == results[1]


def test_prefix_caching_off_caches_nothing():
    arrivals = {0: [(str(i), PREFIX + [i], CACHE_GREEDY) for i in range(3)],
                5: [("3", PREFIX, CACHE_GREEDY)]}
    engine = caching_engine(False)
    serve_steps(engine, arrivals)
    assert engine.stats.num_cached_tokens == 0 and not engine.block_pool.hash_to_block_id
    assert engine.stats.num_prompt_tokens == 3 * 38 + 37
