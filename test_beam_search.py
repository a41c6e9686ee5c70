"""beam_search.py's guarantees: vLLM's API, the search itself against a reference written after
transformers' (a full recompute of every beam), copy-on-write on shared blocks, and beams
beside ordinary requests, under preemption, with nothing held at the end.
"""
import math
from types import SimpleNamespace

import pytest
import torch

import model_runner
from conftest import (GREEDY, assert_no_leaks, fixture_llm, http, server_in_process, tiny,
                      token_ids)
from beam_search import get_beam_search_score
from nanoserve import LLM, BeamSearchParams
from paged_cache import BlockPool, BlockTable
from sampling import SamplingParams
from swap import copy_blocks

PROMPTS = ["ROMEO:", "Hello there, my lord", "x" * 21]


def reference_beam_search(model, prompt: list[int], beam_width: int, max_tokens: int
                          ) -> list[tuple[list[int], float]]:
    """transformers' beam search (num_beams = num_return_sequences = beam_width, no sampling,
    no end-of-text, length_penalty 1.0), on dense full-recompute forwards: (output tokens,
    log-probability) of each returned sequence, best first. It starts from beam_width copies
    of the prompt, all but the first scored -1e9, and each step keeps the best beam_width of
    the top 2 x beam_width (beam, token) pairs over all beams."""
    beams = [list(prompt)] * beam_width
    scores = torch.tensor([0.0] + [-1e9] * (beam_width - 1), dtype=torch.float64)
    for _ in range(max_tokens):
        logits = model.forward_dense(torch.tensor(beams))[:, -1].double()  # (W, vocab)
        candidates = (scores[:, None] + torch.log_softmax(logits, dim=-1)).flatten()
        top_scores, top_index = candidates.topk(2 * beam_width)
        vocab_size = logits.shape[1]
        beams = [beams[i // vocab_size] + [i % vocab_size] for i in top_index.tolist()]
        beams, scores = beams[:beam_width], top_scores[:beam_width]
    # every length is the same: ordered by score / length, they are ordered by score
    return [(beam[len(prompt):], score) for beam, score in zip(beams, scores.tolist())]


def searched(llm: LLM, prompts: list, beam_width: int, max_tokens: int) -> list[list]:
    """Each prompt's sequences as (output tokens, cum_logprob), best first."""
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.beam_search(prompts, params)
    found = []
    for prompt, output in zip(prompts, outputs):
        num_prompt = len(llm.engine.parse_prompt(prompt)[1])
        found.append([(s.tokens[num_prompt:], s.cum_logprob) for s in output.sequences])
    return found


def assert_same_search(found: list[tuple[list[int], float]],
                       expected: list[tuple[list[int], float]]) -> None:
    assert [tokens for tokens, _ in found] == [tokens for tokens, _ in expected]
    for (_, cum), (_, expected_cum) in zip(found, expected):
        assert cum == pytest.approx(expected_cum, abs=1e-3)


@pytest.fixture(scope="module")
def shipped() -> LLM:
    return LLM(device="cpu", dtype="float32", kv_cache_tokens=2048, block_size=4)


# ----------------------------------------------------------------------------- the API

@pytest.mark.parametrize("name, value", [
    ("beam_width", 0), ("beam_width", True), ("beam_width", 2.0), ("max_tokens", 0),
    ("ignore_eos", 1), ("temperature", math.nan), ("temperature", -1.0),
    ("length_penalty", math.inf), ("length_penalty", "1"), ("include_stop_str_in_output", None),
    ("stop", [""]), ("stop", 5), ("stop", {"x": 1}), ("stop", ["x"] * 17), ("stop", ["x" * 65])])
def test_bad_beam_search_param_is_rejected_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**{name: value})


def test_a_stop_string_is_a_string_or_strings():
    assert BeamSearchParams(stop="and").stop == ["and"]
    assert BeamSearchParams(stop=("and", "or")).stop == ["and", "or"]
    assert BeamSearchParams().stop == []


def test_a_beam_search_that_cannot_fit_is_refused_before_it_runs():
    llm = tiny(kv_cache_tokens=256, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.beam_search(["A"], BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search(["A"], BeamSearchParams(beam_width=4, max_tokens=100))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.engine.add_beam_request("A", SamplingParams())
    assert_no_leaks(llm.engine)


def test_each_output_has_beam_width_sequences_best_first(shipped):
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    output, = shipped.beam_search(["ROMEO:"], params)
    prompt_ids = shipped.engine.tokenizer.encode("ROMEO:")
    assert len(output.sequences) == 3
    scores = [s.cum_logprob / len(s.tokens) for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    for s in output.sequences:
        assert s.tokens[:len(prompt_ids)] == prompt_ids and len(s.tokens) == len(prompt_ids) + 5
        assert s.text == shipped.engine.tokenizer.decode(s.tokens)
        assert s.finish_reason == "length"
        assert sum(lp for entry in s.logprobs for lp in entry.values()) == \
            pytest.approx(s.cum_logprob)
    assert_no_leaks(shipped.engine)


# ----------------------------------------------------------------------------- the search

def test_width_one_is_greedy():
    llm = tiny()
    greedy = token_ids(llm.generate(PROMPTS, GREEDY))
    found = searched(llm, PROMPTS, beam_width=1, max_tokens=GREEDY.max_tokens)
    assert [sequences[0][0] for sequences in found] == greedy
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beams_equal_a_reference_beam_search_on_the_shipped_model(shipped, beam_width):
    found = searched(shipped, PROMPTS, beam_width, max_tokens=10)
    for prompt, sequences in zip(PROMPTS, found):
        ids = shipped.engine.tokenizer.encode(prompt)
        assert_same_search(sequences,
                           reference_beam_search(shipped.engine.model, ids, beam_width, 10))
    assert shipped.engine.stats.num_steps > 0
    assert_no_leaks(shipped.engine)


def test_beams_equal_a_reference_beam_search_with_grouped_query_attention(tmp_path):
    llm = fixture_llm("qwen3", tmp_path, block_size=4)
    found = searched(llm, PROMPTS[:2], beam_width=4, max_tokens=6)
    for prompt, sequences in zip(PROMPTS, found):
        ids = llm.engine.tokenizer.encode(prompt)
        assert_same_search(sequences, reference_beam_search(llm.engine.model, ids, 4, 6))
    assert_no_leaks(llm.engine)


def test_end_of_text_finishes_a_hypothesis_scored_as_vllm_scores_it():
    llm = tiny()
    engine = llm.engine
    first = token_ids(llm.generate(["Hello"], GREEDY))[0][0]
    engine.eos_token_ids[:] = [first]  # the greedy first token ends a hypothesis at once
    output, = llm.beam_search(["Hello"], BeamSearchParams(beam_width=3, max_tokens=6))
    prompt_ids = engine.tokenizer.encode("Hello")
    best = output.sequences[0]
    assert (best.finish_reason, best.tokens, best.text) == ("stop", prompt_ids + [first], "Hello")
    assert [s.finish_reason for s in output.sequences[1:]] == ["length", "length"]
    assert all(first not in s.tokens[len(prompt_ids):] for s in output.sequences[1:])
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, first) for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] == best.cum_logprob / len(prompt_ids)  # the length leaves its eos out
    assert_no_leaks(engine)


STOP_PROMPT = "Hello there, my lord"  # its best beam of 8 tokens: ", and th"


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_finishes_a_hypothesis_cut_at_it(shipped, include_stop_str_in_output):
    """The best beam without a stop string completes "and" at its 5th token: with it, that
    prefix is a finished hypothesis, its score the same tokens' (the best of this search),
    its text cut before "and" (after it, with include_stop_str_in_output)."""
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    plain = shipped.beam_search([STOP_PROMPT], params)[0].sequences[0]
    assert plain.text.startswith(STOP_PROMPT + ", and")
    num_tokens = len(shipped.engine.tokenizer.encode(STOP_PROMPT)) + 5
    output, = shipped.beam_search([STOP_PROMPT], BeamSearchParams(
        beam_width=3, max_tokens=8, ignore_eos=True, stop="and",
        include_stop_str_in_output=include_stop_str_in_output))
    best = output.sequences[0]
    text = STOP_PROMPT + (", and" if include_stop_str_in_output else ", ")
    assert (best.tokens, best.text, best.finish_reason, best.stop_reason) == \
        (plain.tokens[:num_tokens], text, "stop", "and")
    assert best.cum_logprob == pytest.approx(sum(lp for entry in plain.logprobs[:5]
                                                 for lp in entry.values()))
    for other in output.sequences[1:]:  # no stop string in them: they ran to max_tokens
        assert "and" not in other.text[len(STOP_PROMPT):]
        assert (other.finish_reason, other.stop_reason) == ("length", None)
    assert_no_leaks(shipped.engine)


# ----------------------------------------------------------------------------- copy-on-write

def test_a_forked_table_copies_the_shared_block_it_writes_into():
    pool = BlockPool(8, block_size=4)
    parent = BlockTable(pool)
    assert parent.ensure(6)  # 6 tokens: a full block and a half-filled one
    child = parent.fork()
    assert child.block_ids == parent.block_ids and pool.ref_counts[parent.block_ids[1]] == 2
    with pytest.raises(AssertionError, match="written but shared"):
        child.assert_owned(6)
    assert child.num_missing_blocks(7, 6) == 1
    assert child.ensure(7, first_written=6)
    shared = parent.block_ids[1]
    assert child.copies == [(shared, child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0]  # the full block stays shared
    assert pool.ref_counts[shared] == 1 and pool.ref_counts[child.block_ids[1]] == 1
    child.assert_owned(6)
    parent.assert_owned(6)  # the other owner writes in place: nobody else holds it now
    child.release()
    parent.release()
    assert pool.num_free_blocks == 8 and not any(pool.ref_counts)


def test_copy_blocks_copies_every_layer_of_k_and_v():
    k = torch.randn(2, 5, 4, 1, 3)
    v = torch.randn(2, 5, 4, 1, 3)
    k0, v0 = k.clone(), v.clone()
    copy_blocks(k, v, [(1, 3), (3, 0)])  # 3's old contents go to 0: read before written
    assert torch.equal(k[:, 3], k0[:, 1]) and torch.equal(v[:, 3], v0[:, 1])
    assert torch.equal(k[:, 0], k0[:, 3]) and torch.equal(v[:, 0], v0[:, 3])
    assert torch.equal(k[:, 2], k0[:, 2])


def test_the_engine_copies_a_shared_block_before_a_beam_writes_into_it(shipped, monkeypatch):
    copies = []
    original = model_runner.copy_blocks

    def checked(k_caches, v_caches, pairs):
        original(k_caches, v_caches, pairs)
        for src, dst in pairs:
            assert torch.equal(k_caches[:, dst], k_caches[:, src])
            assert torch.equal(v_caches[:, dst], v_caches[:, src])
        copies.extend(pairs)
    monkeypatch.setattr(model_runner, "copy_blocks", checked)
    shipped.engine.step_records = []
    found = searched(shipped, PROMPTS[:1], beam_width=4, max_tokens=10)
    ids = shipped.engine.tokenizer.encode(PROMPTS[0])
    assert_same_search(found[0], reference_beam_search(shipped.engine.model, ids, 4, 10))
    assert copies
    assert sum(r.num_block_copies for r in shipped.engine.step_records) == len(copies)
    shipped.engine.step_records = None
    assert_no_leaks(shipped.engine)


def test_beams_share_their_prefix_blocks():
    llm = tiny(block_size=4)
    engine = llm.engine
    engine.add_beam_request("The quick brown fox jumps", BeamSearchParams(
        beam_width=4, max_tokens=12, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        beams = engine.scheduler.running
        if len(beams) == 4:
            held.append((engine.last_step.kv_blocks_used,
                         sum(len(seq.block_table.block_ids) for seq in beams)))
    assert all(used < tables for used, tables in held)  # shared: fewer than the tables name
    assert_no_leaks(engine)


def test_beam_shared_prefixes_are_the_blocks_all_beams_of_a_request_hold():
    """model_runner.beam_shared_prefixes' example: three beams of one request at 14 tokens,
    blocks of 4, share A and B; a sequence sharing a cached prompt, another request's lone
    beam and a beam recomputing its prompt (many new tokens) are attended apart; a block a
    beam writes into (here the one holding token 8) is never counted, shared or not."""
    request, lone, other = object(), object(), object()

    def scheduled(blocks, num_computed, beams=request, num_new=1):
        table = SimpleNamespace(block_ids=list(blocks))
        return SimpleNamespace(beams=beams, num_computed_tokens=num_computed,
                               block_table=table), num_new
    batch = [scheduled("ABCD", 13), scheduled("ABEF", 13), scheduled("AB", 6, beams=None),
             scheduled("ABCG", 13), scheduled("ABHI", 13, beams=lone),
             scheduled("JKL", 8, beams=other), scheduled("JKL", 8, beams=other),
             scheduled("ABCD", 0, num_new=14)]
    assert model_runner.beam_shared_prefixes(batch, 4) == [([0, 1, 3], 2), ([5, 6], 2)]


def test_a_request_s_beams_attend_their_shared_prefix_once(shipped, monkeypatch):
    """Cascade attention in the engine: each step's beams of one request are a group whose
    shared blocks are attended once (kernels.add_shared_prefix), and the search still equals
    the reference's."""
    groups = []
    original = model_runner.beam_shared_prefixes

    def recorded(scheduled, block_size):
        found = original(scheduled, block_size)
        groups.extend(found)
        return found
    monkeypatch.setattr(model_runner, "beam_shared_prefixes", recorded)
    found = searched(shipped, PROMPTS[1:2], beam_width=4, max_tokens=10)
    ids = shipped.engine.tokenizer.encode(PROMPTS[1])
    assert_same_search(found[0], reference_beam_search(shipped.engine.model, ids, 4, 10))
    assert max(num_shared for _, num_shared in groups) >= len(ids) // 4  # the prompt at least
    assert max(len(beams) for beams, _ in groups) == 4
    assert_no_leaks(shipped.engine)


# ----------------------------------------------------------------------------- with the rest

def test_beams_beside_ordinary_requests_give_each_its_result_alone():
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    alone_beams = tiny().beam_search(PROMPTS, params)
    alone_greedy = token_ids(tiny().generate(PROMPTS, GREEDY))
    llm = tiny(block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    beam_ids = [engine.add_beam_request(p, params) for p in PROMPTS]
    greedy_ids = [engine.add_request(p, GREEDY, stream=False) for p in PROMPTS]
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        mixed = engine.last_step.scheduled
        assert not mixed or len(mixed) <= engine.config.max_num_seqs
    for request_id, alone in zip(beam_ids, alone_beams):
        got = [(c.token_ids, c.cumulative_logprob) for c in outputs[request_id].outputs]
        expected = [(s.tokens[-8:], s.cum_logprob) for s in alone.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [outputs[i].outputs[0].token_ids for i in greedy_ids] == alone_greedy
    assert_no_leaks(engine)


def test_the_prompt_is_computed_once_in_chunks_then_each_beam_decodes_a_token_a_step():
    engine = tiny(block_size=4, max_num_batched_tokens=8).engine
    prompt = list(range(30, 50))  # 20 tokens: 3 chunks of the budget
    engine.add_beam_request(prompt, BeamSearchParams(beam_width=4, max_tokens=6,
                                                     ignore_eos=True))
    engine.step_records = []
    while engine.has_unfinished():
        engine.step()
    scheduled = [record.scheduled for record in engine.step_records]
    assert [sum(step.values()) for step in scheduled[:3]] == [8, 8, 4]  # one sequence's
    assert all(list(step.values()) == [1] * 4 for step in scheduled[3:])  # every beam, a token
    assert engine.stats.num_batched_tokens == 20 + 5 * 4  # the prompt, then 5 steps of 4 beams
    assert_no_leaks(engine)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_beams_survive_preemption_under_a_tight_cache(preemption_mode):
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    alone = searched(tiny(), PROMPTS, 3, 12)
    engine = tiny(kv_cache_tokens=112, block_size=4, max_num_batched_tokens=32,
                  preemption_mode=preemption_mode).engine
    ids = [engine.add_beam_request(prompt, params) for prompt in PROMPTS]
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        for request in engine.beam_search.requests.values():  # all running or all waiting
            assert len({seq.status for seq in request.group.seqs}) == 1
    for request_id, expected in zip(ids, alone):
        found = [(c.token_ids, c.cumulative_logprob) for c in outputs[request_id].outputs]
        assert_same_search(found, expected)
    assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_a_higher_priority_request_preempts_a_beam_search_whole():
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    alone_beams = searched(tiny(), PROMPTS[2:], 3, 12)[0]
    urgent = PROMPTS[1] * 3
    alone_greedy = token_ids(tiny().generate([urgent], GREEDY))[0]
    engine = tiny(policy="priority", kv_cache_tokens=112, block_size=4).engine
    beams_id = engine.add_beam_request(PROMPTS[2], params, priority=1)
    for _ in range(4):
        engine.step()
    urgent_id = engine.add_request(urgent, GREEDY, stream=False, priority=0)
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        for request in engine.beam_search.requests.values():
            assert len({seq.status for seq in request.group.seqs}) == 1
    assert engine.scheduler.num_preemptions >= 3  # the three beams, together
    assert outputs[urgent_id].outputs[0].token_ids == alone_greedy
    found = [(c.token_ids, c.cumulative_logprob) for c in outputs[beams_id].outputs]
    assert_same_search(found, alone_beams)
    assert_no_leaks(engine)


@pytest.mark.allows_fallback
def test_a_beam_that_fails_fails_its_request_whole(monkeypatch):
    llm = tiny(block_size=4)
    engine = llm.engine
    prompt = [72, 101, 108, 108, 111]
    real_forward = engine.model.forward
    calls = []

    def forward(input_ids, positions, *args):
        if (positions == len(prompt) + 2).any():  # the step every beam computes its 3rd token
            calls.append(len(input_ids))
        if len(calls) in (1, 2):  # the batch, then the first beam alone; its siblings run
            raise RuntimeError("poisoned position")
        return real_forward(input_ids, positions, *args)
    monkeypatch.setattr(engine.model, "forward", forward)
    with pytest.raises(RuntimeError, match="poisoned position"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8))
    assert engine.stats.num_fallbacks == 1
    assert_no_leaks(engine)


def test_abort_frees_every_beam():
    llm = tiny(block_size=4)
    engine = llm.engine
    request_id = engine.add_beam_request("Hello there", BeamSearchParams(
        beam_width=4, max_tokens=30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort(request_id)
    output, = engine.step()
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- HTTP

def test_http_use_beam_search_gives_n_choices_as_offline_beam_search():
    llm = tiny()
    expected, = llm.beam_search(["Hello"], BeamSearchParams(beam_width=3, max_tokens=6,
                                                            length_penalty=0.5))
    with server_in_process(llm.engine) as url:
        body = dict(prompt="Hello", max_tokens=6, n=3, use_beam_search=True, length_penalty=0.5)
        status, got = http(url, "/v1/completions", body)
        refused = [http(url, "/v1/completions", body | change)
                   for change in (dict(stream=True), dict(n=0), dict(length_penalty="x"))]
    assert status == 200
    assert ["Hello" + c["text"] for c in got["choices"]] == [s.text for s in expected.sequences]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert [(code, answer["error"]["param"]) for code, answer in refused] == \
        [(400, "stream"), (400, "n"), (400, "length_penalty")]
    assert_no_leaks(llm.engine)


def test_http_use_beam_search_takes_stop_as_offline_beam_search(shipped):
    expected, = shipped.beam_search([STOP_PROMPT], BeamSearchParams(
        beam_width=3, max_tokens=8, ignore_eos=True, stop=["and"]))
    body = dict(prompt=STOP_PROMPT, max_tokens=8, n=3, use_beam_search=True, ignore_eos=True,
                stop="and")
    with server_in_process(shipped.engine) as url:
        status, got = http(url, "/v1/completions", body)
        bad_status, bad = http(url, "/v1/completions", body | dict(stop=[""]))
    assert status == 200
    assert [(STOP_PROMPT + c["text"], c["finish_reason"], c["stop_reason"])
            for c in got["choices"]] == \
        [(s.text, s.finish_reason, s.stop_reason) for s in expected.sequences]
    assert got["choices"][0]["stop_reason"] == "and"
    assert (bad_status, bad["error"]["param"]) == (400, "stop")
    assert_no_leaks(shipped.engine)
