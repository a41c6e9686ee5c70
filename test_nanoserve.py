"""The engine's guarantees (nanoserve.py), one test each: exactness whatever the batch, chunking,
preemption or attention backend; streaming outputs; bad input refused; n samples; failures
and aborts. Run every test file: python -m pytest -q -n 2 --dist loadfile
"""
import ast
import asyncio
import dataclasses
import io
import math
import os
import random
import re
import sys
import threading
import time

import pytest
import torch

import nanoserve
from conftest import (DEVICE, GREEDY, PROMPTS, CountSyncs, assert_no_leaks,
                      assert_paged_equals_dense_at_every_position, http, nanoserve_main, new_seq,
                      parse_events, progress_frames, run_to_end, server_in_process, tiny,
                      token_ids)
from nanoserve import LLM, Engine, EngineConfig, accumulate
from sampling import SamplingParams
from server import Server, ServerConfig
from tokenizer import EOT, RECENT_CHARS, Detokenizer, byte_tokenizer


def whole_token_ids(deltas: list) -> list[int]:
    """One request's output tokens: its delta outputs added up as every front end adds them."""
    whole = {}
    for delta in deltas:
        accumulate(whole, delta)
    return whole[deltas[0].request_id].outputs[0].token_ids


# ----------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("chunks", [[45], [16, 16, 13], [7, 20, 18], [30] + [1] * 15],
                         ids=["prefill", "chunked-prefill", "uneven-chunks", "decode"])
@torch.inference_mode()
def test_paged_logits_equal_dense_forward(chunks, preset):
    """ModelRunner.execute_model, chunk by chunk: the logits at each chunk's end equal a dense forward's
    (GPT-2's layout, and Llama's with grouped heads and RoPE)."""
    engine = tiny(preset=preset, block_size=8).engine
    tokens = torch.randint(0, 257, (sum(chunks),), generator=torch.Generator().manual_seed(0))
    dense = engine.model.forward_dense(tokens[None])[0]
    seq, paged, ends = new_seq(engine, []), [], []
    for n in chunks:
        end = seq.num_computed_tokens + n
        seq.token_ids = tokens[:end].tolist()  # ends with the chunk: it samples there
        assert seq.block_table.ensure(end)
        paged.append(engine.model_runner.execute_model({seq: n}).logits[0])
        seq.num_computed_tokens, ends = end, ends + [end - 1]
    seq.block_table.release()
    engine.model_runner.input_batch.remove(seq)
    rel = (torch.stack(paged) - dense[ends]).abs().max() / dense.abs().max()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    assert_no_leaks(engine)


@torch.inference_mode()
def test_paged_logits_equal_dense_forward_at_every_position():
    """One execute_model over 30 sequences, the prefixes of one text: row i is position i's logits."""
    engine = tiny(block_size=8).engine
    tokens = torch.randint(0, 257, (30,), generator=torch.Generator().manual_seed(1))
    assert_paged_equals_dense_at_every_position(engine, tokens)


