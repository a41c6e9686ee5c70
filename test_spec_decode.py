"""Speculative decoding (spec_decode.py, ngram_proposer.py, draft_proposer.py): greedy outputs
are the model's own whatever the proposer, batch, chunking, preemption, prefix cache or n;
sampled outputs keep the model's distribution; rejected drafts leave nothing behind."""
import collections
import json
import shutil
import subprocess
import sys

import pytest
import torch

from checkpoint import load_model, save_checkpoint
from conftest import (HERE, PROMPTS, assert_no_leaks, http, run_to_end,
                      server_in_process, tiny, token_ids)
from display import render_trace
from ngram_proposer import NgramProposer
from paged_cache import NO_PARENT, BlockPool, BlockTable, hash_block
from sampling import SamplingParams, SamplingTensors
from scheduler import Sequence
from spec_decode import SpecDecodeMetadata, Speculator, SpeculativeConfig, accept_runs, verify
from structured_output import StructuredOutputsParams

# drafts at any batch size (on a CPU they stop past 4 sequences unless told otherwise)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "disable_by_batch_size": 1024}
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    """Draft checkpoints for the tiny preset: "same" has the target's weights (every draft is
    accepted), "poor" random weights of another seed (nearly every draft is rejected)."""
    paths = {}
    for name, seed in (("same", 0), ("poor", 1)):
        path = str(tmp_path_factory.mktemp(name))
        save_checkpoint(load_model(None, "tiny", seed).model, path, dtype=torch.float32)
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def greedy_alone() -> list[list[int]]:
    """Greedy outputs without speculation: the reference."""
    return token_ids(tiny().generate(PROMPTS, GREEDY))


def draft_config(path: str, k: int = 3) -> dict:
    return {"model": path, "num_speculative_tokens": k, "disable_by_batch_size": 1024}


def spec_stats(llm) -> tuple[int, int]:
    stats = llm.engine.stats
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


# ----------------------------------------------------------------------------- greedy: exact

@pytest.mark.parametrize("proposer", ["ngram", "same", "poor"])
def test_greedy_outputs_equal_without_speculation_for_every_proposer(proposer, drafts,
                                                                     greedy_alone):
    config = NGRAM if proposer == "ngram" else draft_config(drafts[proposer])
    llm = tiny(speculative_config=config)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    num_drafts, num_accepted = spec_stats(llm)
    assert num_drafts > 0  # it did speculate
    if proposer == "same":
        assert num_accepted == num_drafts
    assert_no_leaks(llm.engine)


def test_greedy_outputs_equal_under_chunking_preemption_prefix_caching_and_n(drafts):
    """A cache of 24 blocks of 8 for 6 prompts, a budget of 24 tokens a step (prompts are
    chunked, drafts cut to the budget), n = 2 (the samples share a cached prompt)."""
    params = SamplingParams(n=2, max_tokens=40, temperature=0, ignore_eos=True)
    engine_args = dict(kv_cache_tokens=192, block_size=8, max_num_batched_tokens=24)
    reference = tiny(**engine_args).generate(PROMPTS, params)
    for config in (NGRAM, draft_config(drafts["same"], 4)):
        llm = tiny(speculative_config=config, **engine_args)
        outputs = llm.generate(PROMPTS, params)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == \
            [[c.token_ids for c in o.outputs] for o in reference]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats.num_cached_tokens > 0
        assert spec_stats(llm)[1] > 0
        assert_no_leaks(llm.engine)


def test_greedy_output_of_a_prompt_is_the_same_alone_and_in_a_batch(drafts):
    llm = tiny(speculative_config=NGRAM)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batched = token_ids(llm.generate(PROMPTS, params))
    alone = [token_ids(llm.generate([prompt], params))[0] for prompt in PROMPTS[:3]]
    assert batched[:3] == alone


# ----------------------------------------------------------------------------- ends and fields

