"""sampling.py's guarantees: greedy, temperature, top-k, top-p, min-p, penalties, logit_bias,
stops and min_tokens, and the checkpoint's generation_config.json defaults.
"""
import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import cli
import model as M
import sampling
from conftest import (NEAR_TIE, PROMPTS, assert_no_leaks, chat_checkpoint, checkpoint_llm, http,
                      nanoserve_main, server_in_process, tiny, token_ids)
from input_batch import InputBatch
from nanoserve import Engine
from sampling import (Penalties, SamplingParams, SamplingTensors, apply_penalties,
                      apply_top_k_top_p, invalid_logits, noise_seed, sample,
                      sampling_tensors)
from tokenizer import EOT


# ----------------------------------------------------------------------------- sampling

def test_logits_are_computed_in_fp32_even_from_bf16_weights():
    """In bf16, the logits come from an fp32 product of the bf16 values, not a bf16 product
    cast afterwards: GPT-2's logits are tens in size, where bf16's rounding moves them by
    tenths (the test checks that the difference is there to be made)."""
    model = M.GPT(M.PRESETS["tiny"]).to(torch.bfloat16)
    hidden = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 4)
    hidden = hidden.to(torch.bfloat16)
    fp32_product = hidden.float() @ model.lm_head.weight.float().T
    assert torch.equal(model.compute_logits(hidden), fp32_product)
    bf16_product = torch.nn.functional.linear(hidden, model.lm_head.weight)
    assert not torch.equal(bf16_product.float(), fp32_product)


def test_top_k_1_is_greedy(alone):
    params = SamplingParams(max_tokens=40, temperature=5.0, top_k=1, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS, params)) == alone


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-45], ids=["1e-6", "1e-30", "denormal"])
def test_tiny_temperature_is_greedy(alone, temperature):
    params = SamplingParams(max_tokens=40, temperature=temperature, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS[:2], params)) == alone[:2]


def test_top_k_past_the_vocabulary_keeps_every_token():
    """A top_k larger than the vocabulary (here than an int64) samples as top_k off."""
    off = SamplingParams(max_tokens=12, seed=3, ignore_eos=True)
    huge = dataclasses.replace(off, top_k=2**64 - 1)
    llm = tiny()
    assert token_ids(llm.generate(PROMPTS[:2], huge)) == token_ids(llm.generate(PROMPTS[:2], off))


def test_a_temperature_past_float32_samples_as_float32s_largest():
    """1e308 is inf in float32, and a token banned before min_tokens (-inf) would turn NaN
    there: every row would sample token 0. It samples as float32's largest temperature."""
    hottest = SamplingParams(max_tokens=12, seed=3, min_tokens=12, temperature=sampling.FLOAT32_MAX)
    past = dataclasses.replace(hottest, temperature=1e308)
    llm = tiny()
    want = token_ids(llm.generate(PROMPTS[:2], hottest))
    assert token_ids(llm.generate(PROMPTS[:2], past)) == want
    assert all(len(set(tokens)) > 1 for tokens in want)


def test_repeated_stop_token_ids_are_kept_once():
    assert SamplingParams(stop_token_ids=[5, 7] * 500).stop_token_ids == [5, 7]


def test_top_p_too_small_to_round_keeps_the_most_likely_token(alone):
    params = SamplingParams(max_tokens=40, top_p=1e-45, seed=0, ignore_eos=True)
    assert token_ids(tiny().generate(PROMPTS[:2], params)) == alone[:2]


@pytest.mark.parametrize("max_top_k", [None, 4], ids=["sort", "topk"])
def test_top_k_and_top_p_mask_each_row_by_its_own_params(max_top_k):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    masked = apply_top_k_top_p(logits, torch.tensor([4, 4, 2, 4]),
                               torch.tensor([0.6, 0.45, 1.0, 1.0]), max_top_k)
    kept = [torch.isfinite(row).nonzero().flatten().tolist() for row in masked]
    # top_p 0.6: 0.5 < 0.6, so token 1 (which crosses 0.6) stays; top_p 0.45: token 0 alone
    assert kept == [[0, 1], [0], [0, 1], [0, 1, 2, 3]]
    assert torch.equal(masked[3], logits[3])  # top_k = vocab and top_p = 1: untouched


