"""Tensor parallelism (tensor_parallel.py) on the CPU: N = 2 ranks (gloo) give N = 1's greedy
tokens, and its log-probabilities within float32 rounding (the all-reduce sums the partial
products in another order), for GPT-2 (the shipped model: biases, a tied head, an odd
vocabulary), Llama with K/V heads split and replicated; the LM head cut by vocabulary, its
logits gathered for every caller (sampling, prompt log-probabilities, drafts); decode graphs
on every rank (fake_cuda); under preemption and the prefix cache; a killed worker ends the
engine; no worker outlives its engine; bad sizes refused.
These tests start processes (forked: a fraction of a second each): few engines, few tokens."""
import contextlib
import multiprocessing
import os
import signal
import time

import pytest

import model_runner
from conftest import (GREEDY, PROMPTS, assert_no_leaks, fixture_llm, http, start_server, stop,
                      tiny, token_ids)
from lora import LoRARequest, save_random_lora
from model import GPTConfig
from nanoserve import LLM, EngineConfig, EngineDeadError
from sampling import SamplingParams
from tensor_parallel import check_tensor_parallel

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
SHIPPED = dict(device="cpu", dtype="float32", kv_cache_tokens=1024)
LOGPROB_TOLERANCE = 1e-4  # float32 sums of 2 partial products against 1 whole one
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def assert_same_outputs(one: list, two: list) -> None:
    """Greedy tokens equal; each token's log-probability and its top 2 within tolerance."""
    assert token_ids(two) == token_ids(one)
    for a, b in zip(one, two):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y)
            assert list(y.values()) == pytest.approx(list(x.values()), abs=LOGPROB_TOLERANCE)


def worker_pids(llm: LLM) -> list[int]:
    return [process.pid for process in llm.engine.tensor_parallel.processes]


@pytest.fixture(scope="module")
def shipped_tp():
    """The shipped GPT-2 at N = 2, with a cache small enough to preempt PROMPTS."""
    llm = LLM(tensor_parallel_size=2, **SHIPPED | dict(kv_cache_tokens=192,
                                                       max_num_batched_tokens=64))
    yield llm
    llm.close()


def test_shipped_model_at_two_ranks_matches_one(shipped_tp):
    """GPT-2: biases on every projection (o_proj's and down_proj's added once), a tied head,
    a vocabulary of 257 (129 and 128 rows a rank)."""
    prompts = PROMPTS[:3]
    assert_same_outputs(LLM(**SHIPPED).generate(prompts, PARAMS),
                        shipped_tp.generate(prompts, PARAMS))
    assert_no_leaks(shipped_tp.engine)


def test_preemption_and_prefix_cache_at_two_ranks(shipped_tp):
    """Every prompt twice (the second time from the prefix cache) in a cache that preempts:
    the workers' caches follow rank 0's blocks, so the tokens are N = 1's."""
    engine = shipped_tp.engine
    prompts = PROMPTS + PROMPTS
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    one = LLM(**SHIPPED).generate(prompts, greedy)
    preemptions = engine.scheduler.num_preemptions
    cached = engine.stats.num_cached_tokens
    assert token_ids(shipped_tp.generate(prompts, greedy)) == token_ids(one)
    assert engine.scheduler.num_preemptions > preemptions
    assert engine.stats.num_cached_tokens > cached
    assert_no_leaks(engine)


def test_swapped_preemption_at_two_ranks():
    """preemption_mode swap: each worker copies its heads' blocks out and back in as rank 0
    does, so a sequence resumed from host memory continues as at N = 1."""
    tight = dict(kv_cache_tokens=192, max_num_batched_tokens=64, preemption_mode="swap")
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    expected = token_ids(tiny(**tight).generate(PROMPTS, greedy))
    llm = tiny(tensor_parallel_size=2, **tight)
    try:
        assert token_ids(llm.generate(PROMPTS, greedy)) == expected
        assert llm.engine.scheduler.num_swapped_out > 0
        assert_no_leaks(llm.engine)
    finally:
        llm.close()


