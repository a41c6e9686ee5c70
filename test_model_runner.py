"""model_runner.py's guarantees: the padded decode path (CUDA graphs' static buffers, run
eagerly on the CPU) gives the unpadded path's tokens and writes its padding to the null block
alone; decodes go first in the flat batch; the KV cache's size on CUDA; NaN logits fail their
request alone; the device's default limits. The CUDA path itself (sizing, capture, pinned
uploads) runs here on the CPU through conftest's fake_cuda.
"""
import dataclasses

import pytest
import torch

import model_runner
import nanoserve
from checkpoint import load_model, save_checkpoint
from conftest import FAKE_GPU, GREEDY, PROMPTS, assert_no_leaks, run_to_end, tiny, token_ids
from model_runner import capture_sizes, kv_cache_bytes
from nanoserve import EngineConfig
from sampling import SamplingParams


def padded(**kwargs):
    """A tiny LLM whose decode steps run through the static buffers, padded, eagerly."""
    llm = tiny(**kwargs)
    llm.engine.model_runner.use_padded_decode()
    return llm


def count_padded_runs(llm) -> list[int]:
    """Record the size of every padded run the engine makes."""
    runner = llm.engine.model_runner
    sizes = []
    for size, run in list(runner.graphs.items()):
        def counted(size=size, run=run):
            sizes.append(size)
            run()
        runner.graphs[size] = counted
    return sizes


def test_capture_sizes_are_1_2_4_8_then_every_16_up_to_max_num_seqs():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4096)[-1] == model_runner.MAX_CAPTURE_SIZE


def test_padded_decode_steps_give_the_unpadded_tokens(alone):
    """Six prompts decoding together replay the padded run of 8, then (as they finish, at
    different lengths) of smaller sizes: every token is the one the unpadded path makes."""
    llm = padded()
    sizes = count_padded_runs(llm)
    params = [dataclasses.replace(GREEDY, max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    got = token_ids(llm.generate(PROMPTS, params))
    assert got == [want[:10 + 5 * i] for i, want in enumerate(alone)]
    assert 8 in sizes and min(sizes) < 8  # padded to 8, then to fewer as requests ended
    assert_no_leaks(llm.engine)


def test_padded_decode_keeps_seeded_and_penalized_samples():
    """Sampling runs outside the padded run: seeded samples with penalties are unchanged."""
    params = SamplingParams(max_tokens=12, seed=3, temperature=0.8, repetition_penalty=1.3,
                            ignore_eos=True)
    want = token_ids(tiny().generate(PROMPTS[:3], params))
    assert token_ids(padded().generate(PROMPTS[:3], params)) == want


def test_padding_writes_only_to_the_null_block():
    """A decode of 3 sequences padded to 4: the padding row writes its K/V to the null block
    (the cache's last, which the pool never hands out), and no block no sequence owns changes."""
    llm = padded()
    engine = llm.engine
    runner = engine.model_runner
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=4), str(i))
    engine.step()  # the prefills
    owned = {b for seq in engine.scheduler.running for b in seq.block_table.block_ids}
    free = [b for b in range(engine.block_pool.num_blocks) if b not in owned]
    before = runner.k_caches.clone()
    engine.step()  # a decode of 3, padded to 4
    assert runner.null_block == engine.block_pool.num_blocks == runner.k_caches.shape[1] - 1
    assert runner.k_caches[:, runner.null_block].abs().sum() > 0
    assert torch.equal(runner.k_caches[:, free], before[:, free])
    run_to_end(engine)
    assert_no_leaks(engine)


def test_prefills_and_mixed_steps_run_unpadded():
    llm = padded(max_num_batched_tokens=16)
    sizes = count_padded_runs(llm)
    engine = llm.engine
    engine.add_request("x" * 40, GREEDY, "long")  # three chunks of 16, 16 and 8
    engine.step()
    engine.add_request("ab", GREEDY, "short")
    engine.step()  # "long"'s second chunk beside "short"'s prompt
    assert sizes == []
    run_to_end(engine)