def test_block_tables_are_as_wide_as_the_batch_needs_not_as_max_model_len():
    """A step's block tables cost what its sequences' blocks are: 20 tokens in blocks of 8
    take a 16-column table, where max_model_len 1024 would take 128 columns."""
    engine = tiny(block_size=8).engine
    assert engine.max_model_len == 1024
    seq = new_seq(engine, list(range(20)))
    assert seq.block_table.ensure(20)
    tables = engine.model_runner._prepare_inputs({seq: 20}).attn_metadata.block_tables
    assert tables.shape == (1, 16) and tables[0, :3].tolist() == seq.block_table.block_ids
    seq.block_table.release()


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "static"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_greedy_output_is_independent_of_batching(alone, policy, chunked):
    llm = tiny(policy=policy, enable_chunked_prefill=chunked,
               max_num_batched_tokens=64 if chunked else 256, max_num_seqs=4)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.stats.peak_batch_size > 1
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority", "static"])
def test_greedy_output_survives_preemption(alone, policy):
    """Priorities (1, 0, 1, ...: the later ones outrank the first) matter to priority alone."""
    llm = tiny(policy=policy, kv_cache_tokens=192, block_size=16, max_num_batched_tokens=64)
    priority = [(i + 1) % 2 for i in range(len(PROMPTS))]
    assert token_ids(llm.generate(PROMPTS, GREEDY, priority=priority)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_logprobs_survive_chunking_batching_and_preemption():
    """Prompt and output log-probabilities (top 3) computed in 16-token chunks, in a batch that
    is preempted, equal those of each prompt alone in one step; each prompt token is scored
    once (the first is None) though preemption recomputes it."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    alone = [tiny().generate([p], params)[0] for p in PROMPTS]
    llm = tiny(kv_cache_tokens=192, max_num_batched_tokens=16)
    together = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, together):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                        b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()),
                                                                            abs=1e-5)
    assert_no_leaks(llm.engine)


def test_seeded_sample_is_independent_of_batch():
    """A seeded request samples the same tokens alone and beside rows with other top-k, top-p,
    temperatures, seeds and greedy rows."""
    params = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    others = [SamplingParams(max_tokens=30, temperature=t, top_k=k, top_p=p, seed=s,
                             ignore_eos=True)
              for t, k, p, s in [(1.0, 0, 1.0, None), (0.7, 5, 1.0, 3), (0, 0, 1.0, None),
                                 (1.3, 0, 0.5, None), (1.0, 50, 0.8, 9), (2.0, 0, 1.0, 1)]]
    solo = tiny().generate(["Hello"], params)[0].outputs[0].token_ids
    crowd = tiny(kv_cache_tokens=256).generate(PROMPTS + ["Hello"], others + [params])
    assert crowd[-1].outputs[0].token_ids == solo
    assert tiny().generate(["Hello"], SamplingParams(max_tokens=30, seed=8, ignore_eos=True)
                           )[0].outputs[0].token_ids != solo


def test_greedy_output_is_the_same_with_triton_attention(alone):
    llm = tiny(attention="triton", max_num_batched_tokens=24, block_size=8, device=DEVICE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS[:3], params)) == [a[:8] for a in alone[:3]]
    assert_no_leaks(llm.engine)


# ----------------------------------------------------------------------------- streaming

def test_deltas_add_up_to_the_whole_output():
    llm = LLM(device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=3)
    whole = llm.generate(["ROMEO:"], params)[0].outputs[0]
    llm.engine.add_request("ROMEO:", params, "r")
    deltas = run_to_end(llm.engine)["r"]
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == whole.token_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert len(deltas) == len(whole.token_ids) > 1


def test_a_request_that_does_not_stream_gets_its_samples_whole_once_each():
    """stream=False: step() returns each sample's output only when it finishes, and those
    outputs hold what the streamed deltas of the same request add up to: text, tokens,
    log-probabilities, prompt log-probabilities and finish reasons. (Each in an engine of
    its own: the same batches, so log-probabilities equal to the last bit.)"""
    params = SamplingParams(n=2, seed=5, max_tokens=12, logprobs=2, prompt_logprobs=1)
    outputs = {}
    for request_id, stream in (("streamed", True), ("whole", False)):
        engine = tiny().engine
        engine.add_request("ab", params, request_id, stream=stream)
        run_to_end(engine, outputs)
        assert_no_leaks(engine)
    assert len(outputs["streamed"]) > 2 and len(outputs["whole"]) == 2
    assert all(out.outputs[0].finish_reason == "length" for out in outputs["whole"])
    assert [out.finished for out in outputs["whole"]] == [False, True]
    streamed, whole = {}, {}
    for out in outputs["streamed"]:
        accumulate(streamed, out)
    for out in outputs["whole"]:
        accumulate(whole, out)
    assert whole["whole"].outputs == streamed["streamed"].outputs
    assert whole["whole"].prompt_logprobs == streamed["streamed"].prompt_logprobs


def test_stream_must_be_a_bool():
    with pytest.raises(ValueError, match="stream must be True or False, got 'no'"):
        tiny().engine.add_request("ab", GREEDY, stream="no")


def test_accumulate_leaves_every_delta_as_it_was():
    """The whole output extends lists of its own: the first delta's token ids and
    log-probabilities, and every later one's, are what the engine returned."""
    engine = tiny().engine
    engine.add_request("ab", SamplingParams(max_tokens=6, seed=2, logprobs=1), "r")
    deltas = run_to_end(engine)["r"]
    returned = [(d.outputs[0].text, list(d.outputs[0].token_ids), list(d.outputs[0].logprobs))
                for d in deltas]
    whole = {}
    for delta in deltas:
        accumulate(whole, delta)
    assert [(d.outputs[0].text, d.outputs[0].token_ids, d.outputs[0].logprobs)
            for d in deltas] == returned
    assert whole["r"].outputs[0].token_ids == [t for _, ids, _ in returned for t in ids]
    assert len(whole["r"].outputs[0].logprobs) == 6 and len(deltas) == 6


def test_streamed_text_is_always_a_prefix_of_the_final_text():
    """Stop strings that the text starts and abandons many times ("e", "th", "the ..."): text
    that could begin one is held back until it cannot, and what was streamed is never cut."""
    llm = LLM(device="cpu", dtype="float32")
    text = llm.generate(["ROMEO:"], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
                        )[0].outputs[0].text
    at = next(i for i in range(60, 140) if text.find(text[i:i + 6]) == i)  # its first place
    stops = ["e\nX", "the q", text[at:at + 6], text[100:103] + "\x00"]
    llm.engine.add_request("ROMEO:", SamplingParams(max_tokens=150, temperature=0, stop=stops,
                                                    ignore_eos=True), "r")
    streamed, final = "", None
    for delta in run_to_end(llm.engine)["r"]:
        streamed += delta.outputs[0].text
        final = delta.outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", text[at:at + 6])
    assert streamed == text[:at] and "the " in streamed  # "the q" started and abandoned


def test_detokenizer_holds_back_a_possible_stop_string_and_split_utf8():
    enc = byte_tokenizer()
    detok = Detokenizer(enc, ["the end"])
    pieces = []
    for byte in "us in th\u00e9 the x".encode():
        assert detok.append(enc.token_id(bytes([byte]))) is None
        pieces.append(detok.new_text(finished=False))
    # "th" might begin "the end"; then é's first byte waits for its second
    assert pieces[:10] == ["u", "s", " ", "i", "n", " ", "", "", "", "th\u00e9"]
    assert pieces[10:] == [" ", "", "", "", "", "the x"]  # "the " is held until the "x"
    assert "".join(pieces) + detok.new_text(finished=True) == "us in th\u00e9 the x"


def test_a_forked_detokenizer_goes_on_alone_from_the_same_text_and_split_utf8():
    """Beam search tries each candidate token on a fork of its beam's text: the fork carries
    the text and an unfinished character's bytes, and neither copy sees the other's tokens."""
    enc = byte_tokenizer()
    detok = Detokenizer(enc, ["the end"])
    first, second = "th\u00e9".encode()[-2:]
    for byte in b"the ":
        detok.append(enc.token_id(bytes([byte])))
    detok.append(enc.token_id(bytes([first])))  # half of "\u00e9"
    fork = detok.fork()
    assert fork.append(enc.token_id(bytes([second]))) is None
    for byte in b"end":
        assert detok.append(enc.token_id(bytes([byte]))) is None  # "the \ufffdend": no stop
    assert fork.new_text(finished=True) == "the \u00e9"
    detok.flush()
    assert detok.new_text(finished=True) == "the \ufffdend"


def test_detokenizer_adds_a_token_to_a_short_string_not_to_all_the_text():
    """A token's text is added to the newest characters only (at most RECENT_CHARS past the
    stop strings' overlap), however long the text grows unreturned, as a request that does
    not stream lets it; the text comes back whole, and a stop string is still found across
    the pieces it was kept in."""
    enc = byte_tokenizer()
    detok = Detokenizer(enc, ["the end"])
    text = "and so on, " * 400 + "the end and after"
    longest_recent = 0
    found = None
    for byte in text.encode():
        found = detok.append(enc.token_id(bytes([byte])))
        longest_recent = max(longest_recent, len(detok.recent))
        if found is not None:
            break
    assert found == "the end"
    assert longest_recent <= RECENT_CHARS + len("the end") - 1
    assert detok.new_text(finished=True) == "and so on, " * 400


def text_before_first_stop(text: str, stop: list[str]) -> str:
    """What a request that writes `text` a character a token returns: the text cut where the
    first stop string to be completed starts (of those completed by the same character, the
    one that starts first, then the longest)."""
    for end in range(1, len(text) + 1):
        found = [(text.find(s), -len(s)) for s in stop if s in text[:end]]
        if found:
            return text[:min(found)[0]]
    return text


def test_streamed_and_whole_text_are_the_text_before_the_first_stop_string():
    """Random texts of up to 300 characters (past RECENT_CHARS, so recent is settled) and
    random stop strings: the deltas of a request read every token, added up, and the text of
    one read only at its end, both equal text_before_first_stop."""
    rng = random.Random(0)
    enc = byte_tokenizer()
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 300)))
        stop = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 6)))
                for _ in range(rng.randrange(1, 3))]
        streamed = Detokenizer(enc, stop)
        whole = Detokenizer(enc, stop)
        deltas = []
        for char in text:
            token = enc.token_id(char.encode())
            found = streamed.append(token)
            assert whole.append(token) == found
            deltas.append(streamed.new_text(finished=found is not None))
            if found is not None:
                break
        expected = text_before_first_stop(text, stop)
        assert "".join(deltas) + streamed.new_text(finished=True) == expected, (text, stop)
        assert whole.new_text(finished=True) == expected, (text, stop)