def test_each_rank_holds_its_vocabulary_rows_of_the_lm_head(shipped_tp):
    """GPT-2's tied head at N = 2: rank 0 holds 129 of the 257 rows, the embedding's own slice
    (one tensor), not the whole head (the logits' equality with N = 1's: the test above)."""
    model = shipped_tp.engine.model
    assert model.lm_head.weight.shape == (129, 192)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_prompt_logprobs_and_drafts_at_two_ranks_match_one(monkeypatch):
    """The LM head's other callers, each gathered on every rank: prompt log-probabilities made
    a few positions at a time (PROMPT_LOGPROBS_CHUNK, rank 0's alone) and n-gram drafts
    verified at every sampling position; the tiny preset's 257 rows, the last rank's padded."""
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_CHUNK", 3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    prompts = ["ROMEO: " * 3, "0123456789" * 2]
    ngram = dict(speculative_config=NGRAM)
    expected = tiny(**ngram).generate(prompts, params)
    two = tiny(tensor_parallel_size=2, **ngram)
    try:
        got = two.generate(prompts, params)
        assert two.engine.stats.spec_decode_num_accepted_tokens > 0
    finally:
        two.close()
    assert_same_outputs(expected, got)
    for a, b in zip(expected, got):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x) == list(y)
            assert list(y.values()) == pytest.approx(list(x.values()), abs=LOGPROB_TOLERANCE)


def test_cuda_graphs_at_two_ranks_match_one(fake_cuda):
    """Rank 0 on "CUDA" (conftest's fake_cuda) captures decode graphs of 1, 2, 4 and 8; the
    worker (a CPU process) makes its padded runs of the same sizes, and each decode step
    replays on both, rank 0 sending the padded size and rows instead of a forward: N = 1's
    tokens."""
    prompts = PROMPTS[:5]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = token_ids(tiny(max_num_seqs=8).generate(prompts, greedy))
    two = tiny(tensor_parallel_size=2, max_num_seqs=8)
    try:
        assert sorted(two.engine.model_runner.graphs) == [1, 2, 4, 8]
        assert token_ids(two.generate(prompts, greedy)) == expected
        assert two.engine.tensor_parallel.comm.stats.num_steps == 1  # the prefill alone
        assert_no_leaks(two.engine)
    finally:
        two.close()


@pytest.mark.parametrize("name", ["llama3-tied", "llama-untied"])
def test_grouped_query_llama_at_two_ranks_matches_one(name, tmp_path):
    """llama3-tied: 4 query heads on 2 K/V heads, one K/V head a rank (split); llama-untied:
    4 on 1, which both ranks hold (replicated, as vLLM does), and an untied head, cut by its
    257 rows (129 and 128) apart from the embedding."""
    prompts = PROMPTS[:3]
    one = fixture_llm(name, tmp_path).generate(prompts, PARAMS)
    two = fixture_llm(name, tmp_path, tensor_parallel_size=2)
    try:
        assert_same_outputs(one, two.generate(prompts, PARAMS))
    finally:
        two.close()