SAMPLING_VOCAB = 2048  # past sampling.MAX_TOP_K_CANDIDATES: a top_k may or may not take topk


def rows_to_sample(params: list[SamplingParams]) -> list[SimpleNamespace]:
    """What sampling_tensors() reads of a Sequence: its params, row i's seeded with i, and its
    output tokens so far (none: each row samples output position 0)."""
    return [SimpleNamespace(params=dataclasses.replace(p, seed=i), num_output_tokens=0)
            for i, p in enumerate(params)]


def random_logits(n: int, seed: int) -> torch.Tensor:
    """(n, SAMPLING_VOCAB) logits, about 3 x N(0, 1), without two equal in a row (at a tie,
    which of the two the sort puts first is arbitrary, and top-p may keep either)."""
    g = torch.Generator().manual_seed(seed)
    ascending = torch.randn(n, SAMPLING_VOCAB, generator=g).sort(dim=-1).values * 3
    ascending += torch.arange(SAMPLING_VOCAB) * 1e-3  # steps of 1e-3 at least
    return ascending.gather(1, torch.rand(n, SAMPLING_VOCAB, generator=g).argsort(dim=-1))


def mixed_params(n: int) -> list[SamplingParams]:
    """Rows with top_k 1 to 64, top_p in [0.05, 1] or 1, min_p on some, and some rows with
    neither top-k nor top-p: the fast path's every case."""
    g = torch.Generator().manual_seed(1)
    top_k = torch.randint(1, 65, (n,), generator=g).tolist()
    top_p = torch.rand(n, generator=g).clamp(min=0.05).tolist()
    return [SamplingParams(temperature=0.7, top_k=0 if i % 7 == 1 else top_k[i],
                           top_p=1.0 if i % 7 == 1 or i % 4 == 0 else top_p[i],
                           min_p=0.02 if i % 5 == 2 else 0.0) for i in range(n)]


def test_a_small_top_k_takes_the_topk_of_its_rows_and_masks_and_samples_as_the_sort():
    """Every row that uses top-k or top-p has top_k <= MAX_TOP_K_CANDIDATES: top-k and top-p
    work on the topk of the largest, and keep exactly the logits the sort of the vocabulary
    keeps (-inf bans, ties with the k-th largest and rows without either included), and
    seeded rows sample exactly the same tokens."""
    n = 300
    params = mixed_params(n)
    logits = random_logits(n, seed=0)
    logits[3::9, ::2] = float("-inf")  # banned tokens: some rows have fewer finite than top_k
    params[0] = SamplingParams(temperature=0.7, top_k=5)
    row = logits[0]
    top = row.topk(6).indices
    row[top[5]] = row[top[4]]  # a tie with the 5th largest: both stay
    fast = sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0], "cpu")
    assert fast.max_top_k == 64
    masked = apply_top_k_top_p(logits, fast.top_k, fast.top_p, fast.max_top_k)
    assert torch.equal(masked, apply_top_k_top_p(logits, fast.top_k, fast.top_p))
    assert torch.isfinite(masked[0]).sum() == 6
    full = dataclasses.replace(sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0],
                                                "cpu"), max_top_k=None)
    tokens = sample(logits, fast, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, sample(logits, full, torch.Generator().manual_seed(0)))


def test_a_small_top_k_sorts_no_row_of_the_vocabulary(monkeypatch):
    """top_k 20 (Qwen's default) beside rows without top-k or top-p, and a greedy row (whose
    draw is thrown away) with top-p alone: no sort of (n, vocab); a row that draws with top-p
    alone, or a top_k past MAX_TOP_K_CANDIDATES, needs the sort."""
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted the vocabulary")
    logits = random_logits(4, seed=0)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    params = [SamplingParams(top_k=20, top_p=0.9), SamplingParams(), SamplingParams(top_k=7),
              SamplingParams(temperature=0, top_p=0.9)]
    t = sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0], "cpu")
    assert t.max_top_k == 20
    sample(logits, t, torch.Generator().manual_seed(0))
    for needs_sort in (SamplingParams(top_p=0.9), SamplingParams(top_k=1025)):
        t = sampling_tensors(rows_to_sample(params + [needs_sort]), SAMPLING_VOCAB, [0], "cpu")
        assert t.any_top_k_top_p and t.max_top_k is None