def test_stops_end_the_output_where_they_would_without_speculation(drafts):
    """With a draft that is always right, runs of 5 tokens are accepted at once; a stop string,
    a stop token and max_tokens that fall inside a run still end the output at that token."""
    reference_llm = tiny()
    text = reference_llm.generate(["ROMEO: "], GREEDY)[0].outputs[0]
    cases = [dict(stop=[text.text[7:10]]), dict(stop_token_ids=[text.token_ids[9]]),
             dict(max_tokens=13), dict(stop=[text.text[7:10]], include_stop_str_in_output=True)]
    llm = tiny(speculative_config=draft_config(drafts["same"], 4))
    for case in cases:
        params = SamplingParams(**(dict(max_tokens=48, temperature=0, ignore_eos=True) | case))
        expected = reference_llm.generate(["ROMEO: "], params)[0].outputs[0]
        got = llm.generate(["ROMEO: "], params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("fields", [
    dict(frequency_penalty=2.0), dict(presence_penalty=2.0, repetition_penalty=1.5),
    dict(repetition_penalty=3.0),
    dict(min_tokens=10, logit_bias={256: 8.0}, ignore_eos=False),
    dict(logit_bias={101: 3.0, 32: -100})])
def test_sampling_fields_apply_at_every_drafted_position(fields, drafts):
    """Penalties count the drafts before a position, and min_tokens' ban ends where it would
    one token at a time (here end-of-text, biased up, comes at the 10th token exactly)."""
    params = SamplingParams(**(dict(max_tokens=32, temperature=0, ignore_eos=True) | fields))
    expected = token_ids(tiny().generate(PROMPTS[2:], params))
    num_accepted = 0
    for config in (NGRAM, draft_config(drafts["same"], 4)):
        llm = tiny(speculative_config=config)
        assert token_ids(llm.generate(PROMPTS[2:], params)) == expected
        num_accepted += spec_stats(llm)[1]
    assert num_accepted > 0


@pytest.mark.parametrize("proposer", ["same", "poor"])  # every draft accepted; most rejected
def test_logprobs_are_those_of_the_emitted_tokens(proposer, drafts):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    expected = tiny().generate(PROMPTS[:3], params)
    llm = tiny(speculative_config=draft_config(drafts[proposer], 4))
    got = llm.generate(PROMPTS[:3], params)
    for want, have in zip(expected, got):
        assert len(have.outputs[0].logprobs) == len(want.outputs[0].logprobs) == 24
        for entry_want, entry_have in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert entry_have.keys() == entry_want.keys()
            for token_id in entry_want:
                assert entry_have[token_id] == pytest.approx(entry_want[token_id], abs=1e-4)


def test_streamed_deltas_add_up_to_the_whole_output(drafts):
    llm = tiny(speculative_config=draft_config(drafts["same"], 4))
    engine = llm.engine
    engine.add_request("ROMEO: ", GREEDY, request_id="r")
    deltas = run_to_end(engine)["r"]
    tokens = [t for delta in deltas for t in delta.outputs[0].token_ids]
    assert tokens == token_ids(tiny().generate(["ROMEO: "], GREEDY))[0]
    assert max(len(delta.outputs[0].token_ids) for delta in deltas) == 5  # a run of 4 + 1
    assert "".join(d.outputs[0].text for d in deltas) == engine.tokenizer.decode(tokens)


# ----------------------------------------------------------------------------- rollback

def test_rollback_leaves_no_block_held_and_caches_only_accepted_tokens(drafts):
    """A poor draft's tokens are rejected nearly always: their K/V were written, but the blocks
    they took are freed and no block holding them is registered in the prefix cache: every
    cached hash is that of a prefix of a prompt and its real output."""
    llm = tiny(speculative_config=draft_config(drafts["poor"], 8), block_size=4)
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY, request_id=prompt, stream=False)
    outputs = []
    while engine.has_unfinished():
        outputs += [output for output in engine.step() if output.finished]
        for seq in engine.scheduler.running:  # no block past its computed tokens
            if seq.seq_id in engine.last_step.num_draft_tokens:
                assert len(seq.block_table.block_ids) == -(-seq.num_computed_tokens // 4)
    num_drafts, num_accepted = spec_stats(llm)
    assert num_drafts > num_accepted
    real = set()
    for output in outputs:
        tokens = output.prompt_token_ids + output.outputs[0].token_ids
        parent = NO_PARENT
        for start in range(0, len(tokens) - 3, 4):
            parent = hash_block(parent, tokens[start:start + 4])
            real.add(parent)
    cached = set(engine.block_pool.hash_to_block_id)
    assert cached and cached <= real
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- seeded: exact

SEEDED = SamplingParams(max_tokens=32, temperature=0.7, top_k=2, seed=123, ignore_eos=True)


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 4},   # on a CPU: no drafts past 4 sequences
    NGRAM | {"max_num_batched_tokens": 24}])            # drafts at any size, cut by the budget