def test_decodes_come_first_in_the_flat_batch():
    """A step of a prompt chunk beside two decodes: the decodes' tokens first, num_decodes 2,
    whatever order the scheduler gave."""
    engine = tiny().engine
    for i in range(2):
        engine.add_request(PROMPTS[i], GREEDY, str(i))
    engine.step()
    engine.add_request(PROMPTS[2], GREEDY, "chunk")
    scheduled = engine.scheduler.schedule().num_scheduled_tokens
    reordered = dict(sorted(scheduled.items(), key=lambda item: item[1] == 1))  # chunk first
    batch = engine.model_runner._prepare_inputs(reordered)
    meta = batch.attn_metadata
    assert meta.num_decodes == 2
    assert meta.query_start_loc[:3].tolist() == [0, 1, 2]
    assert batch.sample_seqs[:2] == [seq for seq, num_new in scheduled.items() if num_new == 1]


def test_the_kv_cache_takes_what_gpu_memory_utilization_leaves():
    gib = 2**30
    left = int(80 * gib * 0.9) - 2 * gib - 3 * gib - gib // 4
    assert kv_cache_bytes(80 * gib, 2 * gib, 3 * gib, gib // 4, 0.9) == left
    with pytest.raises(ValueError, match="no GPU memory is left for the KV cache: "
                                         "gpu_memory_utilization 0.1"):
        kv_cache_bytes(80 * gib, 7 * gib, 2 * gib, 0, 0.1)


def profiled_kv_cache_tokens(runner, num_input_batches: int = 1) -> int:
    """The tokens FAKE_GPU's memory leaves a cache of runner's at gpu_memory_utilization 0.5
    (the draft's, if any, beside it: draft_kv_bytes_per_token), in whole blocks."""
    penalty_state = num_input_batches * runner.config.max_num_seqs * runner.vocab_size * 5
    budget = kv_cache_bytes(FAKE_GPU["total"], FAKE_GPU["used"], FAKE_GPU["peak"],
                            penalty_state, 0.5)
    num_tokens = budget // (runner.kv_bytes_per_token + runner.draft_kv_bytes_per_token)
    return num_tokens // runner.config.block_size * runner.config.block_size


def test_a_cuda_engine_sizes_its_kv_cache_from_a_profiled_forward(fake_cuda):
    """No kv_cache_tokens on CUDA: a forward of the token budget runs on a scratch cache (in
    the cache's dtype) under the memory profile, and the cache takes what it leaves."""
    llm = tiny(kv_cache_tokens=None, gpu_memory_utilization=0.5, enforce_eager=True)
    runner = llm.engine.model_runner
    assert len(fake_cuda.calls_to("profile_memory")) == 1
    assert llm.engine.kv_cache_tokens == profiled_kv_cache_tokens(runner) > 0


def test_the_cuda_path_gives_the_cpu_paths_tokens(fake_cuda, alone):
    """Every CUDA branch of a step, on the CPU: the cache sized by the profile, decode graphs
    captured largest first, each after the first sharing its memory pool, and replayed (the
    padded path), the inputs uploaded pinned, a pinned swap space: every token is the CPU
    path's."""
    llm = tiny(kv_cache_tokens=None, gpu_memory_utilization=0.5, max_num_seqs=8,
               preemption_mode="swap", swap_space=0.001)
    assert sorted(llm.engine.model_runner.graphs) == [1, 2, 4, 8]
    pools = [pool for (pool,) in fake_cuda.calls_to("capture_graph")]
    assert pools[0] is None and len(set(pools[1:])) == 1 and len(pools) == 4
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == alone
    assert fake_cuda.calls_to("pinned")
    assert len(fake_cuda.calls_to("pinned_empty")) == 2  # the swap space's K and V
    assert_no_leaks(llm.engine)


def test_a_draft_models_cache_is_sized_with_the_targets_from_one_profile(fake_cuda,
                                                                         monkeypatch, tmp_path):
    """A draft model on CUDA: loaded before the profile (its weights are in the memory used),
    one profile for both, the budget split over the two caches' bytes a token, the draft's
    cache as many tokens as the target's, and no swap space of its own."""
    save_checkpoint(load_model(None, "tiny", 1).model, str(tmp_path), dtype=torch.float32)
    real_load_draft = nanoserve.load_draft

    def load_draft(*args):
        fake_cuda.record("load_draft")
        return real_load_draft(*args)
    monkeypatch.setattr(nanoserve, "load_draft", load_draft)
    llm = tiny(kv_cache_tokens=None, gpu_memory_utilization=0.5, preemption_mode="swap",
               speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})
    target = llm.engine.model_runner
    draft = llm.engine.speculator.proposer.runner
    names = [call[0] for call in fake_cuda.calls if call[0] in ("load_draft", "profile_memory")]
    assert names == ["load_draft", "profile_memory"]
    assert target.draft_kv_bytes_per_token == draft.kv_bytes_per_token
    assert llm.engine.kv_cache_tokens == profiled_kv_cache_tokens(target, 2) > 0
    assert draft.block_pool.num_blocks == target.block_pool.num_blocks
    assert target.swap_space is not None and draft.swap_space is None