def test_a_seeded_row_samples_the_gumbel_max_of_its_own_uniforms():
    """A seeded row's token is argmax(softmax(logits / T) / E), E = -log U, U the uniforms over
    the vocabulary of a generator seeded with noise_seed(its seed, its output position): what
    its seed gives does not change with the code."""
    n = 8
    logits = random_logits(n, seed=2)
    params = [SamplingParams(temperature=0.9) for _ in range(n)]
    t = sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0], "cpu")
    tokens = sample(logits, t, torch.Generator().manual_seed(0))
    for i, token in enumerate(tokens.tolist()):
        generator = torch.Generator().manual_seed(noise_seed(i, 0))
        uniform = torch.empty(SAMPLING_VOCAB).uniform_(generator=generator)
        probs = (logits[i] / 0.9).softmax(dim=-1)
        assert token == (probs / -uniform.log()).argmax()


def test_a_seeded_row_draws_by_its_seed_and_output_position_alone():
    """A seeded row's noise is a function of its seed and the output position it samples:
    position 5 draws the same token first, after positions 0 to 4 drew, and beside other rows;
    other positions draw from other noise (not all the same token); the seeds s and s + 1 of
    a request's samples are not the same noise shifted by a position."""
    logits = random_logits(3, seed=4)
    logits[2] = logits[0]

    def draw_at(positions: list[int], seed: int = 7) -> list[int]:
        rows = [SimpleNamespace(params=SamplingParams(seed=seed), num_output_tokens=position)
                for position in positions]
        t = sampling_tensors(rows, SAMPLING_VOCAB, [0], "cpu")
        return sample(logits[:len(rows)], t, torch.Generator().manual_seed(0)).tolist()

    first = draw_at([5])
    tokens = [draw_at([position])[0] for position in range(8)]
    assert draw_at([5]) == first == tokens[5:6] == draw_at([2, 1, 5])[2:]
    assert len(set(tokens)) > 1
    assert [draw_at([position], seed=8)[0] for position in range(7)] != tokens[1:]


def test_greedy_rows_beside_sampled_rows_take_their_argmax():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0),
              SamplingParams(temperature=0), SamplingParams(temperature=5.0)]
    logits = random_logits(4, seed=3)
    t = sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0], "cpu")
    tokens = sample(logits, t, torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1)
    assert tokens[0::2].tolist() == argmax[0::2].tolist()
    assert tokens[1::2].tolist() != argmax[1::2].tolist()  # hot: the sampled rows draw


def test_invalid_logits_are_rows_with_a_nan_or_inf():
    """NaN or +inf (an fp16 overflow) anywhere in a row: that row alone; -inf is a token ruled
    out, not an error."""
    logits = random_logits(5, seed=4)
    logits[1, 7] = float("nan")
    logits[2, 100] = float("inf")
    logits[3, :50] = float("-inf")
    assert invalid_logits(logits).tolist() == [False, True, True, False, False]


def test_a_row_of_nan_logits_leaves_the_other_rows_tokens_as_they_were():
    """min_p, top-k and top-p each reduce over a row: over its own alone."""
    n = 64
    params = [dataclasses.replace(p, min_p=0.3 * (i % 2)) for i, p in enumerate(mixed_params(n))]
    logits = random_logits(n, seed=5)
    want = sample(logits, sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0], "cpu"),
                  torch.Generator().manual_seed(0))
    nan_row = 2
    logits[nan_row, ::3] = float("nan")
    got = sample(logits, sampling_tensors(rows_to_sample(params), SAMPLING_VOCAB, [0], "cpu"),
                 torch.Generator().manual_seed(0))
    others = torch.arange(n) != nan_row
    assert torch.equal(got[others], want[others])