def test_stop_string_ends_generation_and_is_cut():
    llm = LLM(device="cpu", dtype="float32")  # the shipped model writes ASCII
    full = llm.generate(["Hello"], GREEDY)[0].outputs[0]
    stop = full.text[10:13]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    assert out.outputs[0].text == full.text[:full.text.find(stop)]
    assert_no_leaks(llm.engine)


def test_stop_accepts_any_iterable_of_strings():
    llm = LLM(device="cpu", dtype="float32")
    full = llm.generate(["Hello"], GREEDY)[0].outputs[0].text
    params = SamplingParams(max_tokens=40, temperature=0, stop=(s for s in [full[10:13]]))
    assert llm.generate(["Hello"], params)[0].outputs[0].text == full[:full.find(full[10:13])]


class TextTokens:
    """A tokenizer whose token i is the text texts[i]: one token can complete two stop strings
    at once (the byte tokenizer adds one character at a time)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def token_bytes(self, token: int) -> bytes:
        return self.texts[token].encode()


@pytest.mark.parametrize("stop, expected", [
    (["ab", "bc"], "ab"), (["bc", "ab"], "ab"),      # "ab" starts first in "xabc"
    (["ab", "abc"], "abc"), (["abc", "ab"], "abc"),  # both start at 1: the longer
], ids=["earliest-listed-first", "earliest-listed-last", "longer-listed-last",
        "longer-listed-first"])
def test_stop_string_earliest_in_the_text_wins_then_the_longest(stop, expected):
    """Text "x", then one token "abc" that completes both stop strings: the one that starts
    first in the text ends it, whatever the list's order; of two starting at the same place,
    the longer. The text is cut where the winner starts."""
    detokenizer = Detokenizer(TextTokens(["x", "abc"]), stop)
    assert detokenizer.append(0) is None
    assert detokenizer.append(1) == expected
    assert detokenizer.new_text(finished=True) == "x"


def test_max_tokens_and_end_of_text_set_finish_reason():
    llm = tiny()
    assert llm.generate(["Hi"], GREEDY)[0].outputs[0].finish_reason == "length"
    eot = llm.engine.tokenizer.token_id(EOT)

    def always_end_of_text(hidden):
        return torch.nn.functional.one_hot(torch.full((len(hidden),), eot), 257).float()
    llm.engine.model.compute_logits = always_end_of_text
    out = llm.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [eot], "")


def test_completion_ending_inside_a_utf8_character_shows_its_bytes_as_u_fffd(monkeypatch):
    """The model writes "a" and then the first byte of "é" (2 bytes) and max_tokens ends it:
    the unfinished character is shown as U+FFFD, in the whole text and in the last delta."""
    llm = tiny()
    tokenizer = llm.engine.tokenizer
    tokens = [tokenizer.token_id(b) for b in (b"a", "é".encode()[:1])]
    written = iter(tokens)

    def compute_logits(hidden):
        return torch.nn.functional.one_hot(torch.tensor([next(written)]), 257).float()
    monkeypatch.setattr(llm.engine.model, "compute_logits", compute_logits)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    out = llm.generate(["Hi"], params)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == (tokens, "a\ufffd", "length")
    written = iter(tokens)
    llm.engine.add_request("Hi", params, "r")
    assert [d.outputs[0].text for d in run_to_end(llm.engine)["r"]] == ["a", "\ufffd"]


def test_a_step_synchronises_with_the_device_at_most_once(monkeypatch):
    engine = tiny(max_num_batched_tokens=64).engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9,
                                             seed=i if i % 2 else None, ignore_eos=True))

    # the CPU path reads lists
    def sync_free_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale):
        return q
    engine.model_runner.attention = sync_free_attention
    counter = CountSyncs()

    def counted(method: str):
        """Tensor.<method>, which also records that it read a tensor's values."""
        real = getattr(torch.Tensor, method)

        def read_values(tensor, *args, **kwargs):
            counter.syncs.append(method)
            return real(tensor, *args, **kwargs)
        return read_values
    for method in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, counted(method))
    for _ in range(6):  # prefill chunks, mixed steps and decodes
        with counter:
            engine.step()
        assert len(counter.syncs) <= 1, counter.syncs
        counter.syncs.clear()


# ----------------------------------------------------------------------------- bad input

