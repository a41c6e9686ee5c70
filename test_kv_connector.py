"""kv_connector.py's and disagg_proxy.py's guarantees: a decode instance that loads a prefill
instance's K/V answers as one instance would, token for token, computing only the prompt's
tokens after its last full block; a missing, truncated, corrupted or foreign entry is
recomputed, never used; the folder stays bounded; nothing is held afterwards. Two engines in
this process share a tmp_path folder; one test goes through the proxy and two servers.
"""
import json
import os
import threading

import pytest

from conftest import (GREEDY, PROMPTS, assert_no_leaks, http, nanoserve_main, parse_events,
                      run_to_end, server_in_process, tiny, token_ids)
import kv_connector
from disagg_proxy import DisaggProxy, ProxyConfig, prefill_body
from display import trace_mark
from kv_connector import (HEADER_LENGTH, MAGIC, SUFFIX, KVTransferConfig,
                          parse_kv_transfer_config)
from lora import LoRARequest, save_random_lora
from nanoserve import EngineConfig
from sampling import SamplingParams
from scheduler import SequenceStatus
import watch

SEEDED = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0)  # what the proxy asks a producer for
TIGHT = dict(kv_cache_tokens=192, max_num_batched_tokens=64)  # the consumer preempts
LONG = "ROMEO: But soft, what light through yonder window breaks? It is the east. " * 2


def kv_config(folder, role: str, **extra) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder)} | extra}


def produce(folder, prompts, **engine_args):
    """A producer that prefilled prompts (max_tokens 1, as the proxy asks): its engine."""
    producer = tiny(kv_transfer_config=kv_config(folder, "kv_producer"), **engine_args)
    producer.generate(prompts, PREFILL)
    return producer.engine


def consumer(folder, **engine_args):
    return tiny(kv_transfer_config=kv_config(folder, "kv_consumer"), **engine_args)


def entries(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(SUFFIX))


@pytest.fixture(scope="module")
def greedy_alone() -> list[list[int]]:
    return token_ids(tiny().generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def short_and_long_alone() -> list[list[int]]:
    """PROMPTS[1] and LONG, greedy, on one instance."""
    return token_ids(tiny().generate([PROMPTS[1], LONG], GREEDY))


# ----------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_consumer_outputs_equal_one_instance(tmp_path, params):
    want = token_ids(tiny().generate(PROMPTS, params))
    producer = produce(tmp_path, PROMPTS)
    llm = consumer(tmp_path)
    assert token_ids(llm.generate(PROMPTS, params)) == want
    assert llm.engine.stats.num_kv_loaded_tokens > 0
    assert_no_leaks(producer)
    assert_no_leaks(llm.engine)


def test_consumer_computes_only_the_tokens_after_the_last_full_block(tmp_path):
    """Block size 16: a 37-token prompt loads 32 and computes 5; a 32-token one loads 16 and
    computes 16 (its last token is always computed); one shorter than a block loads none."""
    prompts = [list(range(1, 38)), list(range(40, 72)), list(range(100, 111)), [5]]
    produce(tmp_path, prompts)
    engine = consumer(tmp_path).engine
    engine.step_records = []
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=str(i))
    run_to_end(engine)
    computed = dict.fromkeys(map(str, range(len(prompts))), 0)
    for record in engine.step_records:
        for seq_id, phase in record.phases.items():
            if phase == "prefill":
                computed[seq_id] += record.scheduled[seq_id]
    assert computed == {"0": 5, "1": 16, "2": 11, "3": 1}
    loaded = {seq_id: num for record in engine.step_records
              for seq_id, num in record.num_loaded_tokens.items()}
    assert loaded == {"0": 32, "1": 16}
    assert engine.stats.num_kv_loaded_tokens == 48
    assert_no_leaks(engine)


def test_a_producer_saves_whole_prompt_blocks_once(tmp_path):
    """Each full block of a prompt, once: the same prompt twice writes nothing new."""
    engine = produce(tmp_path, [list(range(1, 38)), list(range(1, 38))])
    assert len(entries(tmp_path)) == 2
    assert engine.stats.num_kv_saved_tokens == 32
    assert engine.stats.num_kv_loaded_tokens == 0  # a producer alone loads nothing