def test_sampling_draws_from_the_top_p_nucleus_of_the_tempered_distribution():
    """Temperature first, then top-p, then the Gumbel-max draw: frequencies over 4000 seeded
    draws follow softmax(logits / T) cut to its nucleus and renormalised.

    The order matters here: tempered by T = 2, the probabilities [0.5, 0.3, 0.15, 0.05] become
    [0.38, 0.29, 0.21, 0.12], whose top-p 0.7 nucleus has 3 tokens; top-p on the raw ones
    keeps 2, and token 2's frequency (0.24 expected) would be 0."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])  # most likely first
    temperature = 2.0
    top_p = 0.7
    tempered = (probs.log() / temperature).softmax(-1)
    more_likely = tempered.cumsum(0) - tempered  # the mass of the tokens above each
    nucleus = torch.where(more_likely < top_p, tempered, 0)  # the token crossing top_p stays
    expected = nucleus / nucleus.sum()
    n = 4000
    t = SamplingTensors(temperature=torch.full((n,), temperature), top_k=torch.full((n,), 4),
                        top_p=torch.full((n,), top_p), greedy=torch.zeros(n, dtype=torch.bool),
                        seeds=[None] * n, positions=[0] * n, all_greedy=False, any_top_k_top_p=True)
    tokens = sample(probs.log().expand(n, 4), t, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4) / n
    assert (freq - expected).abs().max() < 0.025, (freq, expected)


def test_min_p_applies_to_the_tempered_distribution():
    """min_p after temperature, as vLLM: tempered by T = 2, [0.5, 0.3, 0.15, 0.05] becomes
    about [0.38, 0.29, 0.21, 0.12]; min_p 0.35 drops what is below 0.35 x 0.38 = 0.13 (token
    3 alone), and the draws follow about [0.43, 0.33, 0.24, 0]. Applied before temperature
    it would drop tokens 2 and 3 (below 0.35 x 0.5), drawing about [0.55, 0.45, 0, 0]."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    temperature = 2.0
    min_p = 0.35
    tempered = (probs.log() / temperature).softmax(-1)
    kept = torch.where(tempered >= min_p * tempered.max(), tempered, 0)
    expected = kept / kept.sum()
    n = 4000
    t = SamplingTensors(temperature=torch.full((n,), temperature), top_k=torch.full((n,), 4),
                        top_p=torch.ones(n), greedy=torch.zeros(n, dtype=torch.bool),
                        seeds=[None] * n, positions=[0] * n, all_greedy=False,
                        any_top_k_top_p=False,
                        min_p=torch.full((n,), min_p))
    tokens = sample(probs.log().expand(n, 4), t, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4) / n
    assert (freq - expected).abs().max() < 0.025, (freq, expected)


# ----------------------------------------------------------------------------- penalties and stops

PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6)


def penalized_reference(model: M.GPT, prompt: list[int], num_tokens: int, presence: float,
                        frequency: float, repetition: float) -> tuple[list[int], int]:
    """Greedy decoding from dense forwards with the penalties applied as their definitions say
    (repetition over prompt and output, then frequency and presence over the output); the
    tokens, and how many of them were decided by more than NEAR_TIE."""
    ids = list(prompt)
    num_decided = None
    for _ in range(num_tokens):
        logits = model.forward_dense(torch.tensor([ids]))[0, -1].double()
        output = ids[len(prompt):]
        counts = Counter(output)
        for token_id in set(ids):
            if logits[token_id] > 0:
                logits[token_id] /= repetition
            else:
                logits[token_id] *= repetition
        for token_id, count in counts.items():
            logits[token_id] -= frequency * count + presence
        top_two = logits.topk(2).values
        if num_decided is None and top_two[0] - top_two[1] < NEAR_TIE:
            num_decided = len(output)  # this token may go either way, and the next follow it
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], num_decided or num_tokens


def test_penalties_equal_a_dense_reference_loop():
    llm = tiny()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **PENALTIES)
    compared = 0
    for prompt in ([5, 6, 5, 6, 7], [100, 101, 102], [65] * 8):
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        want, num_decided = penalized_reference(llm.engine.model, prompt, 24, 0.7, 0.4, 1.6)
        assert got[:num_decided] == want[:num_decided]
        compared += num_decided
    plain = tiny().generate([[65] * 8], SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    assert compared >= 24 and plain != got  # the penalties changed something


def test_penalties_do_not_depend_on_batching_chunking_or_preemption():
    """Penalized greedy requests, alone, equal themselves in a batch beside plain ones, in
    16-token chunks, in a KV cache that forces preemption; a seeded one equals itself too."""
    penalized = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **PENALTIES)
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = [tiny().generate([p], penalized)[0].outputs[0].token_ids for p in PROMPTS]
    llm = tiny(kv_cache_tokens=192, max_num_batched_tokens=16)
    mixed = [penalized, plain] * len(PROMPTS)
    together = llm.generate([p for p in PROMPTS for _ in range(2)], mixed)
    assert token_ids(together)[0::2] == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)
    seeded = SamplingParams(max_tokens=12, seed=3, ignore_eos=True, **PENALTIES)
    assert tiny().generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids == \
        tiny().generate([PROMPTS[0], PROMPTS[1]], [seeded, plain])[0].outputs[0].token_ids