def test_a_seeded_request_samples_the_same_alone_and_beside_five_others_with_ngram_drafts(
        config):
    """Seed 123 alone drafts; beside five other requests it drafts less or not at all (the
    batch passes disable_by_batch_size, or the others' prefill chunks take the budget): its
    tokens are the same, as they are without speculation."""
    config = dict(config)
    engine_args = dict(max_num_batched_tokens=config.pop("max_num_batched_tokens", 512))
    prompt = PROMPTS[4]
    expected = token_ids(tiny(**engine_args).generate([prompt], SEEDED))[0]
    llm = tiny(speculative_config=config, **engine_args)
    alone = token_ids(llm.generate([prompt], SEEDED))[0]
    num_drafts_alone = spec_stats(llm)[0]
    others = [SamplingParams(max_tokens=32, seed=i) for i in range(5)]
    batched = token_ids(llm.generate(PROMPTS[:4] + [prompt] + PROMPTS[5:],
                                     others[:4] + [SEEDED] + others[4:]))[4]
    assert num_drafts_alone > 0
    assert alone == batched == expected
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("fields", [
    dict(), dict(top_k=3, top_p=0.9), dict(temperature=1.5, min_p=0.05),
    dict(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3),
    dict(min_tokens=10, logit_bias={256: 6.0}, ignore_eos=False)])
def test_seeded_outputs_with_ngram_drafts_equal_those_without_speculation(fields):
    """An n-gram draft is accepted where the position's own draw equals it: seeded tokens are
    those without speculation, whatever the sampling fields, for several seeds and n = 2
    (top_k 2 unless set: the tiny model's random weights spread their probability, and a
    draft is then accepted often enough to be seen)."""
    params = [SamplingParams(**(dict(max_tokens=32, temperature=0.7, top_k=2, seed=seed, n=2,
                                     ignore_eos=True) | fields)) for seed in range(len(PROMPTS))]
    expected = tiny().generate(PROMPTS, params)
    llm = tiny(speculative_config=NGRAM | {"disable_by_batch_size": 64})
    outputs = llm.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == \
        [[c.token_ids for c in o.outputs] for o in expected]
    num_drafts, num_accepted = spec_stats(llm)
    if "repetition_penalty" not in fields:  # penalised, a repeat (an n-gram draft) is rare
        assert 0 < num_accepted < num_drafts  # drafts were accepted and rejected
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("fields", [
    dict(), dict(top_k=3, top_p=0.9, min_p=0.05),
    dict(frequency_penalty=1.0, repetition_penalty=1.3, min_tokens=10, ignore_eos=False)])
def test_seeded_outputs_with_a_draft_model_equal_those_without_speculation(fields, drafts):
    """A seeded sequence's draft-model guess is matched against the position's own draw:
    seeded tokens are those without speculation, for several seeds, n = 2 and sampling
    fields the draft does not apply (top-k, penalties: its q then differs from p), with a
    draft that guesses well and one that does not."""
    params = [SamplingParams(**(dict(max_tokens=24, temperature=0.8, seed=seed, n=2,
                                     ignore_eos=True) | fields)) for seed in range(4)]
    expected = tiny().generate(PROMPTS[:4], params)
    for proposer in ("same", "poor"):
        llm = tiny(speculative_config=draft_config(drafts[proposer], 3))
        outputs = llm.generate(PROMPTS[:4], params)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == \
            [[c.token_ids for c in o.outputs] for o in expected], proposer
        assert spec_stats(llm)[1] > 0  # drafts were accepted
        assert_no_leaks(llm.engine)