BAD_PARAMS = {
    "temperature": [float("nan"), float("inf"), -1, "1", True],
    "top_p": [float("nan"), 0, 1.5, float("-inf")],
    "top_k": [True, 1.5, -2],
    "max_tokens": [True, 0, 2.0],
    "seed": [-2**63 - 1, 2**64, 1.5, True],
    "stop": [[""], [1], 5, ["x"] * 17, ["x" * 65], {"a": 1}, 0, False],
    "ignore_eos": ["yes"],
    "presence_penalty": [float("nan"), 2.5, True, "0.1"],
    "frequency_penalty": [-3, float("inf")],
    "repetition_penalty": [0, -1, float("nan"), True, 1e-40, 1e40],
    "min_p": [-0.1, 1.5, float("nan")],
    "min_tokens": [-1, 1.5, True],
    "stop_token_ids": [[-1], [True], 5, ["a"], list(range(257))],
    "include_stop_str_in_output": ["yes"],
    "logit_bias": [{1: 101}, {1: float("nan")}, {-1: 0}, {"a": 1}, [1], {True: 1},
                   dict.fromkeys(range(301), 1.0)],
}


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD_PARAMS.items() for v in vs])
def test_bad_sampling_param_is_rejected_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


# ----------------------------------------------------------------------------- n samples

def test_a_negative_seed_is_its_64_bit_twos_complement():
    """OpenAI's seeds are int64: -1 seeds as 2**64 - 1 does."""
    llm = tiny()
    negative = SamplingParams(max_tokens=8, seed=-1, ignore_eos=True)
    unsigned = SamplingParams(max_tokens=8, seed=2**64 - 1, ignore_eos=True)
    other = SamplingParams(max_tokens=8, seed=2**64 - 2, ignore_eos=True)
    want = token_ids(llm.generate(["x"], unsigned))
    assert token_ids(llm.generate(["x"], negative)) == want
    assert token_ids(llm.generate(["x"], other)) != want


def test_n_samples_are_one_request_each_equal_to_its_seed_alone():
    llm = tiny()
    params = SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True)
    together = llm.generate(["ab"], params)
    assert len(together) == 1 and [c.index for c in together[0].outputs] == [0, 1, 2]
    for completion in together[0].outputs:
        alone = dataclasses.replace(params, n=1, seed=5 + completion.index)
        assert completion.token_ids == llm.generate(["ab"], alone)[0].outputs[0].token_ids
    greedy = llm.generate(["ab"], SamplingParams(n=2, max_tokens=6, temperature=0))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


@pytest.mark.parametrize("prefix_caching, budget, computed",
                         [(True, 512, 40 + 8 + 8), (True, 24, 40 + 8 + 8), (False, 512, 3 * 40)],
                         ids=["cached", "cached-in-chunks", "uncached"])
def test_the_samples_of_a_request_compute_their_prompt_once(prefix_caching, budget, computed):
    """n = 3 on a 40-token prompt, blocks of 16: the first sample computes the prompt, the
    others take its two full blocks from the prefix cache and compute the last 8 tokens each;
    without the prefix cache each computes all 40. Each sample's tokens stay its seed's. At a
    budget of 24 the first sample's prompt takes two steps, and the others wait until its 32
    shareable tokens are computed, not merely its first 24."""
    llm = tiny(enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget)
    prompt = list(range(65, 105))  # 40 byte tokens
    params = SamplingParams(n=3, seed=5, max_tokens=1, ignore_eos=True)
    together = llm.generate([prompt], params)[0]
    assert llm.engine.stats.num_batched_tokens == computed
    for completion in together.outputs:
        alone = dataclasses.replace(params, n=1, seed=5 + completion.index)
        assert completion.token_ids == tiny().generate([prompt], alone)[0].outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_a_request_of_n_samples_says_finished_once_in_its_last_output():
    engine = tiny().engine
    request_id = engine.add_request("ab", SamplingParams(n=4, seed=1, max_tokens=12))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    assert {d.request_id for d in deltas} == {request_id}
    assert_no_leaks(engine)