def test_a_penalty_no_row_uses_is_skipped_and_skipping_changes_no_logit(monkeypatch):
    """A repetition penalty alone (Qwen2.5's default) neither gathers the token counts nor
    runs the frequency and presence passes, and what sampling sees is bit for bit what all
    the passes give."""
    llm = tiny()
    state = llm.engine.model_runner.input_batch
    seen = []
    apply_penalties = sampling.apply_penalties

    def recording(logits, penalties):
        rows = penalties.input_batch_rows
        every_pass = dataclasses.replace(
            penalties, output_counts=state.output_counts[rows], seen=state.seen[rows],
            any_repetition=True, any_frequency_or_presence=True)
        seen.append((penalties.any_repetition, penalties.any_frequency_or_presence,
                     penalties.output_counts is None,
                     torch.equal(apply_penalties(logits, penalties),
                                 apply_penalties(logits, every_pass))))
        return apply_penalties(logits, penalties)
    monkeypatch.setattr(sampling, "apply_penalties", recording)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            repetition_penalty=1.3)
    llm.generate([PROMPTS[0], PROMPTS[1]], params)
    assert seen and all(entry == (True, False, True, True) for entry in seen)


def test_no_count_tensor_is_built_when_no_row_has_a_penalty(monkeypatch):
    built = []
    penalties = InputBatch.penalties

    def counting(self, seqs):
        built.append(len(seqs))
        return penalties(self, seqs)
    monkeypatch.setattr(InputBatch, "penalties", counting)
    llm = tiny()
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, seed=1, top_k=5, min_p=0.1))
    assert built == []
    llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=4), SamplingParams(
        max_tokens=4, presence_penalty=0.5), SamplingParams(max_tokens=4)])
    assert built and max(built) == 3


def test_logprobs_are_the_models_own_before_penalties_and_bias():
    llm = tiny()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                            repetition_penalty=3.0, logit_bias={7: 5.0})
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    ids = [5, 6, 7] + out.token_ids
    dense = llm.engine.model.forward_dense(torch.tensor([ids])).log_softmax(-1)[0]
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token_id] == pytest.approx(dense[2 + i, token_id].item(), abs=1e-5)


def test_logit_bias_forces_and_bans_a_token():
    llm = tiny()
    forced = SamplingParams(max_tokens=5, seed=0, ignore_eos=True, logit_bias={65: 100})
    assert llm.generate(["ab"], forced)[0].outputs[0].token_ids == [65] * 5
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first = llm.generate(["ab"], greedy)[0].outputs[0].token_ids[0]
    banned = dataclasses.replace(greedy, logit_bias={first: -100})
    assert first not in llm.generate(["ab"], banned)[0].outputs[0].token_ids


def test_min_p_of_one_keeps_only_the_most_likely_token():
    llm = tiny()
    greedy = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0,
                                                      ignore_eos=True))
    sampled = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=1.5, seed=4,
                                                       min_p=1.0, ignore_eos=True))
    assert token_ids(sampled) == token_ids(greedy)


def test_min_tokens_holds_back_end_of_text_and_stop_tokens():
    """End-of-text biased to certain: never among the first min_tokens tokens, then at once."""
    llm = tiny()
    eot = llm.engine.tokenizer.token_id(EOT)
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logit_bias={eot: 100})
    out = llm.generate(["ab"], params)[0].outputs[0]
    assert out.token_ids[5:] == [eot] and eot not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    stop_id = 66
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=3, ignore_eos=True,
                            stop_token_ids=[stop_id], logit_bias={stop_id: 100})
    out = llm.generate(["ab"], params)[0].outputs[0]
    assert out.token_ids[3:] == [stop_id] and (out.finish_reason, out.stop_reason) == (
        "stop", stop_id)