def test_a_draft_with_the_targets_weights_has_every_seeded_guess_accepted(drafts):
    """The draft draws a seeded guess with the noise the target draws that position with: with
    q = p the two draws are the same token, every time (Gumbel-max coupling). Drawn with noise
    of its own, a guess would match a sampled token rarely."""
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    llm = tiny(speculative_config=draft_config(drafts["same"], 4))
    llm.generate(PROMPTS[:3], params)
    num_drafts, num_accepted = spec_stats(llm)
    assert num_drafts > 0
    assert num_accepted == num_drafts


def test_a_seeded_request_samples_the_same_alone_and_batched_with_a_draft_model(drafts):
    """Alone or beside five others (which change its drafts: each drafts as its own batch
    allows), a seeded request's tokens under a draft model are those without speculation."""
    prompt = PROMPTS[4]
    expected = token_ids(tiny().generate([prompt], SEEDED))[0]
    llm = tiny(speculative_config=draft_config(drafts["poor"], 3) | {"disable_by_batch_size": 4})
    alone = token_ids(llm.generate([prompt], SEEDED))[0]
    others = [SamplingParams(max_tokens=32, seed=i) for i in range(5)]
    batched = token_ids(llm.generate(PROMPTS[:4] + [prompt] + PROMPTS[5:],
                                     others[:4] + [SEEDED] + others[4:]))[4]
    assert alone == batched == expected
    assert_no_leaks(llm.engine)


# ----------------------------------------------------------------------------- sampled: the
# target's distribution

def uniform_rows(num_trials: int, vocab: int) -> SamplingTensors:
    return SamplingTensors(temperature=torch.ones(num_trials),
                           top_k=torch.full((num_trials,), vocab), top_p=torch.ones(num_trials),
                           greedy=torch.zeros(num_trials, dtype=torch.bool),
                           seeds=[None] * num_trials, positions=[0] * num_trials, all_greedy=False,
                           any_top_k_top_p=False,
                           any_greedy=False)


def emitted_distribution(p: torch.Tensor, q: torch.Tensor | None, num_trials: int) -> torch.Tensor:
    """The distribution of the token verify() emits at one position, over num_trials trials:
    target p (vocab,), a draft token drawn from q (vocab,) each trial (None: always token 0,
    an n-gram guess)."""
    generator = torch.Generator().manual_seed(0)
    vocab = len(p)
    logits = p.log().expand(num_trials, vocab)
    if q is None:
        drafts = torch.zeros(num_trials, dtype=torch.int64)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, num_trials, replacement=True, generator=generator)
        draft_probs = q.expand(num_trials, vocab)
    rows = SpecDecodeMetadata(draft_token_ids=drafts,
                    has_draft=torch.ones(num_trials, dtype=torch.bool), draft_probs=draft_probs)
    drawn, accepted = verify(logits, uniform_rows(num_trials, vocab), rows, generator)
    emitted = torch.where(accepted.bool(), drafts, drawn)
    return torch.bincount(emitted, minlength=vocab) / num_trials