# ----------------------------------------------------------------------------- failures

def rewrite_header(path: str, **changes) -> None:
    """An entry with header fields changed, its payload (and checksum) as they were."""
    with open(path, "rb") as f:
        data = f.read()
    start = len(MAGIC) + HEADER_LENGTH.size
    (length,) = HEADER_LENGTH.unpack_from(data, len(MAGIC))
    header = json.loads(data[start:start + length]) | changes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + HEADER_LENGTH.pack(len(text)) + text + data[start + length:])


def remove(path: str) -> None:
    os.remove(path)


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def corrupt(path: str) -> None:
    """One bit of the last K/V byte flipped."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 1]))


def wrong_tokens(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    (length,) = HEADER_LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + HEADER_LENGTH.size
    tokens = json.loads(data[start:start + length])["token_ids"]
    rewrite_header(path, token_ids=tokens[::-1])


def wrong_shape(path: str) -> None:
    rewrite_header(path, shape=[4, 16, 2, 128])  # as many bytes, another model's shape


# Each way an entry goes bad, and whether the connector counts it as a failure (a missing
# entry is a miss, not a failure).
DAMAGE = {"missing": (remove, 0), "truncated": (truncate, 1), "corrupted": (corrupt, 1),
          "wrong_tokens": (wrong_tokens, 1), "wrong_shape": (wrong_shape, 1)}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_bad_entry_is_recomputed_and_counted(tmp_path, damage):
    """The prompt's second block's entry is damaged: its first block is loaded, the rest
    computed, the output exact."""
    want = token_ids(tiny().generate([LONG], GREEDY))
    prompt_ids = tiny().engine.tokenizer.encode(LONG)
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path).engine
    damaged, failures = DAMAGE[damage]
    second = engine.kv_connector._keys(new_waiting(engine, prompt_ids), 2)
    key = list(second)[1][1]
    damaged(os.path.join(tmp_path, key.block_hash.hex() + SUFFIX))
    engine.add_request(prompt_ids, GREEDY, request_id="0", stream=False)
    deltas = run_to_end(engine)
    assert deltas["0"][-1].outputs[0].token_ids == want[0]
    assert engine.stats.num_kv_loaded_tokens == 16
    assert engine.stats.num_kv_load_failures == failures
    assert_no_leaks(engine)


def test_an_entry_removed_after_the_match_is_computed(tmp_path, monkeypatch):
    """Another instance trims the folder between the match and the read: the prompt's second
    block is computed, not counted as a failure, and the output is exact."""
    want = token_ids(tiny().generate([LONG], GREEDY))
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path).engine
    read = kv_connector.read_entry
    second = []

    def trimmed_first(path, key):
        if key.parent_hash:  # the second block's entry onwards: gone
            second.append(path)
            os.remove(path)
        return read(path, key)
    monkeypatch.setattr(kv_connector, "read_entry", trimmed_first)
    engine.add_request(LONG, GREEDY, request_id="0", stream=False)
    deltas = run_to_end(engine)
    assert second and deltas["0"][-1].outputs[0].token_ids == want[0]
    assert engine.stats.num_kv_loaded_tokens == 16
    assert engine.stats.num_kv_load_failures == 0
    assert_no_leaks(engine)


def new_waiting(engine, prompt_ids):
    """A sequence of prompt_ids as the engine would make it (for its entries' keys)."""
    return engine._sample_sequence("probe", 0, None, prompt_ids, GREEDY, False)


@pytest.mark.parametrize("producer_args", [dict(dtype="bfloat16"), dict(seed=1),
                                           dict(quantization="int8")],
                         ids=["other_dtype", "other_model", "other_quantization"])
def test_another_models_or_dtypes_entries_are_recomputed(tmp_path, producer_args,
                                                         greedy_alone):
    """A producer in bfloat16, with other weights or int8 ones, writes under the same block
    hashes: the float32 consumer of other weights refuses every entry and computes."""
    produce(tmp_path, PROMPTS, **producer_args)
    llm = consumer(tmp_path)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    assert llm.engine.stats.num_kv_loaded_tokens == 0
    assert llm.engine.stats.num_kv_load_failures > 0
    assert_no_leaks(llm.engine)


def test_an_interrupted_write_leaves_no_entry(tmp_path, monkeypatch):
    """Written under a temporary name and renamed: a write that fails before the rename leaves
    neither the entry nor its temporary file."""
    def fail(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        produce(tmp_path, [LONG])
    assert os.listdir(tmp_path) == []


def test_an_entry_appears_under_its_name_only_whole(tmp_path, monkeypatch):
    """Each entry is renamed into place complete: at the rename its name is not taken yet and
    the temporary file holds every byte, so a reader never opens half of one."""
    renames = []
    replace = os.replace

    def checked(source, destination):
        assert not os.path.exists(destination)
        renames.append((os.path.basename(destination), os.path.getsize(source)))
        replace(source, destination)
    monkeypatch.setattr(os, "replace", checked)
    produce(tmp_path, [LONG])
    assert sorted(renames) == [(name, os.path.getsize(tmp_path / name))
                               for name in entries(tmp_path)]
    assert len(renames) == len(LONG) // 16


def test_the_folder_keeps_the_newest_max_entries(tmp_path):
    produce(tmp_path, [list(range(1, 50))])  # 3 blocks
    oldest = entries(tmp_path)
    producer = tiny(kv_transfer_config=kv_config(tmp_path, "kv_producer", max_entries=4))
    producer.generate([list(range(60, 93))], PREFILL)  # 2 blocks more: 5, over by one
    left = entries(tmp_path)
    assert len(left) == 4 and set(oldest) - set(left)


# ----------------------------------------------------------------------------- on the consumer

def test_n_samples_on_the_consumer_equal_one_instance(tmp_path):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    want = tiny().generate(PROMPTS, params)
    produce(tmp_path, PROMPTS)
    llm = consumer(tmp_path)
    got = llm.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    # each prompt loaded once: its other samples wait for the first's load, then take its
    # blocks from the prefix cache
    tokenizer = llm.engine.tokenizer
    assert llm.engine.stats.num_kv_loaded_tokens == sum(
        16 * ((len(tokenizer.encode(prompt)) - 1) // 16) for prompt in PROMPTS)
    assert_no_leaks(llm.engine)


def test_the_prefix_cache_serves_a_repeated_prompt_on_the_consumer(tmp_path, greedy_alone):
    """The second time a prompt comes, its blocks are in the consumer's own prefix cache: it
    loads nothing more."""
    produce(tmp_path, PROMPTS)
    llm = consumer(tmp_path)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    loaded = llm.engine.stats.num_kv_loaded_tokens
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    assert llm.engine.stats.num_kv_loaded_tokens == loaded
    assert llm.engine.stats.num_cached_tokens == loaded
    assert_no_leaks(llm.engine)


def test_a_prefix_cache_hit_then_loaded_blocks(tmp_path):
    """A prompt whose first block the consumer holds and whose next two it loads."""
    first, longer = list(range(1, 20)), list(range(1, 50))
    want = token_ids(tiny().generate([first, longer], GREEDY))
    llm = consumer(tmp_path)
    assert token_ids(llm.generate([first], GREEDY)) == want[:1]  # the folder is empty
    produce(tmp_path, [longer])
    assert token_ids(llm.generate([longer], GREEDY)) == want[1:]
    assert llm.engine.stats.num_cached_tokens == 16
    assert llm.engine.stats.num_kv_loaded_tokens == 32
    assert_no_leaks(llm.engine)


def test_preemption_on_the_consumer_keeps_outputs_exact(tmp_path, greedy_alone):
    produce(tmp_path, PROMPTS)
    llm = consumer(tmp_path, **TIGHT)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.num_kv_loaded_tokens > 0
    assert_no_leaks(llm.engine)


def test_ngram_speculation_on_the_consumer_keeps_outputs_exact(tmp_path, greedy_alone):
    produce(tmp_path, PROMPTS)
    llm = consumer(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "disable_by_batch_size": 64})
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    assert llm.engine.stats.spec_decode_num_drafts > 0
    assert llm.engine.stats.num_kv_loaded_tokens > 0
    assert_no_leaks(llm.engine)


@pytest.fixture
def held_reads(monkeypatch):
    """The entries' reads wait until the test sets the event it yields (at most 5 s: on a
    synchronous load, the step itself would wait)."""
    release = threading.Event()
    read = kv_connector.read_entry

    def held(*args):
        release.wait(5)
        return read(*args)
    monkeypatch.setattr(kv_connector, "read_entry", held)
    yield release
    release.set()


def test_the_others_decode_while_a_load_is_read(tmp_path, held_reads,
                                                short_and_long_alone):
    """A long prompt's K/V are read in the background: the request waits for them, its
    blocks taken (WAITING_FOR_REMOTE_KVS), while the running one samples a token every step;
    then it runs from past them, and both answer as one instance does."""
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path).engine
    engine.add_request(PROMPTS[1], GREEDY, request_id="short", stream=False)
    engine.step()
    engine.add_request(LONG, GREEDY, request_id="long", stream=False)
    for _ in range(3):
        engine.step()
        assert engine.last_step.sampled == ["short"]
    long = engine.seqs["long"]
    assert long.status == SequenceStatus.WAITING_FOR_REMOTE_KVS and long.block_table.block_ids
    held_reads.set()
    deltas = run_to_end(engine)
    assert [deltas[name][-1].outputs[0].token_ids for name in ("short", "long")] == \
        short_and_long_alone
    assert engine.stats.num_kv_loaded_tokens == 16 * ((len(long.prompt_token_ids) - 1) // 16)
    assert_no_leaks(engine)


def test_an_idle_step_waits_for_a_load_a_bounded_time(tmp_path, held_reads):
    """With nothing else to run a step waits for the load, but not for a stuck one: it
    returns (and lets an abort take the engine's lock) with the request still loading."""
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path).engine
    engine.add_request(LONG, GREEDY, request_id="long")
    engine.step()
    engine.step()
    assert engine.seqs["long"].status == SequenceStatus.WAITING_FOR_REMOTE_KVS
    held_reads.set()
    run_to_end(engine)
    assert_no_leaks(engine)


def test_a_request_aborted_while_loading_frees_its_blocks(tmp_path, held_reads,
                                                          short_and_long_alone):
    """Aborted while its K/V are read: its blocks are free at once (the reading thread writes
    none), its load forgotten, and the engine serves on, exact."""
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path).engine
    engine.add_request(LONG, GREEDY, request_id="long")
    engine.step()
    assert engine.seqs["long"].status == SequenceStatus.WAITING_FOR_REMOTE_KVS
    engine.abort("long")
    (output,) = engine.step()
    assert output.outputs[0].finish_reason == "abort"
    assert_no_leaks(engine)
    assert not engine.kv_connector.loads  # forgotten: never copied into freed blocks
    held_reads.set()
    for name, prompt in (("short", PROMPTS[1]), ("again", LONG)):
        engine.add_request(prompt, GREEDY, request_id=name, stream=False)
    deltas = run_to_end(engine)
    assert [deltas[name][-1].outputs[0].token_ids for name in ("short", "again")] == \
        short_and_long_alone
    assert_no_leaks(engine)


def test_a_sequence_swapped_out_as_its_load_finishes_keeps_its_k_v(tmp_path, held_reads,
                                                                   short_and_long_alone):
    """12 blocks of 16: a short request (11 + 40 tokens) runs while a long prompt's 9 blocks
    load. The load finishes in the step the short one needs its 4th block, none free: the
    long one, the newest running, is swapped out in that step; its K/V are copied into its
    blocks before the swap copies them out, and both answer as one instance does."""
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path, kv_cache_tokens=192, preemption_mode="swap").engine
    engine.add_request(PROMPTS[1], GREEDY, request_id="short", stream=False)
    engine.add_request(LONG, GREEDY, request_id="long", stream=False)
    short, long = engine.seqs["short"], engine.seqs["long"]
    deltas = run_to_end(engine, steps=1)
    while short.num_computed_tokens < 48:  # its next token needs a 4th block
        run_to_end(engine, deltas, steps=1)
    held_reads.set()
    engine.kv_connector.loads[long].future.result()
    run_to_end(engine, deltas, steps=1)
    assert engine.last_step.swapped_out == ["long"]
    run_to_end(engine, deltas)
    assert [deltas[name][-1].outputs[0].token_ids for name in ("short", "long")] == \
        short_and_long_alone
    assert_no_leaks(engine)