def test_stop_token_ids_end_the_request_with_the_token_kept_out_of_the_text():
    llm = tiny()
    free = SamplingParams(max_tokens=16, seed=2, ignore_eos=True)
    tokens = llm.generate(["ROMEO:"], free)[0].outputs[0].token_ids
    stop_id = tokens[5]
    end = tokens.index(stop_id) + 1
    params = dataclasses.replace(free, stop_token_ids=[stop_id])
    out = llm.generate(["ROMEO:"], params)[0].outputs[0]
    assert out.token_ids == tokens[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    tokenizer = llm.engine.tokenizer
    assert out.text == tokenizer.decode(tokens[:end - 1])
    kept = llm.generate(["ROMEO:"], dataclasses.replace(params, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == tokenizer.decode(tokens[:end])


def test_include_stop_str_in_output_keeps_the_stop_string():
    llm = tiny()
    free = SamplingParams(max_tokens=16, seed=2, ignore_eos=True)
    text = llm.generate(["ROMEO:"], free)[0].outputs[0].text
    stop = text[4:6]
    cut = llm.generate(["ROMEO:"], dataclasses.replace(free, stop=[stop]))[0].outputs[0]
    kept = llm.generate(["ROMEO:"], dataclasses.replace(
        free, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert cut.text == text[:text.index(stop)]
    assert kept.text == text[:text.index(stop) + len(stop)]
    assert kept.stop_reason == cut.stop_reason == stop


def test_stop_strings_count_only_after_min_tokens():
    """Every token the same (biased to certain) and its text the stop string: the first token
    ends it; with min_tokens 8 the stop string is looked for only once the output is longer,
    as vLLM does."""
    llm = tiny()
    text = llm.engine.tokenizer.decode([65])
    free = SamplingParams(max_tokens=16, seed=2, ignore_eos=True, logit_bias={65: 100},
                          stop=[text])
    early = llm.generate(["ROMEO:"], free)[0].outputs[0]
    held = llm.generate(["ROMEO:"], dataclasses.replace(free, min_tokens=8))[0].outputs[0]
    assert len(early.token_ids) == 1 and early.text == ""
    assert len(held.token_ids) == 9 and held.text == text * 8


def test_the_repl_and_the_command_line_take_the_new_sampling_fields(capsys):
    engine = tiny().engine
    args = cli.parse_args(["--presence-penalty", "0.5", "--min-p", "0.1",
                                 "--stop-token-ids", "7", "8", "--n", "2"])
    params = cli.cli_params(engine, args, "x")
    assert (params.presence_penalty, params.min_p, params.stop_token_ids, params.n) == (
        0.5, 0.1, [7, 8], 2)
    settings = {}
    reply = cli.repl_command('/set logit_bias {"65": 5}', settings, engine,
                                   cli.parse_args([]))
    assert reply == "logit_bias = {'65': 5}" and settings == {"logit_bias": {"65": 5}}
    reply = cli.repl_command("/set repetition_penalty 0", settings, engine,
                                   cli.parse_args([]))
    assert reply.startswith("error: repetition_penalty must be a number in [0.01, 100]")


@pytest.mark.parametrize("field, value", [("stop_token_ids", [10**6]),
                                          ("logit_bias", {10**6: 1.0})])
def test_a_token_id_outside_the_vocabulary_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field}: token id 1000000 is not in the vocabulary"):
        tiny().engine.add_request("x", SamplingParams(**{field: value}))


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens \(9\) must be at most max_tokens \(8\)"):
        SamplingParams(max_tokens=8, min_tokens=9)


# ----------------------------------------------------------------------------- chat, defaults

GENERATION_CONFIG = dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                         repetition_penalty=1.1, max_new_tokens=7, do_sample=True)


SAMPLING_DEFAULTS = dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                         repetition_penalty=1.1, max_tokens=7)  # SamplingParams' names


DEFAULTS_LINE = ("using the checkpoint's sampling defaults (generation_config.json): "
                 "temperature 0.6, top_p 0.9, top_k 20, min_p 0.05, repetition_penalty 1.1, "
                 "max_tokens 7")


def record_params(monkeypatch, engine: Engine) -> list[SamplingParams]:
    """The SamplingParams of each request the engine is given from now on, as it holds them."""
    seen = []
    add_request = engine.add_request

    def add_and_record(prompt, params=None, request_id=None, stream=True, priority=0,
                       lora_request=None):
        request_id = add_request(prompt, params, request_id, stream, priority, lora_request)
        seen.append(engine.seqs[request_id].params)
        return request_id
    monkeypatch.setattr(engine, "add_request", add_and_record)
    return seen


def test_generate_without_params_takes_the_checkpoints_defaults(tmp_path, monkeypatch):
    llm = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG))
    seen = record_params(monkeypatch, llm.engine)
    llm.generate("ROMEO:")
    llm.generate("ROMEO:", SamplingParams(max_tokens=3))
    assert seen == [SamplingParams(**SAMPLING_DEFAULTS), SamplingParams(max_tokens=3)]
    assert llm.get_default_sampling_params() == SamplingParams(**SAMPLING_DEFAULTS)


