"""The persistent batch's guarantees: a step's host work is what is new in it (the blocks a
table gained, the tokens a penalised sequence gained), and a row left behind is reused empty.
"""
import pytest
import torch

import input_batch
from conftest import GREEDY, assert_no_leaks, tiny
from input_batch import InputBatch
from sampling import SamplingParams


def uploaded_block_ids(engine, monkeypatch) -> list[int]:
    """Every block id the engine's steps will upload into the input batch's tables."""
    uploaded = []
    step_block_tables = engine.model_runner.input_batch.step_block_tables

    def recording(rows, new_rows, new_columns, new_block_ids, max_num_blocks):
        uploaded.append(len(new_block_ids))
        return step_block_tables(rows, new_rows, new_columns, new_block_ids, max_num_blocks)
    monkeypatch.setattr(engine.model_runner.input_batch, "step_block_tables", recording)
    return uploaded


def test_a_step_uploads_only_the_blocks_a_table_gained(monkeypatch):
    """Two 40-token prompts in blocks of 8, 24 tokens each: each sequence's 5 prompt blocks
    go up once, then one block every 8 decodes; 64 tokens, 8 blocks a sequence in all."""
    engine = tiny(block_size=8).engine
    uploaded = uploaded_block_ids(engine, monkeypatch)
    for prompt in ([5] * 40, [6] * 40):
        engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert uploaded[0] == 2 * 5  # the prompts' blocks, in the step that computes them
    assert sum(uploaded) == 2 * 8  # every block once: a decode step uploads none or the new
    assert max(uploaded[1:]) <= 2
    assert_no_leaks(engine)


def test_block_tables_are_as_the_block_tables_say_padded_with_block_0_to_16_columns():
    """_prepare_inputs's example, in the order the scheduler gives: each row of the step's
    tables is its sequence's blocks, then zeros, 16 columns wide."""
    engine = tiny(block_size=4).engine
    for prompt in ([1] * 7, [2] * 10, [3] * 2):
        engine.add_request(prompt, GREEDY)
    batch = engine.model_runner._prepare_inputs(engine.scheduler.schedule().num_scheduled_tokens)
    tables = batch.attn_metadata.block_tables
    seqs = list(engine.scheduler.running)
    assert tables.dtype == torch.int32 and tables.shape == (3, 16)
    for row, seq in zip(tables.tolist(), seqs):
        num_blocks = len(seq.block_table.block_ids)
        assert row[:num_blocks] == seq.block_table.block_ids and not any(row[num_blocks:])


def test_a_row_is_reused_empty_after_its_sequence_finishes(monkeypatch):
    """A long sequence's row, handed to a short one after it, holds only the short one's
    block: what the long one left is zeroed (the tables are padded with block 0)."""
    engine = tiny(block_size=4, max_num_seqs=1).engine
    tables = []
    held = []  # the running sequence's own blocks at each step
    step_block_tables = engine.model_runner.input_batch.step_block_tables

    def recording(*args):
        table = step_block_tables(*args)
        tables.append(table[0].tolist())
        held.append(list(engine.scheduler.running[0].block_table.block_ids))
        return table
    monkeypatch.setattr(engine.model_runner.input_batch, "step_block_tables", recording)
    engine.add_request([1] * 30, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.add_request([2] * 3, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.model_runner.input_batch.block_tables.shape[0] == 1  # one row: the short one took it
    assert sum(1 for b in tables[0] if b) >= 7  # (block 0 may be one of the long one's)
    assert sum(1 for b in tables[-1][1:] if b) == 0
    assert tables[-1][:1] == held[-1]  # the short one's block, written into the row afresh
    assert_no_leaks(engine)


def test_penalty_state_takes_a_sequences_tokens_once_then_nothing_from_the_host(monkeypatch):
    """A penalised sequence's 50 prompt tokens go up once, in its first sampling step; after
    that a step uploads only its row: the tokens it samples are counted on the device."""
    engine = tiny().engine
    uploads = []  # per upload by the input batch: its lists' names and lengths
    upload = input_batch.upload

    def recording(host_lists, dtype, device):
        uploads.append({name: len(values) for name, values in host_lists.items()})
        return upload(host_lists, dtype, device)
    monkeypatch.setattr(input_batch, "upload", recording)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            repetition_penalty=1.3)
    engine.add_request([7] * 50, params)
    while engine.has_unfinished():
        engine.step()
    first_step = [dict(rows=1, seen_rows=50, seen_ids=50, output_rows=0, output_ids=0),
                  dict(presence=1, frequency=1, repetition=1), dict(rows=1)]
    assert uploads == first_step + [dict(rows=1)] * 11
    assert_no_leaks(engine)


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.5),
                                     dict(frequency_penalty=1.0, presence_penalty=0.5)])