def test_loading_requests_count_against_max_num_seqs(tmp_path, greedy_alone):
    """Two sequence slots: a request loading its K/V holds one, so at most two run at once
    when the loads finish."""
    produce(tmp_path, PROMPTS)
    llm = consumer(tmp_path, max_num_seqs=2)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy_alone
    assert llm.engine.stats.peak_batch_size == 2
    assert_no_leaks(llm.engine)


def test_a_loading_request_holds_its_lora_adapters_slot(tmp_path):
    """One adapter slot, two adapters' requests: while the first loads its K/V, the second is
    passed over (else both would run in one step with one slot). Each loads its own entries
    (the adapter salts the hash chain) and answers as one instance does."""
    model = tiny().engine.model
    adapters = []
    for lora_id in (1, 2):
        path = str(tmp_path / f"adapter{lora_id}")
        save_random_lora(path, model, ["c_attn", "c_proj", "c_fc"], r=8, seed=lora_id)
        adapters.append(LoRARequest(f"adapter{lora_id}", lora_id, path))
    args = dict(enable_lora=True, max_loras=1)
    want = tiny(**args).generate([LONG, LONG], GREEDY, lora_request=adapters)
    producer = tiny(kv_transfer_config=kv_config(tmp_path / "kv", "kv_producer"), **args)
    producer.generate([LONG, LONG], PREFILL, lora_request=adapters)
    llm = consumer(tmp_path / "kv", **args)
    assert token_ids(llm.generate([LONG, LONG], GREEDY, lora_request=adapters)) == \
        token_ids(want)
    num_prompt_tokens = len(llm.engine.tokenizer.encode(LONG))
    assert llm.engine.stats.num_kv_loaded_tokens == 2 * 16 * ((num_prompt_tokens - 1) // 16)
    assert_no_leaks(llm.engine)


def test_the_trace_and_the_watch_page_mark_loaded_tokens(tmp_path):
    produce(tmp_path, [LONG])
    engine = consumer(tmp_path).engine
    engine.step_records = []
    engine.add_request(LONG, GREEDY, request_id="r")
    engine.step()  # admitted: its blocks taken, its K/V read in the background
    assert trace_mark("r", engine.step_records[0]) == "."
    (waiting,) = watch.frame(engine)["waiting"]  # the page shows whose blocks they are
    assert waiting["id"] == "r" and waiting["blocks"] == engine.seqs["r"].block_table.block_ids
    while engine.seqs["r"].status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
        engine.step()  # nothing else to run: waits for them, copies them in, runs the rest
    assert trace_mark("r", engine.step_records[-1]) == "k"
    num_prompt_tokens = engine.seqs["r"].num_prompt_tokens
    assert watch.frame(engine)["running"][0]["loaded"] == 16 * ((num_prompt_tokens - 1) // 16)
    run_to_end(engine)


# ----------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "unknown kv_connector"),
    ({"kv_connector": "ExampleConnector", "kv_role": "decode"}, "unknown kv_role"),
    ({"kv_connector": "ExampleConnector", "kv_role": "kv_both"}, "needs shared_storage_path"),
    ({"kv_role": "kv_both"}, "needs kv_connector"),
    ({"kv_connector": "ExampleConnector", "kv_role": "kv_both", "extra": 1}, "unknown key"),
    (kv_config("/tmp/x", "kv_both", max_entries=True), "max_entries must be an integer"),
    (kv_config("/tmp/x", "kv_both", max_bytes=0), "max_bytes must be an integer"),
    (kv_config("/tmp/x", "kv_both", path=1), "unknown kv_connector_extra_config key 'path'"),
    (kv_config("/tmp/x", "kv_both") | {"kv_load_failure_policy": "fail"}, "must be recompute"),
    ("{not json", "is not JSON"), ("[]", "must be a JSON object")])