def test_http_fields_absent_or_null_take_the_checkpoints_defaults(tmp_path, monkeypatch):
    llm = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG))
    seen = record_params(monkeypatch, llm.engine)
    with server_in_process(llm.engine) as url:
        assert http(url, "/v1/completions", dict(prompt="x", top_p=None, top_k=5))[0] == 200
        assert http(url, "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                                      temperature=0.3))[0] == 200
    assert [(p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens)
            for p in seen] == [(0.6, 0.9, 5, 0.05, 1.1, 7), (0.3, 0.9, 20, 0.05, 1.1, 7)]


def test_cli_flags_given_win_over_the_checkpoints_defaults_which_win_over_its_own(tmp_path):
    engine = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG)).engine
    args = cli.parse_args(["--temperature", "0.8", "--top-p", "0.5"])  # 0.8: its own
    params = cli.cli_params(engine, args, "x")
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.8, 0.5, 20, 7)
    params = cli.cli_params(engine, cli.parse_args([]), "x", max_tokens=2)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 2)


def test_generation_config_vllm_ignores_the_checkpoints_defaults(tmp_path):
    path = chat_checkpoint(tmp_path, None, GENERATION_CONFIG)
    llm = checkpoint_llm(path, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    params = cli.cli_params(llm.engine, cli.parse_args([]), "x")
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        0.8, 0.95, 0, cli.CLI_MAX_TOKENS)


def test_the_start_up_line_names_the_defaults_taken(tmp_path, capsys):
    llm = checkpoint_llm(chat_checkpoint(tmp_path, None, GENERATION_CONFIG))
    with server_in_process(llm.engine):
        pass
    assert DEFAULTS_LINE in capsys.readouterr().err
    status, _, err = nanoserve_main(capsys, "--model", str(tmp_path), "--device", "cpu",
                                    "--prompt", "x", "--max-tokens", "1")
    assert status == 0 and DEFAULTS_LINE in err
    status, _, err = nanoserve_main(capsys, "--model", str(tmp_path), "--device", "cpu",
                                    "--prompt", "x", "--max-tokens", "1",
                                    "--generation-config", "vllm")
    assert status == 0 and "sampling defaults" not in err


def test_a_default_max_tokens_past_the_context_is_cut_to_what_each_prompt_leaves(tmp_path):
    """generation_config.json's max_new_tokens 5000, max_model_len 32: a completion without
    max_tokens gets what its prompt's context leaves (vLLM's rule); one that asks for more
    than that itself is refused, naming why."""
    path = chat_checkpoint(tmp_path, None, dict(max_new_tokens=5000))
    llm = checkpoint_llm(path, max_model_len=32)
    with server_in_process(llm.engine) as url:
        status, reply = http(url, "/v1/completions", dict(prompt=["ROMEO:", "JULIET, my love:"],
                                                          temperature=0, ignore_eos=True))
        assert status == 200
        assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
        assert reply["usage"]["completion_tokens"] == (32 - 6) + (32 - 16)
        status, reply = http(url, "/v1/completions", dict(prompt="ROMEO:", max_tokens=100))
        assert status == 400 and "max_model_len is 32" in reply["error"]["message"]
    outputs = llm.generate(["ROMEO:", "JULIET, my love:"])  # generate() without params, the same
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    assert lengths[0] <= 32 - 6 and lengths[1] <= 32 - 16


# ----------------------------------------------------------------------------- bench.py --url