def test_abort_ends_every_sample_of_a_request():
    engine = tiny().engine
    request_id = engine.add_request("ab", SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(request_id)
    last = engine.step()
    assert sorted(c.index for d in last for c in d.outputs) == [0, 1, 2]
    assert all(c.finish_reason == "abort" for d in last for c in d.outputs)
    assert [d.finished for d in last].count(True) == 1 and not engine.has_unfinished()
    assert_no_leaks(engine)


def test_abort_leaves_the_samples_that_already_finished_as_they_ended():
    """n = 3, one sample at a time (max_num_seqs 1): sample 0 finishes ("length") before
    the request is aborted; the abort ends samples 1 and 2 only, and sample 0 keeps its one
    final output."""
    engine = tiny(max_num_seqs=1).engine
    request_id = engine.add_request("ab", SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    deltas = []
    while not any(c.finish_reason for d in deltas for c in d.outputs):
        deltas += engine.step()
    engine.abort(request_id)
    last = engine.step()
    assert sorted((c.index, c.finish_reason) for d in last for c in d.outputs) == [
        (1, "abort"), (2, "abort")]
    whole = {}
    for delta in deltas + last:
        accumulate(whole, delta)
    assert [c.finish_reason for c in whole[request_id].outputs] == ["length", "abort", "abort"]
    assert [d.finished for d in deltas + last].count(True) == 1 and last[-1].finished
    assert_no_leaks(engine)


def test_a_request_id_that_names_another_requests_sample_is_refused():
    """Sample 1 of request "5" is sequence "1_5": a request "1_5" beside it is refused."""
    engine = tiny().engine
    engine.add_request("ab", SamplingParams(n=2, max_tokens=4), "5")
    with pytest.raises(ValueError, match="request id '1_5' is already in use"):
        engine.add_request("ab", SamplingParams(max_tokens=4), "1_5")


def test_the_trace_draws_a_request_of_n_samples_as_its_first_sample(capsys):
    llm = tiny(max_num_seqs=2)
    outputs = llm.generate(["ab", "cd"], SamplingParams(n=2, max_tokens=3, ignore_eos=True),
                           trace=True)
    rows = capsys.readouterr().err.splitlines()
    marks = [row.split(" | ")[1] for row in rows[1:3]]
    assert marks[0] == "oo*" and marks[1].startswith("...")  # two sequences at a time
    assert [len(o.outputs) for o in outputs] == [2, 2]


def test_cli_n_prints_each_sample_under_its_index(capsys):
    status, out, _ = nanoserve_main(capsys, "--preset", "tiny", "--device", "cpu", "--prompt",
                                    "ab", "--n", "2", "--max-tokens", "3", "--seed", "0")
    assert status == 0 and out.startswith("ab\n[0] ") and "\n[1] " in out


def test_piped_lines_refuse_n_above_one(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "ab", "n": 2}\n'))
    status, out, _ = nanoserve_main(capsys, "--preset", "tiny", "--device", "cpu", "--jsonl")
    assert status == 1 and "n is 2, but piped lines and the REPL print one completion" in out


BAD_CONFIGS = [("max_num_seqs", 1.5), ("max_num_seqs", 2**40), ("block_size", 16.0),
               ("max_num_batched_tokens", math.nan), ("kv_cache_tokens", True),
               ("max_model_len", 0), ("seed", -1),
               ("enable_chunked_prefill", 1), ("policy", "lifo"), ("dtype", "int8"),
               ("attention", "flash"), ("device", "foo"), ("preset", 3),
               ("device", f"cuda:{torch.cuda.device_count()}")]  # one past the last GPU


@pytest.mark.parametrize("name, value", BAD_CONFIGS)
def test_bad_engine_setting_is_rejected_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{"preset": "tiny", name: value})


@pytest.mark.parametrize("kv_cache_tokens", [16, None], ids=["given", "default"])
def test_block_larger_than_the_kv_cache_is_rejected(kv_cache_tokens):
    with pytest.raises(ValueError, match=r"block_size \(\d+ tokens\) is larger than the KV cache"):
        Engine(EngineConfig(preset="tiny", block_size=10**6 if kv_cache_tokens is None else 32,
                            kv_cache_tokens=kv_cache_tokens))


def test_max_model_len_is_capped_by_what_the_kv_cache_holds():
    """A context the cache cannot hold is never served: by default max_model_len is the
    model's context or the cache's capacity, the smaller; asked for past the cache, refused."""
    assert Engine(EngineConfig(preset="tiny", kv_cache_tokens=200)).max_model_len == 192
    assert Engine(EngineConfig(preset="tiny", kv_cache_tokens=4096)).max_model_len == 1024
    with pytest.raises(ValueError, match=r"max_model_len 300 does not fit in the KV cache "
                                         r"\(192 tokens\)"):
        Engine(EngineConfig(preset="tiny", kv_cache_tokens=200, max_model_len=300))


def test_kv_cache_too_big_for_memory_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot allocate a KV cache of 1000000000000 tokens"):
        Engine(EngineConfig(preset="tiny", kv_cache_tokens=10**12))


@pytest.mark.parametrize("make, message", [
    (lambda e: e.add_request("", SamplingParams()), "prompt is empty"),
    (lambda e: e.add_request("x" * 1000, SamplingParams(max_tokens=100)), "max_model_len is 512"),
    (lambda e: e.add_request([0, 300], SamplingParams()), "token ids"),
    (lambda e: e.add_request([0, True], SamplingParams()), "token ids"),
    (lambda e: e.add_request(b"hello", SamplingParams()), "got bytes"),
    (lambda e: e.add_request({"prompt_ids": [1]}, SamplingParams()), "got dict"),
    (lambda e: e.add_request({"prompt_token_ids": "hi"}, SamplingParams()), "got dict"),
    (lambda e: e.add_request({"prompt": [1, 2]}, SamplingParams()), "got dict"),
    (lambda e: e.add_request("hi", {"max_tokens": 5}), "SamplingParams"),
    (lambda e: e.add_request("hi", SamplingParams(), 7), "request_id"),
], ids=["empty", "too-long", "bad-token-id", "bool-token-id", "bytes",
        "unknown-dict", "text-as-token-ids", "token-ids-as-text", "params-dict",
        "int-request-id"])
def test_bad_request_is_rejected_and_engine_keeps_serving(alone, make, message):
    llm = tiny(kv_cache_tokens=512)
    with pytest.raises(ValueError, match=message):
        make(llm.engine)
    assert_no_leaks(llm.engine)
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == alone[:2]


def test_request_that_exactly_fills_the_context_runs_and_one_token_more_is_refused():
    """max_model_len 64: a 60-token prompt with max_tokens 4 is accepted and gets its 4
    tokens; with max_tokens 5 it is refused, the error giving the numbers."""
    llm = tiny(max_model_len=64)
    prompt = list(range(60))
    exact = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([prompt], exact)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    with pytest.raises(ValueError, match="prompt has 60 tokens and max_tokens is 5: 65 tokens; "
                                         "max_model_len is 64"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=5))
    assert_no_leaks(llm.engine)


def test_torch_attention_on_cuda_is_refused_with_the_reason():
    """The CPU attention path reads its metadata on the host every layer: on CUDA that is a
    wait for the GPU per layer, so it is refused by name (before CUDA is even looked for)."""
    with pytest.raises(ValueError, match="attention torch is the CPU path.*use triton"):
        EngineConfig(preset="tiny", device="cuda", attention="torch")


def test_unchunked_prompt_over_token_budget_is_rejected():
    with pytest.raises(ValueError, match="chunked prefill is off"):
        tiny(enable_chunked_prefill=False, max_num_batched_tokens=32
             ).engine.add_request("x" * 40, GREEDY)


def test_prompt_forms_give_the_same_output():
    llm = tiny()
    ids = llm.engine.tokenizer.encode("Hello there")
    forms = ["Hello there", ids, {"prompt": "Hello there"}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert llm.generate(ids, GREEDY)[0].prompt is None  # one prompt, of token ids, as in vLLM


@pytest.mark.parametrize("prompts", [None, 5, b"hello"])
def test_generate_rejects_what_is_not_a_prompt_or_a_list_of_them(prompts):
    with pytest.raises(ValueError, match="prompt"):
        tiny().generate(prompts, GREEDY)


def test_generate_rejects_whole_batch_if_one_prompt_is_bad():
    llm = tiny()
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], GREEDY)
    assert_no_leaks(llm.engine)