@pytest.mark.parametrize("q", [[0.05, 0.05, 0.1, 0.8], [0.25, 0.25, 0.25, 0.25], None])
def test_rejection_sampling_emits_the_target_distribution_whatever_the_draft(q):
    """Leviathan et al.'s theorem, checked over 40,000 trials: accepting d ~ q with probability
    min(1, p(d) / q(d)) and else drawing from max(p - q, 0) emits p exactly; a poor draft (q
    far from p) and an n-gram guess (q one-hot) alike. Accepting more often than that (say
    every draft) would emit q."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = None if q is None else torch.tensor(q)
    emitted = emitted_distribution(p, q, 40_000)
    assert (emitted - p).abs().max() < 0.01


def test_sampled_outputs_keep_the_target_distribution_end_to_end(drafts):
    """Seeded requests at top_k 2 (two tokens possible at each position): the share of the
    commoner token at positions 1 to 3 with a poor draft is the target's own, within noise;
    the draft proposes from all 257 tokens, so a sampler that accepted its drafts unchecked
    would emit tokens outside the two."""
    num_samples = 300
    params = [SamplingParams(max_tokens=4, top_k=2, seed=i, ignore_eos=True)
              for i in range(num_samples)]

    def shares(llm) -> list[collections.Counter]:
        outputs = llm.generate(["ROMEO: "] * num_samples, params)
        return [collections.Counter(o.outputs[0].token_ids[position] for o in outputs)
                for position in (1, 2, 3)]

    target = shares(tiny())
    llm = tiny(speculative_config=draft_config(drafts["poor"], 3))
    speculative = shares(llm)
    assert spec_stats(llm)[0] > num_samples
    for want, have in zip(target, speculative):
        assert set(have) <= set(want) or len(want) == 2 and len(have) <= 2
        token, count = want.most_common(1)[0]
        assert abs(have[token] - count) / num_samples < 0.12


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_a_draft_model_that_is_the_target_has_every_sampled_draft_accepted(temperature,
                                                                            drafts):
    """The draft's q is the distribution its tokens were drawn from, at the request's
    temperature: with the target's own weights q equals p, and min(1, p(d) / q(d)) accepts
    every draft (a q taken at temperature 1 rejects some)."""
    params = [SamplingParams(max_tokens=16, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(4)]
    llm = tiny(speculative_config=draft_config(drafts["same"], 3))
    llm.generate(PROMPTS[:4], params)
    num_draft_tokens, num_accepted_tokens = spec_stats(llm)
    assert num_draft_tokens > 0 and num_accepted_tokens == num_draft_tokens


def test_a_draft_model_proposes_no_more_drafts_than_a_sequence_may_emit(drafts):
    """k = 3, the target's own weights as the draft: beside a sequence that may take 3
    drafts, one of max_tokens 3 decodes with 1 token of room besides the step's own: it
    verifies 1 draft, not the 2 or 3 a draft model running 3 forwards could give it."""
    engine = tiny(speculative_config=draft_config(drafts["same"], 3)).engine
    engine.add_request(PROMPTS[2], GREEDY, "long")
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       "short")
    short_drafts = []
    while engine.has_unfinished():
        engine.step()
        short_drafts.append(engine.last_step.num_draft_tokens.get("short", 0))
    assert max(short_drafts) == 1


def test_a_bonus_token_is_drawn_from_the_whole_target_distribution():
    """logit_bias makes token 0 nearly certain: the n-gram drafts (0s) are accepted and the
    bonus token after them is drawn from p, so it is 0 as well; a sampler that treated the
    bonus row as a draft row of token 0 would draw it from p without 0."""
    params = SamplingParams(max_tokens=30, seed=5, logit_bias={0: 100}, ignore_eos=True)
    llm = tiny(speculative_config=NGRAM)
    output = llm.generate([{"prompt_token_ids": [0] * 8}], params)[0].outputs[0]
    assert spec_stats(llm)[1] > 0
    assert output.token_ids == [0] * 30


# ----------------------------------------------------------------------------- proposers

def test_ngram_proposer_takes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    #         to be or not to be
    tokens = [1, 2, 3, 4, 1, 2]
    assert proposer.find_draft(tokens, 3) == [3, 4, 1]
    assert proposer.find_draft(tokens, 1) == [3]
    assert proposer.find_draft([1, 2, 3, 4, 5], 3) == []  # no suffix occurs earlier
    assert proposer.find_draft([1, 2, 3], 3) == []  # no room before a suffix of 3 tokens
    # the longest suffix wins: [7, 1, 2] occurs at 2 (then 9), [1, 2] later at 6 (then 5)
    assert proposer.find_draft([0, 0, 7, 1, 2, 9, 1, 2, 5, 7, 1, 2], 1) == [9]
    # [1, 2] at 0 (then 7, 8) and at 4 (then 5, 6): the latest with 2 tokens after it
    assert proposer.find_draft([1, 2, 7, 8, 1, 2, 5, 6, 1, 2], 2) == [5, 6]
    # [1, 2] at 3 has exactly 4 tokens after it: enough
    assert proposer.find_draft([1, 2, 7, 1, 2, 5, 6, 1, 2], 4) == [5, 6, 1, 2]


def test_accept_runs_keeps_drafts_up_to_the_first_rejected_then_the_models_token():
    drafts = [[7, 8, 9], [5], []]
    num_sampled_tokens = [4, 2, 1]
    accepted = [1, 0, 1, 0, 1, 0, 0]
    drawn = [0, 4, 0, 0, 0, 6, 3]
    assert accept_runs(num_sampled_tokens, drafts, drawn, accepted) == [[7, 4], [5, 6], [3]]


def test_a_sequence_whose_drafts_keep_failing_pauses_longer_each_time():
    class Proposer:
        def propose(self, wanted):
            self.wanted = wanted

    proposer = Proposer()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), proposer, "cpu")
    seq = new_decoding_seq()
    pauses = []
    for _ in range(4):
        speculator.verified(seq, 4, 0)  # all rejected
        steps = 0
        proposer.wanted = {}
        while seq not in proposer.wanted:
            speculator.propose([seq])
            steps += 1
        pauses.append(steps - 1)
    assert pauses == [1, 2, 4, 8]
    speculator.verified(seq, 4, 1)  # one accepted: no pause
    speculator.propose([seq])
    assert proposer.wanted == {seq: 4}


def new_decoding_seq() -> Sequence:
    """A sequence of 3 tokens, 2 computed: it decodes at its next step."""
    seq = Sequence("s", "", [1, 2, 3], GREEDY, BlockTable(BlockPool(4, 4)))
    seq.num_computed_tokens = 2
    return seq


# ----------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens must be"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min (4) is more than prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": float("nan")},
     "prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a checkpoint path"),
    ("{not json", "speculative_config is not JSON"),
    ([1, 2], "must be a JSON object")])
def test_bad_speculative_configs_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match="speculative_config") as error:
        tiny(speculative_config=config)
    assert message in str(error.value)


@pytest.mark.parametrize("change, message", [
    ("swap", "disagree on the token ranks"),
    ("extra", "has a tokenizer of 258 ids; the target's has 257")])
def test_a_draft_with_another_tokenizer_is_refused(change, message, tmp_path, drafts):
    """A copy of a good draft whose vocab.json swaps two bytes' ids (a tokenizer that does not
    load), or adds an id (one that loads, with an id the target does not have)."""
    shutil.copytree(drafts["poor"], tmp_path, dirs_exist_ok=True)
    vocab_file = tmp_path / "vocab.json"
    vocab = json.loads(vocab_file.read_text())
    if change == "swap":
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    else:  # "ab" one token, ranked after the bytes as a merge is
        vocab["ab"] = 256
        vocab["<|endoftext|>"] = 257
        (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    vocab_file.write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="speculative_config's model: ") as error:
        tiny(speculative_config=draft_config(str(tmp_path)))
    assert message in str(error.value)


def test_the_command_line_takes_speculative_config_as_json_and_refuses_a_bad_one_in_a_line():
    command = [sys.executable, f"{HERE}/nanoserve.py", "--preset", "tiny", "--prompt", "ab",
               "--max-tokens", "4", "--temperature", "0", "--speculative-config"]
    good = subprocess.run(command + [json.dumps(NGRAM)], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    bad = subprocess.run(command + ['{"num_speculative_tokens": 0}'], capture_output=True,
                         text=True)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "speculative_config's num_speculative_tokens must be" in bad.stderr
    assert "Traceback" not in bad.stderr


# ----------------------------------------------------------------------------- what it shows

def test_the_trace_the_metrics_and_the_step_record_count_accepted_drafts(drafts):
    """A draft that is always right, 4 drafts a step: 11 tokens in 3 steps (1, then 5 and 5),
    the trace marks a step of 5 "5", and /metrics adds up vLLM's three counters (over this
    request and the same one again over HTTP)."""
    llm = tiny(speculative_config=draft_config(drafts["same"], 4))
    engine = llm.engine
    llm.generate(["ROMEO: "], SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
                 trace=True)
    records = engine.step_records
    assert [r.num_accepted_tokens.get("0", 0) for r in records] == [0, 4, 4]
    assert [r.num_draft_tokens.get("0", 0) for r in records] == [0, 4, 4]
    assert render_trace(records, ["0"]).splitlines()[1].endswith("| o5*")
    with server_in_process(engine) as url:
        http(url, "/v1/completions", dict(prompt="ROMEO: ", max_tokens=11, temperature=0,
                                          ignore_eos=True))
        text = http(url, "/metrics")[1]
    counters = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("nanoserve:spec_decode")}
    assert counters == {"nanoserve:spec_decode_num_drafts_total": 4,
                        "nanoserve:spec_decode_num_draft_tokens_total": 16,
                        "nanoserve:spec_decode_num_accepted_tokens_total": 16}


def test_on_a_cpu_drafts_stop_past_four_sequences_unless_told_otherwise():
    """A CPU's step is compute-bound at a few sequences: by default no drafts while more than
    4 run; disable_by_batch_size sets the limit, on any device."""
    class Proposer:
        def propose(self, wanted):
            self.wanted = wanted

    seqs = [new_decoding_seq() for _ in range(5)]
    for device, limit, drafting in (("cpu", None, 4), ("cuda", None, 5), ("cpu", 8, 5)):
        proposer = Proposer()
        proposer.wanted = {}
        config = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=limit)
        speculator = Speculator(config, proposer, device)
        speculator.propose(seqs[:drafting])
        speculator.propose(seqs)
        assert len(proposer.wanted) == drafting


def test_a_structured_output_request_drafts_nothing_and_stays_valid_beside_drafting_ones():
    """A constrained sequence would need its grammar to check each draft: it takes none, and
    its rows are masked in a step where its neighbours verify drafts."""
    regex = "(to be or not ){2}to be"
    constrained = SamplingParams(max_tokens=40, temperature=0,
                                 structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = ["ROMEO: " * 4, "to be or not to be, to be or not to be, to be"]
    params = [constrained, GREEDY]
    expected = token_ids(tiny().generate(prompts, params))
    llm = tiny(speculative_config=NGRAM)
    outputs = llm.generate(prompts, params, trace=True)
    assert token_ids(outputs) == expected
    assert outputs[0].outputs[0].text == "to be or not to be or not to be"
    drafting = [r.num_draft_tokens for r in llm.engine.step_records if r.num_draft_tokens]
    assert drafting and all("0" not in r for r in drafting)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_outputs_equal_under_priorities_and_preemption_by_swapping(mode, drafts):
    """Drafts beside preemption by swapping (a swapped sequence's blocks hold only accepted
    tokens' K/V) and by recompute, under --policy priority."""
    tight = dict(kv_cache_tokens=192, block_size=16, max_num_batched_tokens=64)
    priority = [(i + 1) % 2 for i in range(len(PROMPTS))]
    expected = token_ids(tiny(max_num_batched_tokens=64).generate(PROMPTS, GREEDY))
    llm = tiny(policy="priority", preemption_mode=mode, **tight,
               speculative_config=draft_config(drafts["same"], 4))
    assert token_ids(llm.generate(PROMPTS, GREEDY, priority=priority)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert spec_stats(llm)[1] > 0
    if mode == "swap":
        assert llm.engine.scheduler.num_swapped_out > 0
    assert_no_leaks(llm.engine)