def test_penalty_state_survives_preemption_and_row_reuse(penalty):
    """Penalised greedy requests in a cache small enough to preempt, their rows freed and
    taken by others: each equals itself served alone."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, **penalty)
    prompts = [[5 + i] * (20 + 3 * i) for i in range(6)]
    alone = [tiny().generate([p], params)[0].outputs[0].token_ids for p in prompts]
    llm = tiny(kv_cache_tokens=160, block_size=8, max_num_seqs=3)
    together = llm.generate(prompts, params)
    assert [out.outputs[0].token_ids for out in together] == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


@pytest.mark.allows_fallback
def test_a_batch_that_fails_after_taking_new_blocks_leaves_no_row_behind(monkeypatch):
    """The batch fails between taking its new blocks and writing them on the device: each
    sequence, run again alone (as a failed batch is), starts from a new row holding its whole
    table, so every request's tokens are those it makes alone."""
    prompts = [[5 + i] * (20 + 7 * i) for i in range(3)]
    alone = [tiny().generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm = tiny(block_size=8)
    step_block_tables = llm.engine.model_runner.input_batch.step_block_tables
    calls = []

    def failing_once(*args):
        calls.append(len(args[0]))
        if len(calls) == 1:
            raise RuntimeError("the device table was not written")
        return step_block_tables(*args)
    monkeypatch.setattr(llm.engine.model_runner.input_batch, "step_block_tables", failing_once)
    outputs = llm.generate(prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == alone
    assert calls[:4] == [3, 1, 1, 1]  # the batch of 3 failed, then each alone
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("running_penalty", [dict(presence_penalty=0.5),
                                             dict(repetition_penalty=1.5)],
                         ids=["presence", "repetition"])
def test_a_row_left_by_a_penalised_sequence_penalises_nothing_for_its_next_owner(
        running_penalty):
    """Two rows. A penalised request runs throughout; a second, with a strong repetition
    penalty, finishes, and an unpenalised one takes its row while the first still samples
    with penalties: the unpenalised one's tokens are those it makes alone. With a repetition
    penalty running, the step reads the row's repetition value, which must be back to 1."""
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = tiny().generate([[9] * 12], plain)[0].outputs[0].token_ids
    llm = tiny(max_num_seqs=2)
    engine = llm.engine
    engine.add_request([5] * 20, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                **running_penalty))
    engine.add_request([9] * 12, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                repetition_penalty=3.0))
    engine.add_request([9] * 12, plain, request_id="plain")
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in engine.step() if out.request_id == "plain"]
    assert [t for out in outputs for t in out.outputs[0].token_ids] == alone
    assert_no_leaks(engine)


def test_slot_of_a_token_follows_its_block_table():
    """paged_cache.py's example: block table [7, 2, 9], block size 16: token 36 -> slot 148;
    tokens 15 and 16 straddle blocks 7 and 2 -> 127 and 32. Read from a row of the device
    tables, whichever row the sequence holds."""
    batch = InputBatch(max_num_seqs=2, max_model_len=64, block_size=16, vocab_size=8,
                       device="cpu")
    batch.block_tables[1, :3] = torch.tensor([7, 2, 9])
    slots = batch.slot_mapping(torch.tensor([1, 1, 1]), torch.tensor([36, 15, 16]))
    assert slots.tolist() == [148, 127, 32] and slots.dtype == torch.int64