def test_a_bad_kv_transfer_config_is_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(preset="tiny", kv_transfer_config=config)


def test_vllms_earlier_connector_name_and_json_text_are_accepted(tmp_path):
    text = json.dumps(kv_config(tmp_path, "kv_both") | {"kv_connector": "SharedStorageConnector"})
    config = parse_kv_transfer_config(text)
    assert isinstance(config, KVTransferConfig) and config.is_producer and config.is_consumer


def test_the_command_line_takes_kv_transfer_config_as_json(capsys, tmp_path):
    config = json.dumps(kv_config(tmp_path, "kv_producer"))
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--kv-transfer-config", config,
                                    "--prompt", LONG, "--max-tokens", "1")
    assert status == 0 and len(entries(tmp_path)) == len(LONG) // 16
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--kv-transfer-config",
                                    '{"kv_connector": "ExampleConnector"}', "--prompt", "x")
    assert status == 2 and err == "error: kv_transfer_config needs kv_role\n"


def test_the_command_line_refuses_proxy_flags_without_the_proxy(capsys):
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--decode", "http://a:1")
    assert status == 2 and err == "error: --prefill and --decode are the instances of " \
                                  "--disagg-proxy\n"
    status, _, err = nanoserve_main(capsys, "--disagg-proxy", "--prefill", "http://a:1")
    assert status == 2 and err == "error: --disagg-proxy needs at least one --decode URL\n"
    status, _, err = nanoserve_main(capsys, "--disagg-proxy", "--prefill", "a:1", "--decode",
                                    "http://b:2")
    assert status == 2 and "give an instance's base URL" in err