def test_generate_withdraws_its_batch_on_any_exception(alone):
    llm, calls = tiny(), []
    real_step = llm.engine.step

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()
    llm.engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    llm.engine.step = real_step
    assert_no_leaks(llm.engine)
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == alone[:2]


def test_generate_progress_line_counts_every_prompt_then_is_blanked(capsys):
    tiny().generate(PROMPTS, GREEDY, use_tqdm=True)
    *drawn, blank, after = progress_frames(capsys.readouterr().err)
    assert drawn[-1].startswith(f"{len(PROMPTS)}/{len(PROMPTS)} prompts, ")
    assert re.search(r"input \d+ tok/s, output \d+ tok/s", drawn[-1])
    assert (blank, after) == (" " * len(drawn[-1]), "")  # blanked, the cursor at column 0


def test_generate_progress_by_default_only_when_stderr_is_a_terminal(capsys, monkeypatch):
    llm = tiny()
    llm.generate(PROMPTS[:2], GREEDY)
    assert capsys.readouterr().err == ""  # capsys's stderr is not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # now it says it is
    llm.generate(PROMPTS[:2], GREEDY)
    assert "2/2 prompts, " in capsys.readouterr().err


def test_generate_progress_off_draws_nothing_even_at_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # capsys's stderr, as a terminal
    tiny().generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("use_tqdm", [1, 0, "yes"])
def test_generate_rejects_a_use_tqdm_that_is_not_none_or_a_bool(use_tqdm):
    with pytest.raises(ValueError, match="use_tqdm must be None, True or False"):
        tiny().generate(PROMPTS[:2], GREEDY, use_tqdm=use_tqdm)


def test_automatic_request_ids_never_collide_with_chosen_ones():
    """Nor with a chosen id that is an automatic request's sample's id ("1_4": sample 1 of
    request "4")."""
    engine = tiny().engine
    chosen = [engine.add_request("a", GREEDY, request_id=i) for i in ("0", "1", "3", "1_4")]
    automatic = [engine.add_request("b", dataclasses.replace(GREEDY, n=2)) for _ in range(3)]
    assert len(set(chosen + automatic)) == 7 and "4" not in automatic


def test_a_request_ends_when_its_last_sample_does_though_a_finished_samples_id_is_reused():
    """Sample 1 of request "X" is sequence "1_X"; once it finished, a caller may name a new
    request "1_X". X still ends (finished, then gone) with its own last sample."""
    engine = tiny().engine
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("x", dataclasses.replace(short, n=2), request_id="X")
    engine.seqs["X"].params = dataclasses.replace(short, max_tokens=12)  # sample 0 runs longer
    while "1_X" in engine.seqs:
        engine.step()
    engine.add_request("y", SamplingParams(max_tokens=20, ignore_eos=True), request_id="1_X")
    finished = [out.request_id for out in run_to_end(engine, steps=12).get("X", [])
                if out.finished]
    assert finished == ["X"] and "X" not in engine.requests
    run_to_end(engine)
    assert_no_leaks(engine)


def test_two_threads_adding_one_request_id_get_one_request_and_one_error():
    """The id's check and its request's insertion are one step under the engine's lock: the
    window between them, widened here, lets no second request of the same id in."""
    engine = tiny().engine
    validate = engine._validate

    def slow_validate(*args):
        validate(*args)
        time.sleep(0.05)

    engine._validate = slow_validate
    errors = []

    def add():
        try:
            engine.add_request("x", GREEDY, request_id="same")
        except ValueError as e:
            errors.append(str(e))
    threads = [threading.Thread(target=add) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == ["request id 'same' is already in use"]
    run_to_end(engine)
    assert_no_leaks(engine)


def test_has_unfinished_never_misses_an_abort_under_way():
    """An abort on another thread finishes its request, then queues its last output: a loop
    over has_unfinished() that asks in between (the gap widened here) still gets it."""
    engine = tiny().engine
    engine.add_request("x", SamplingParams(max_tokens=100, ignore_eos=True), request_id="a")
    engine.step()
    output = engine._output
    in_the_gap = threading.Event()

    def slow_output(seq):
        made = output(seq)
        in_the_gap.set()
        time.sleep(0.2)
        return made

    engine._output = slow_output
    aborting = threading.Thread(target=engine.abort, args=("a",))
    aborting.start()
    assert in_the_gap.wait(30)  # the request finished, its output not queued yet
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    aborting.join()
    assert [out.outputs[0].finish_reason for out in outputs if out.finished] == ["abort"]


def test_abort_of_a_running_request_with_penalties_frees_its_row_for_the_next():
    """abort() clears a penalised row's penalty state (kept by the input batch, made inside
    step()'s inference mode) from any thread; the row's next owner samples as on a fresh
    engine."""
    llm = tiny()
    engine = llm.engine
    penalised = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=2.0)
    engine.add_request("hello world", penalised, request_id="a")
    engine.step()
    engine.step()
    engine.abort("a")
    (aborted,) = engine.step()
    assert aborted.outputs[0].finish_reason == "abort" and aborted.finished
    assert_no_leaks(engine)
    pair = [("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
            ("other", dataclasses.replace(penalised, repetition_penalty=1.05))]
    prompts = [prompt for prompt, _ in pair]
    params = [params for _, params in pair]
    assert token_ids(llm.generate(prompts, params)) == token_ids(tiny().generate(prompts, params))


def test_outputs_and_params_are_copies(alone):
    """Changing a returned output, or the SamplingParams after add_request, changes nothing."""
    engine = tiny().engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request(PROMPTS[1], params, "r")
    params.max_tokens, params.temperature = 1, 2.0
    params.stop.append("e")
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            out.outputs[0].token_ids.append(999)
            out.prompt_token_ids.clear()
    assert tokens == alone[1]


# ----------------------------------------------------------------------------- failure, abort

@pytest.mark.allows_fallback
def test_a_failing_request_fails_alone(alone, monkeypatch):
    """The model raises whenever one request's token is in the batch: that request alone ends
    with finish_reason "error" and the error; the others' tokens do not change."""
    llm = tiny(max_num_batched_tokens=64)
    real_forward = llm.engine.model.forward

    def forward(input_ids, *args):
        if (input_ids == 256).any():  # <|endoftext|>: only the poisoned prompt has it
            raise RuntimeError("poisoned batch")
        return real_forward(input_ids, *args)
    monkeypatch.setattr(llm.engine.model, "forward", forward)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, str(i))
    engine.add_request("bad<|endoftext|>", GREEDY, "bad")
    deltas = run_to_end(engine)
    last = deltas["bad"][-1].outputs[0]
    assert (last.finish_reason, last.error, last.stop_reason) == (
        "error", "RuntimeError: poisoned batch", None)
    assert [whole_token_ids(deltas[str(i)])
            for i in range(len(PROMPTS))] == alone
    assert_no_leaks(engine)