def test_prompt_logprobs_are_made_in_chunks_of_positions_with_the_same_values(monkeypatch):
    """A prompt's positions are scored PROMPT_LOGPROBS_CHUNK at a time (here 2), each chunk's
    logits made on their own, and every log-probability is the unchunked one's: the same
    tokens, the same values but for the last bits (the LM head's product over fewer rows sums
    in another order: 5e-7 apart here)."""
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=3)
    want = tiny().generate(PROMPTS[2:4], params)
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_CHUNK", 2)
    llm = tiny()
    runner = llm.engine.model_runner
    real_compute_logits = runner.compute_logits
    rows = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(len(hidden))
        return real_compute_logits(hidden)
    monkeypatch.setattr(runner, "compute_logits", compute_logits)
    got = llm.generate(PROMPTS[2:4], params)
    for ours, theirs in zip(got, want):
        positions = ours.prompt_logprobs[1:] + ours.outputs[0].logprobs
        wanted = theirs.prompt_logprobs[1:] + theirs.outputs[0].logprobs
        assert [list(top) for top in positions] == [list(top) for top in wanted]
        assert max(abs(top[token] - other[token]) for top, other in zip(positions, wanted)
                   for token in top) < 1e-5
    num_positions = sum(len(o.prompt_token_ids) - 1 for o in got)
    assert max(rows) == 2 and len(rows) >= num_positions / 2


@pytest.mark.parametrize("value", [0, 1.5, float("nan"), True, "0.9"])
def test_gpu_memory_utilization_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
        EngineConfig(preset="tiny", device="cpu", gpu_memory_utilization=value)


def test_the_limits_left_unset_take_the_devices_defaults():
    cpu = EngineConfig(preset="tiny", device="cpu")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 512)
    cuda = EngineConfig(preset="tiny", device="cpu")
    cuda.max_num_seqs = cuda.max_num_batched_tokens = None
    cuda._default_limits("cuda")
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == (256, 8192)
    given = EngineConfig(preset="tiny", device="cpu", max_num_seqs=3)
    assert given.max_num_seqs == 3


def test_nan_logits_fail_their_request_alone(alone, monkeypatch):
    """The model's hidden state turns NaN after the poisoned token (<|endoftext|>, an fp16
    overflow's stand-in): that request fails, saying so, and the others' tokens stay."""
    llm = tiny()
    engine = llm.engine
    real_forward = engine.model.forward

    def forward(input_ids, *args):
        hidden = real_forward(input_ids, *args)
        return hidden.masked_fill((input_ids == 256)[:, None], float("nan"))
    monkeypatch.setattr(engine.model, "forward", forward)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, GREEDY, str(i))
    engine.add_request("bad<|endoftext|>", GREEDY, "bad")
    deltas = run_to_end(engine)
    last = deltas["bad"][-1].outputs[0]
    assert last.finish_reason == "error" and "logits are NaN" in last.error
    got = [sum((d.outputs[0].token_ids for d in deltas[str(i)]), []) for i in range(3)]
    assert got == alone[:3]
    assert_no_leaks(engine)