# ----------------------------------------------------------------------------- the proxy

def test_the_prefill_request_asks_one_token_of_one_sample_unstreamed():
    body = {"prompt": "x", "max_tokens": 50, "n": 2, "stream": True, "min_tokens": 5,
            "stream_options": {"include_usage": True}, "seed": 1, "temperature": 0.5}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "seed": 1, "temperature": 0.5}


def test_the_proxy_takes_instances_in_turn():
    proxy = DisaggProxy(ProxyConfig(["http://p1:1", "http://p2:2"],
                                    ["http://d1:1", "http://d2:2", "http://d3:3"], port=0))
    try:
        pairs = [proxy.next_instances() for _ in range(3)]
    finally:
        proxy.server_close()
    assert pairs == [(("p1", 1), ("d1", 1)), (("p2", 2), ("d2", 2)), (("p1", 1), ("d3", 3))]


def test_outputs_through_the_proxy_equal_one_instance(tmp_path):
    """A producer server and a consumer server behind the proxy: greedy and seeded, whole and
    streamed, as one instance answers them; the consumer loaded the prompt."""
    alone = tiny().engine
    producer = tiny(kv_transfer_config=kv_config(tmp_path, "kv_producer")).engine
    decoder = tiny(kv_transfer_config=kv_config(tmp_path, "kv_consumer")).engine
    bodies = [{"prompt": LONG, "max_tokens": 8, "temperature": 0},
              {"prompt": LONG + "JULIET:", "max_tokens": 8, "temperature": 1.0, "seed": 5}]
    with server_in_process(alone) as alone_url, server_in_process(producer) as prefill_url, \
            server_in_process(decoder) as decode_url:
        proxy = DisaggProxy(ProxyConfig([prefill_url], [decode_url], port=0))
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            for body in bodies:
                want = http(alone_url, "/v1/completions", body)[1]["choices"][0]["text"]
                status, whole = http(proxy.url, "/v1/completions", body)
                assert status == 200 and whole["choices"][0]["text"] == want
                status, text = http(proxy.url, "/v1/completions", body | {"stream": True})
                events = parse_events(text)
                assert status == 200 and events[-1] == "[DONE]"
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
            metrics = http(proxy.url, "/metrics")[1]  # other paths: the decode instance's
        finally:
            proxy.shutdown()
            proxy.server_close()
            thread.join(30)
    assert proxy.num_prefill_failures == 0
    assert f"nanoserve:kv_load_tokens_total {decoder.stats.num_kv_loaded_tokens}\n" in metrics
    assert decoder.stats.num_kv_loaded_tokens >= 16 * ((len(LONG) - 1) // 16)
    assert producer.stats.num_kv_saved_tokens > 0
    assert producer.stats.num_generated_tokens == 2 * len(bodies)  # one token a request
    for engine in (producer, decoder):
        assert_no_leaks(engine)