@pytest.mark.allows_fallback
def test_a_failed_batch_is_counted_as_a_fallback_in_the_stats_and_the_metrics(monkeypatch):
    """The batch that holds a poisoned request fails and runs again one sequence at a time:
    one fallback, in EngineStats and /metrics (the outputs alone would not show it)."""
    engine = tiny().engine
    real_forward = engine.model.forward

    def forward(input_ids, *args):
        if (input_ids == 256).any():
            raise RuntimeError("poisoned batch")
        return real_forward(input_ids, *args)
    monkeypatch.setattr(engine.model, "forward", forward)
    engine.add_request("ab", GREEDY, "good")
    engine.add_request("bad<|endoftext|>", GREEDY, "bad")
    run_to_end(engine)
    assert engine.stats.num_fallbacks == 1
    with server_in_process(engine) as url:
        assert "nanoserve:num_fallbacks_total 1\n" in http(url, "/metrics")[1]


@pytest.mark.allows_fallback
def test_a_seeded_request_in_a_batch_that_failed_after_sampling_samples_as_alone(monkeypatch):
    """The batch fails after sampling (gathering a poisoned request's log-probabilities), so
    each sequence runs again alone: the seeded request's noise is a function of its seed and
    the output position (sampling.noise_seed), so its tokens are those it makes alone."""
    seeded = SamplingParams(max_tokens=8, seed=11, temperature=1.5, ignore_eos=True)
    want = tiny().generate(["ab"], seeded)[0].outputs[0].token_ids
    engine = tiny().engine
    real_gather = engine.model_runner._gather_logprobs

    def gather(batch, *args):
        if any(seq.request_id == "bad" for seq in batch.sample_seqs):
            raise RuntimeError("poisoned log-probabilities")
        return real_gather(batch, *args)
    monkeypatch.setattr(engine.model_runner, "_gather_logprobs", gather)
    engine.add_request("ab", seeded, "seeded")
    engine.add_request("cd", SamplingParams(max_tokens=8, logprobs=1), "bad")
    deltas = run_to_end(engine)
    assert deltas["bad"][-1].outputs[0].finish_reason == "error"
    assert whole_token_ids(deltas["seeded"]) == want
    assert_no_leaks(engine)


@pytest.mark.parametrize("method", ["append", "new_text"])
def test_a_request_failing_in_update_fails_alone(alone, method):
    engine = tiny().engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(p, GREEDY, str(i))
    deltas = run_to_end(engine, steps=1)
    setattr(engine.seqs["1"].detokenizer, method, lambda *args: 1 / 0)
    run_to_end(engine, deltas)
    last = deltas["1"][-1].outputs[0]
    assert (last.finish_reason, last.error) == ("error", "ZeroDivisionError: division by zero")
    assert [whole_token_ids(deltas[i]) for i in "02"] == \
        [alone[0], alone[2]]
    assert_no_leaks(engine)


def poison_the_device(engine: Engine) -> list:
    """Make every forward raise what CUDA raises after a device-side assert; returns the list
    of the forwards tried."""
    tried = []

    def forward(*args):
        tried.append(args)
        raise RuntimeError("CUDA error: device-side assert triggered")
    engine.model.forward = forward
    return tried


def test_a_device_error_ends_the_engine_at_once_without_retrying_each_request():
    """A CUDA error leaves the context unusable whichever request caused it: the engine stops
    with one EngineDeadError (not a retry that aborts the requests one by one), and every
    later step and generate() says so at once."""
    llm = tiny()
    for prompt in PROMPTS:
        llm.engine.add_request(prompt, GREEDY)
    tried = poison_the_device(llm.engine)
    with pytest.raises(nanoserve.EngineDeadError, match="device-side assert.*restarted"):
        llm.engine.step()
    assert len(tried) == 1
    with pytest.raises(nanoserve.EngineDeadError):
        llm.engine.step()
    with pytest.raises(nanoserve.EngineDeadError):
        llm.generate(["hi"], GREEDY)
    assert len(tried) == 1