def test_presence_and_frequency_penalties_count_the_output_not_the_prompt():
    """OpenAI's presence and frequency penalties lower the logits of the tokens generated so
    far, never the prompt's: a prompt made of the very tokens greedy decoding picks next is
    no penalty (the first token is the plain greedy one, though penalizing the prompt would
    change it), and the rest equal the dense reference loop that counts only the output."""
    llm = tiny()
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = llm.engine.tokenizer.encode(PROMPTS[3])  # "x" * 37: the model loops on one token
    prompt = base + llm.generate([base], plain)[0].outputs[0].token_ids[:8]
    first = llm.generate([prompt], plain)[0].outputs[0].token_ids[0]
    logits = llm.engine.model.forward_dense(torch.tensor([prompt]))[0, -1].detach().double()
    runner_up = logits.topk(2).values[1].item()
    compared = 0
    for presence, frequency in ((1.0, 0.0), (0.0, 0.5)):
        # counted in the prompt, `first` would lose to the runner-up
        assert logits[first] - presence - frequency * prompt.count(first) < runner_up
        params = dataclasses.replace(plain, presence_penalty=presence,
                                     frequency_penalty=frequency)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got[0] == first, (presence, frequency)
        want, num_decided = penalized_reference(llm.engine.model, prompt, 24, presence,
                                                frequency, 1.0)
        assert got[:num_decided] == want[:num_decided], (presence, frequency)
        compared += num_decided
    assert compared >= 24


def test_each_rows_logit_bias_and_min_tokens_ban_apply_to_that_row_alone():
    """Requests with different logit_bias and min_tokens in one batch each get their own
    bias and their own end-of-text ban: every one's greedy tokens equal its tokens alone,
    and every bias changes what plain greedy decoding would give."""
    llm = tiny()
    eot = llm.engine.tokenizer.token_id(EOT)
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    greedy = token_ids(llm.generate(PROMPTS[:5], plain))
    ends = dataclasses.replace(plain, ignore_eos=False, logit_bias={eot: 100})
    params = [ends,                                                  # end-of-text at once
              dataclasses.replace(plain, logit_bias={65: 100}),      # forces one token
              dataclasses.replace(plain, logit_bias={200: 100}),     # forces another
              dataclasses.replace(ends, min_tokens=4),               # end-of-text held back 4
              dataclasses.replace(plain, logit_bias={greedy[4][0]: -100})]  # bans a token
    alone = [token_ids(llm.generate([p], sp))[0] for p, sp in zip(PROMPTS, params)]
    assert alone[:3] == [[eot], [65] * 10, [200] * 10]
    assert alone[3][4:] == [eot] and eot not in alone[3][:4]
    assert alone[4][0] != greedy[4][0]
    assert all(a != g for a, g in zip(alone, greedy))
    for order in (range(5), reversed(range(5))):
        order = list(order)
        together = token_ids(llm.generate([PROMPTS[i] for i in order],
                                          [params[i] for i in order]))
        assert together == [alone[i] for i in order], order


def test_presence_penalty_subtracts_once_whatever_the_count():
    """OpenAI's presence penalty is presence x [count > 0]: a token generated 3 times loses
    presence once; the frequency penalty takes frequency x count."""
    logits = torch.zeros(1, 4)
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    penalties = Penalties(output_counts=counts, seen=None, presence=torch.tensor([0.5]),
                          frequency=torch.tensor([0.0]), repetition=torch.tensor([1.0]),
                          input_batch_rows=torch.tensor([0]), any_repetition=False,
                          any_frequency_or_presence=True)
    assert apply_penalties(logits, penalties).tolist() == [[0.0, -0.5, -0.5, 0.0]]
    penalties.presence, penalties.frequency = torch.tensor([0.0]), torch.tensor([0.5])
    assert apply_penalties(logits, penalties).tolist() == [[0.0, -0.5, -1.5, 0.0]]


def test_a_greedy_request_stays_greedy_beside_sampled_ones():
    """A batch of temperature 0 beside temperature 1 (not all greedy): the greedy request's
    tokens are those it makes alone."""
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    hot = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=1)
    alone = tiny().generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids
    mixed = tiny().generate([PROMPTS[0], PROMPTS[1]], [greedy, hot])
    assert mixed[0].outputs[0].token_ids == alone