def test_lora_adapters_at_two_ranks_match_one(tmp_path):
    """llama-tiny with an adapter on every projection, beside a base request: each part's B
    rows (q, k, v, gate, up) or A columns (o_proj, down_proj) a rank; the workers load the
    slot rank 0 loads and read each step's token slots."""
    one = tiny(preset="llama-tiny", enable_lora=True)
    save_random_lora(str(tmp_path), one.engine.model, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"], r=8)
    adapters = [LoRARequest("a", 1, str(tmp_path)), None, LoRARequest("a", 1, str(tmp_path))]
    prompts = PROMPTS[:3]
    expected = one.generate(prompts, PARAMS, lora_request=adapters)
    two = tiny(preset="llama-tiny", enable_lora=True, tensor_parallel_size=2)
    try:
        assert_same_outputs(expected, two.generate(prompts, PARAMS, lora_request=adapters))
    finally:
        two.close()
    assert token_ids(expected)[0] != token_ids(one.generate(prompts[:1], PARAMS))[0]


@pytest.mark.parametrize("quantization", [dict(quantization="int8"),
                                          dict(quantization="fp8", kv_cache_dtype="fp8")])
def test_quantized_model_at_two_ranks_matches_one(quantization):
    """Quantized after the cut, each q and scale a slice of N = 1's (a row-parallel part's scale
    from its whole row's max, read before the cut), and the workers' caches in kv_cache_dtype:
    N = 1's tokens and log-probabilities within float32 rounding (a worker in full precision,
    or scales from its slice alone, errs by 0.005 to 0.04)."""
    prompts = PROMPTS[:3]
    expected = tiny(preset="llama-tiny", **quantization).generate(prompts, PARAMS)
    two = tiny(preset="llama-tiny", tensor_parallel_size=2, **quantization)
    try:
        got = two.generate(prompts, PARAMS)
    finally:
        two.close()
    assert_same_outputs(expected, got)


def test_killed_worker_ends_the_engine_within_seconds():
    llm = tiny(tensor_parallel_size=2)
    os.kill(worker_pids(llm)[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1 .* died"):
        llm.generate(["A"], GREEDY)
    assert time.monotonic() - start < 10
    llm.close()


@pytest.mark.allows_fallback
def test_a_forward_failed_on_rank_0_alone_ends_the_engine(monkeypatch):
    """Rank 0's forward raises after its first layer: the worker waits in the next all-reduce,
    out of step. The next forward stops the engine (no hang, no mismatched all-reduces)."""
    llm = tiny(tensor_parallel_size=2)
    block = llm.engine.model.model.layers[1]
    monkeypatch.setattr(block, "forward", broken_forward)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="out of step"):
        llm.generate(["A", "B"], GREEDY)
    assert time.monotonic() - start < 10
    pids = worker_pids(llm)
    llm.close()
    assert not [pid for pid in pids if pid_running(pid)]


def broken_forward(*_args):
    raise RuntimeError("a bug on rank 0")


def test_no_worker_outlives_its_engine():
    """close() stops the workers; so does dropping the last reference to an engine never
    closed (at once: no reference cycle holds the workers' handle), or one that failed to
    start after its workers had."""
    closed = tiny(tensor_parallel_size=2)
    pids = worker_pids(closed)
    closed.close()
    dropped = tiny(tensor_parallel_size=2)
    pids += worker_pids(dropped)
    del dropped
    assert not [pid for pid in pids if pid_running(pid)]
    running = set(multiprocessing.active_children())  # the module's engine's, say
    with pytest.raises(ValueError, match="max_model_len 4096 > the context 1024"):
        tiny(tensor_parallel_size=2, max_model_len=4096)
    assert set(multiprocessing.active_children()) <= running


def test_no_process_outlives_a_killed_server():
    """A server at N = 2 killed (SIGKILL: no exit handler runs): its worker, the fork server
    and multiprocessing's resource tracker see its end and exit within seconds."""
    proc, url = start_server("--tensor-parallel-size", "2")
    status, _ = http(url, "/v1/completions", dict(model="tiny", prompt="Hi", max_tokens=3))
    assert status == 200
    descendants = descendants_of(proc.pid)
    assert len(descendants) >= 2  # the fork server and the worker at least
    stop(proc)
    deadline = time.monotonic() + 15
    while [pid for pid in descendants if pid_running(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in descendants if pid_running(pid)]


def pid_running(pid: int) -> bool:
    """Whether a process of that id runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants_of(pid: int) -> list[int]:
    """Every process below pid, from /proc's parent ids."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2", None])
def test_tensor_parallel_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=size)


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        tiny(tensor_parallel_size=3)  # refused before any worker starts
    with pytest.raises(ValueError, match="neither divides the other"):
        check_tensor_parallel(GPTConfig(n_head=12, n_kv_head=3, n_embd=384), 2)