def test_server_answers_every_open_request_when_the_engine_dies():
    """The server's engine dies under a streamed and a non-streamed request: each gets its
    500 at once (the stream as an error event, then [DONE]), the server stops, and run()
    raises the EngineDeadError (the command line then exits 1)."""
    engine = tiny().engine
    working_forward = engine.model.forward

    def forward(*args):  # the device works until both requests are in, then fails
        if len(engine.seqs) < 2:
            return working_forward(*args)
        raise RuntimeError("CUDA error: device-side assert triggered")
    engine.model.forward = forward
    server = Server(engine, ServerConfig(port=0))
    raised = []

    def run_server() -> None:
        try:
            asyncio.run(server.run())
        except nanoserve.EngineDeadError as e:
            raised.append(e)
    thread = threading.Thread(target=run_server)
    thread.start()
    assert server.started.wait(30)
    results = {}

    def client(stream: bool) -> None:
        results[stream] = http(server.url, "/v1/completions", dict(
            prompt="hi", max_tokens=900, ignore_eos=True, stream=stream))
    clients = [threading.Thread(target=client, args=(stream,)) for stream in (True, False)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(60)
    thread.join(30)
    assert not thread.is_alive() and len(raised) == 1
    status, body = results[False]
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "the device failed" in body["error"]["message"]
    status, text = results[True]
    events = parse_events(text)
    assert status == 200 and events[-2]["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("victim_state, blocks_freed, left_the_queue", [
    ("running", 1, 0),   # "A" holds one block of its own
    ("waiting", 0, 1),   # holds none, but leaves the waiting queue
])
def test_abort_frees_blocks_and_leaves_others_unchanged(alone, victim_state, blocks_freed,
                                                        left_the_queue):
    engine = tiny(max_num_seqs=len(PROMPTS) - 1, max_num_batched_tokens=64).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    deltas = run_to_end(engine, steps=3)
    victim = ids[0] if victim_state == "running" else ids[-1]
    assert engine.seqs[victim].status.value == victim_state
    free_before = engine.block_pool.num_free_blocks
    waiting_before = len(engine.scheduler.waiting)
    engine.abort(victim)
    assert engine.block_pool.num_free_blocks == free_before + blocks_freed
    assert len(engine.scheduler.waiting) == waiting_before - left_the_queue
    run_to_end(engine, deltas)
    last = deltas[victim][-1]
    assert last.finished and (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == (
        "abort", None)
    others = [i for i, request_id in enumerate(ids) if request_id != victim]
    assert [whole_token_ids(deltas[ids[i]]) for i in others] == \
        [alone[i] for i in others]
    assert_no_leaks(engine)


def test_abort_from_another_thread_waits_for_the_step_in_flight(alone, monkeypatch):
    """engine.abort, called from another thread while a step runs, waits for the step to end
    (the engine's lock), then frees the requests; the others' tokens do not change. The
    abort surely comes during the step: the model's forward starts the aborting thread and
    goes on only once that thread is about to call abort."""
    engine = tiny(max_num_batched_tokens=64).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    deltas = run_to_end(engine, steps=1)
    events = []
    calling_abort = threading.Event()

    def abort_odd_ones():
        calling_abort.set()
        for request_id in ids[1::2]:
            engine.abort(request_id)
            events.append(f"aborted {request_id}")
    aborter = threading.Thread(target=abort_odd_ones)
    real_forward = engine.model.forward
    real_record = engine.record

    def forward(*args):
        aborter.start()
        calling_abort.wait()
        return real_forward(*args)

    def record(*args):  # the step's last part
        real_record(*args)
        events.append("step ends")
    monkeypatch.setattr(engine.model, "forward", forward)
    monkeypatch.setattr(engine, "record", record)
    run_to_end(engine, deltas, steps=1)
    monkeypatch.undo()
    aborter.join()
    assert events == ["step ends"] + [f"aborted {i}" for i in ids[1::2]]
    run_to_end(engine, deltas)
    assert all(deltas[i][-1].outputs[0].finish_reason == "abort" for i in ids[1::2])
    assert [whole_token_ids(deltas[i]) for i in ids[::2]] == alone[::2]
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- speculation

class WrongProposer:
    """Drafts one token that the greedy model never takes next: the token after the one it
    does take (want: the prompt's greedy output alone)."""

    def __init__(self, want: list[int]):
        self.want = want

    def propose(self, wanted: dict) -> None:
        for seq in wanted:
            seq.spec_token_ids = [(self.want[seq.num_output_tokens] + 1) % 256]

    def remove(self, seq) -> None:
        pass


def test_the_speculator_learns_how_many_drafts_were_accepted_not_the_bonus_token():
    """Every draft rejected: the engine tells the speculator none was accepted (the token
    the step emits anyway is no accepted draft), so the sequence backs off (1, 2, 4, .. steps)
    and verifies drafts at 6 of its 40 decodes, not at every one."""
    want = token_ids(tiny().generate(["ab"], GREEDY))[0]
    llm = tiny(speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    llm.engine.speculator.proposer = WrongProposer(want)
    assert token_ids(llm.generate(["ab"], GREEDY))[0] == want
    stats = llm.engine.stats
    assert stats.spec_decode_num_accepted_tokens == 0
    assert stats.spec_decode_num_drafts == 6


# ----------------------------------------------------------------------------- packaging

ROOT = os.path.dirname(os.path.abspath(__file__))


def third_party_imports() -> set[str]:
    """The top-level names of the modules the project's files import that are neither the
    standard library's nor the project's own."""
    paths = [name for name in os.listdir(ROOT) if name.endswith(".py")]
    local = {name[:-3] for name in paths}
    found = set()
    for name in paths:
        with open(os.path.join(ROOT, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - local


def test_every_module_imported_is_a_declared_dependency():
    """What a file imports is in requirements.txt, and (pytest aside, which only the tests
    use) in pyproject.toml's dependencies: nothing arrives only through another package."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        required = {re.split(r"[=<>\s]", line)[0] for line in f if line.strip()}
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        declared = re.search(r"^dependencies = \[(.*)\]$", f.read(), re.M).group(1)
    dependencies = re.findall(r'"([^"]+)"', declared)
    installed = {re.split(r"[=<>]", dependency)[0] for dependency in dependencies}
    imported = third_party_imports()
    assert imported <= required, imported - required
    assert imported - {"pytest"} <= installed, imported - installed


def test_pyproject_installs_every_module_the_code_imports():
    """`pip install .` installs py-modules only: a module missing from the list (model_runner
    was) leaves the installed `nanoserve` command failing on its import."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        listed = re.search(r"^py-modules = \[(.*?)\]$", f.read(), re.M | re.S).group(1)
    installed = set(re.findall(r'"([^"]+)"', listed))
    modules = {name[:-3] for name in os.listdir(ROOT)
               if name.endswith(".py") and not name.startswith(("test_", "conftest"))}
    assert modules == installed, modules ^ installed


@pytest.mark.parametrize("priority", [True, 1.5, "0", 2**31, -2**31])
def test_a_bad_priority_is_refused_naming_the_field(priority):
    llm = tiny()
    with pytest.raises(ValueError, match="priority must be an integer in "
                                         r"\[-2147483647, 2147483647\], got"):
        llm.engine.add_request("x", GREEDY, priority=priority)
    with pytest.raises(ValueError, match="priority must be a list of one integer a prompt"):
        llm.generate(["a", "b"], GREEDY, priority=[priority])
    assert_no_leaks(llm.engine)
