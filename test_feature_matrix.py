"""Where features meet: one batch of mixed requests (greedy, seeded, n = 2, penalties with
logprobs, a stop string, min_tokens, a structured choice, a beam search; mixed priorities)
served under a generated set of engine configurations crossing speculation, policy, preemption
mode, a tight KV cache, a small token budget, the prefix cache and quantization. In each: every
request's tokens are its own alone under the same configuration; greedy tokens (and beams) are
the plain engine's (of the same quantization); with drafts (n-gram or a draft model) seeded
tokens are the plain engine's too; nothing is held afterwards.

Beam search is a request of the batch wherever it runs: without speculation, which meets every
level of every other factor in the pairwise set. With speculation the engine refuses it, and
the refusal and its message are what is checked; the refusals outside the factors (policy
static, tensor parallelism, structured output over HTTP) are checked at the end, LoRA's over
HTTP in test_lora.py.

CI runs a pairwise set (all_pairs: every two levels of any two factors meet in some
configuration); NANOSERVE_FULL_MATRIX=1 runs the whole product. Each configuration is served
once (served_under), and the tests below read what it did, one property each.
"""
import collections
import importlib.util
import itertools
import os
from dataclasses import dataclass

import pytest
import torch

from beam_search import BeamSearchParams
from checkpoint import load_model, save_checkpoint
from conftest import assert_no_leaks, http, server_in_process, tiny
from nanoserve import Engine, EngineConfig, RequestOutput, accumulate
from sampling import SamplingParams
from structured_output import StructuredOutputsParams

# Each factor's levels, the first its plainest. The ids of the tests name them in this order.
FACTORS = {
    "spec": ("none", "ngram", "ngram_any_batch", "draft"),
    "policy": ("fcfs", "sjf", "priority"),
    "preemption": ("recompute", "swap", "auto"),
    "kv": ("roomy_kv", "tight_kv"),
    "budget": ("large_budget", "small_budget"),
    "prefix": ("prefix_cache", "no_prefix_cache"),
    "quant": ("unquantized", "int8", "fp8_kv"),
    # disaggregated prefill (kv_connector.py): the engine a consumer of a producer's folder,
    # which holds each prompt's full blocks (the section "disaggregation" below)
    "disagg": ("one_instance", "kv_consumer"),
}
# Short prompts and outputs of up to 16 tokens: the sequences admitted on a tight cache
# outgrow it whatever the policy (admission counts a running sequence's prompt, not its output)
PROMPTS = ["ROMEO: ROMEO: ", "Hello there", "x" * 12, "0123456789" * 2, "A", "ROMEO:"]
BLOCK_SIZE = 4
QUANTIZATION = {"unquantized": {}, "int8": dict(quantization="int8"),
                "fp8_kv": dict(kv_cache_dtype="fp8")}  # fp8 weights: test_quantization.py
KV_CACHE_TOKENS = {"roomy_kv": 4096, "tight_kv": 64}  # 16 blocks: the batch needs ~45
MAX_NUM_BATCHED_TOKENS = {"large_budget": 512, "small_budget": 8}  # 8: prompts chunk
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # drafts while at most 4 sequences run (a CPU's default)
ANY_BATCH = {"disable_by_batch_size": 1024}
CHOICES = ["Montague", "Capulet", "a plague"]  # each well within max_tokens
SPEC_REFUSED = "beam search does not run with speculative decoding"
HAS_LLGUIDANCE = importlib.util.find_spec("llguidance") is not None


def all_pairs(factors: dict[str, tuple]) -> list[dict[str, str]]:
    """Configurations (factor -> level) in which every level of each factor meets every level
    of each other factor at least once: far fewer than the product (here 14 of 864).

    Greedy and deterministic: each new configuration starts from the first pair not yet
    covered (factors in the order given, levels in theirs), then gives each other factor, in
    order, the level that covers the most uncovered pairs with the levels chosen so far
    (the first such level on a tie). Each configuration covers at least that first pair, so
    the loop ends."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}
    configs = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda pair: pair_order(factors, pair))
        config = {a: x, b: y}
        for name in names:
            if name not in config:
                config[name] = max(factors[name], key=lambda level: (
                    num_covered(config, name, level, uncovered), -factors[name].index(level)))
        config = {name: config[name] for name in names}
        uncovered -= set(itertools.combinations(config.items(), 2))
        configs.append(config)
    return configs


def pair_order(factors: dict[str, tuple], pair: tuple) -> tuple:
    """A pair's place in the order of the factors and of their levels."""
    names = list(factors)
    return tuple(x for name, level in pair for x in (names.index(name),
                                                     factors[name].index(level)))


def num_covered(config: dict[str, str], name: str, level: str, uncovered: set) -> int:
    """How many uncovered pairs setting factor `name` to `level` would cover with config's."""
    return sum(((other, chosen), (name, level)) in uncovered or
               ((name, level), (other, chosen)) in uncovered
               for other, chosen in config.items())


def configurations() -> list[dict[str, str]]:
    if os.environ.get("NANOSERVE_FULL_MATRIX") == "1":
        return [dict(zip(FACTORS, levels)) for levels in itertools.product(*FACTORS.values())]
    return all_pairs(FACTORS)


def config_id(config: dict[str, str]) -> str:
    """ngram-sjf-swap-tight_kv-small_budget-prefix_cache: where a failure's features meet."""
    return "-".join(config.values())


CONFIGS = configurations()
SPECULATIVE_CONFIGS = [c for c in CONFIGS if c["spec"] != "none"]


# ----------------------------------------------------------------------------- the batch

@dataclass
class Request:
    name: str          # its request id
    prompt: str
    params: SamplingParams | BeamSearchParams
    priority: int

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature == 0


def mixed_requests() -> list[Request]:
    """The batch: one request of each kind, priorities 0 to 2 mixed, prompts of 1 to 20
    tokens (up to 5 blocks, most longer than the small budget, some repetitive enough for
    n-gram drafts)."""
    def params(**kwargs) -> SamplingParams:
        return SamplingParams(**(dict(max_tokens=16, ignore_eos=True) | kwargs))
    requests = [
        # nearly greedy on a repeated prompt: the n-gram proposer drafts for it
        Request("n2_seeded", PROMPTS[2], params(n=2, temperature=0.1, top_p=0.9, seed=5), 2),
        Request("greedy", PROMPTS[3], params(temperature=0), 1),
        Request("seeded_penalties_logprobs", PROMPTS[0],
                params(temperature=0.7, seed=9, frequency_penalty=1.0, presence_penalty=0.5,
                       repetition_penalty=1.3, logprobs=2), 1),
        # its greedy output is "\x7fbccccc...": it stops after the 5th token
        Request("stop_string", PROMPTS[1], params(temperature=0, stop=["ccc"]), 0),
        # end-of-text (256) biased up: it comes as soon as min_tokens lets it
        Request("min_tokens", PROMPTS[4], params(temperature=0, min_tokens=8,
                                                 logit_bias={256: 8.0}, ignore_eos=False), 2),
    ]
    # two beams of 8 tokens on an 11-token prompt: 10 blocks unshared, within a tight cache's 16
    requests.append(Request("beam_search", PROMPTS[1], BeamSearchParams(
        beam_width=2, max_tokens=8, ignore_eos=True), 1))
    if HAS_LLGUIDANCE:
        requests.append(Request("choice", PROMPTS[5], params(
            temperature=1.0, seed=6, ignore_eos=False,
            structured_outputs=StructuredOutputsParams(choice=CHOICES)), 0))
    return requests


def engine_args(config: dict[str, str], draft_path: str) -> dict:
    spec = {"none": None, "ngram": NGRAM, "ngram_any_batch": NGRAM | ANY_BATCH,
            "draft": {"model": draft_path, "num_speculative_tokens": 3} | ANY_BATCH}
    return dict(speculative_config=spec[config["spec"]], policy=config["policy"],
                preemption_mode=config["preemption"], block_size=BLOCK_SIZE,
                kv_cache_tokens=KV_CACHE_TOKENS[config["kv"]],
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS[config["budget"]],
                enable_prefix_caching=config["prefix"] == "prefix_cache",
                **QUANTIZATION[config["quant"]])


def samples(output: RequestOutput) -> list[list[int]]:
    return [completion.token_ids for completion in output.outputs]


@dataclass
class Served:
    """What serving the batch under one configuration did: each request's whole output in the
    batch and alone (by name), what the engine held after each, and what it went through."""
    batch: dict[str, RequestOutput]
    alone: dict[str, RequestOutput]
    held: list[str]             # assert_no_leaks' failures after the batch and after alone
    refused: dict[str, str]     # the requests the engine refused (by name): the message
    num_fallbacks: int          # steps whose batch failed and ran one sequence at a time
    num_preemptions: int
    num_swapped_out: int
    num_accepted_tokens: int
    num_cached_tokens: int
    num_prefill_chunks: int     # prefill steps of a sequence past its first
    num_forks: int              # beams forked (beam search)
    dtypes: tuple               # the first projection's weight and the KV cache's
    num_kv_loaded_tokens: int = 0  # disaggregation: prompt tokens loaded from the folder


def serve(engine: Engine, requests: list[Request], chunks: list[int] | None = None,
          refused: dict[str, str] | None = None) -> dict[str, RequestOutput]:
    """Serve requests as one batch to the end: each one's whole output, by name. chunks, if
    given, gets the number of prefill steps a sequence took past its first; refused, if given,
    the message of each request the engine refuses (else the ValueError is raised)."""
    whole = {}
    counts = collections.Counter()
    for request in requests:
        try:
            add(engine, request)
        except ValueError as e:
            if refused is None:
                raise
            refused[request.name] = str(e)
    while engine.has_unfinished():
        for delta in engine.step():
            accumulate(whole, delta)
        counts.update(seq_id for seq_id, phase in engine.last_step.phases.items()
                      if phase == "prefill")
    if chunks is not None:
        chunks.append(sum(counts.values()) - len(counts))
    return whole


def add(engine: Engine, request: Request) -> None:
    if isinstance(request.params, BeamSearchParams):
        engine.add_beam_request(request.prompt, request.params, request.name, request.priority)
        return
    engine.add_request(request.prompt, request.params, request.name, stream=False,
                       priority=request.priority)


def what_is_held(engine: Engine) -> list[str]:
    """assert_no_leaks' failure as text, or nothing: the leak test reports it, while the other
    tests still read the run."""
    try:
        assert_no_leaks(engine)
    except AssertionError as e:
        return [str(e)]
    return []


def served_under(config: dict[str, str], requests: list[Request], draft_path: str) -> Served:
    """The batch on a fresh engine of config, then each request alone on the same engine
    (those it did not refuse)."""
    engine = tiny(**engine_args(config, draft_path),
                  **kv_transfer_args(config, requests, draft_path)).engine
    chunks = []
    refused = {}
    batch = serve(engine, requests, chunks, refused)
    held = what_is_held(engine)
    alone = {r.name: serve(engine, [r], chunks)[r.name] for r in requests
             if r.name not in refused}
    held += what_is_held(engine)
    run = Served(batch, alone, held, refused, engine.stats.num_fallbacks,
                 engine.scheduler.num_preemptions,
                 engine.scheduler.num_swapped_out, engine.stats.spec_decode_num_accepted_tokens,
                 engine.stats.num_cached_tokens, sum(chunks), engine.beam_search.num_forks,
                 (engine.model.model.layers[0].mlp.down_proj.weight.dtype,
                  engine.model_runner.k_caches.dtype))
    run.num_kv_loaded_tokens = engine.stats.num_kv_loaded_tokens  # disaggregation
    return run


def served_requests(run: Served, requests: list[Request]) -> list[Request]:
    """The requests the engine took (test_beam_search_runs_except_with_... checks which)."""
    return [request for request in requests if request.name not in run.refused]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def draft_path(tmp_path_factory) -> str:
    """A draft model for the tiny preset, sharing its tokenizer: the target's weights with
    noise added, so that some drafts are accepted and some rejected."""
    checkpoint = load_model(None, "tiny", 0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in checkpoint.model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 0.5)
    path = str(tmp_path_factory.mktemp("draft"))
    save_checkpoint(checkpoint.model, path, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    return mixed_requests()


@pytest.fixture(scope="module")
def plains(requests) -> dict[str, dict[str, RequestOutput]]:
    """The batch on the plain engine (no speculation, roomy, defaults) of each quantization:
    the reference of a configuration of that quantization."""
    return {quant: serve(tiny(block_size=BLOCK_SIZE, **args).engine, requests)
            for quant, args in QUANTIZATION.items()}


@pytest.fixture(scope="module")
def plain(plains) -> dict[str, RequestOutput]:
    return plains["unquantized"]


@pytest.fixture(scope="module")
def served(requests, draft_path):
    """served_under for each configuration, once: a function of the configuration."""
    runs = {}

    def served_for(config: dict[str, str]) -> Served:
        key = config_id(config)
        if key not in runs:
            runs[key] = served_under(config, requests, draft_path)
        return runs[key]
    return served_for


# ----------------------------------------------------------------------------- the generator

def test_all_pairs_covers_every_pair_of_factor_levels():
    configs = all_pairs(FACTORS)
    for a, b in itertools.combinations(FACTORS, 2):
        met = {(config[a], config[b]) for config in configs}
        assert met == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert all(list(config) == list(FACTORS) for config in configs)
    assert all(config[name] in FACTORS[name] for config in configs for name in config)
    assert len(configs) < 20  # of 864: pairwise, not the product


def test_all_pairs_of_two_factors_is_their_product():
    factors = {"a": ("x", "y", "z"), "b": ("u", "v")}
    assert all_pairs(factors) == [dict(a=a, b=b) for a in factors["a"] for b in factors["b"]]


# ----------------------------------------------------------------------------- the matrix

def test_the_stop_string_and_min_tokens_end_the_plain_engines_outputs(plain):
    """Else the batch would carry them without their taking effect."""
    stopped = plain["stop_string"].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason, len(stopped.token_ids)) == \
        ("stop", "ccc", 5)
    ended = plain["min_tokens"].outputs[0]  # 8 tokens, then end-of-text
    assert (ended.finish_reason, len(ended.token_ids), ended.token_ids[-1]) == ("stop", 9, 256)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_each_request_equals_itself_alone(config, served, requests):
    run = served(config)
    for request in served_requests(run, requests):
        assert samples(run.batch[request.name]) == samples(run.alone[request.name]), \
            request.name
        assert [c.finish_reason for c in run.batch[request.name].outputs] == \
            [c.finish_reason for c in run.alone[request.name].outputs], request.name


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_logprobs_equal_those_alone(config, served, requests):
    run = served(config)
    batch = run.batch["seeded_penalties_logprobs"].outputs[0].logprobs
    alone = run.alone["seeded_penalties_logprobs"].outputs[0].logprobs
    assert len(batch) == len(alone) == 16
    for entry_batch, entry_alone in zip(batch, alone):
        assert entry_batch.keys() == entry_alone.keys()
        for token_id, logprob in entry_alone.items():
            assert entry_batch[token_id] == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_greedy_tokens_equal_the_plain_engines(config, served, requests, plains):
    run = served(config)
    plain = plains[config["quant"]]
    for request in served_requests(run, requests):
        if request.is_greedy:
            assert samples(run.batch[request.name]) == samples(plain[request.name]), \
                request.name


@pytest.mark.parametrize("config", SPECULATIVE_CONFIGS, ids=config_id)
def test_seeded_tokens_with_drafts_equal_the_plain_engines(config, served, requests, plains):
    """A seeded sequence's draft (n-gram, or a draft model's, drawn with the target's noise) is
    accepted exactly when it is the token the position would have drawn without speculation
    (issue 46): the drafts are invisible, alone or in the batch."""
    run = served(config)
    plain = plains[config["quant"]]
    for request in served_requests(run, requests):
        if not request.is_greedy:
            assert samples(run.batch[request.name]) == samples(plain[request.name]), \
                request.name


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_beam_search_runs_except_with_speculation_which_refuses_it(config, served):
    """Refused by name where it cannot run (the other requests still run), never skipped."""
    run = served(config)
    expected = {} if config["spec"] == "none" else {"beam_search": SPEC_REFUSED}
    assert run.refused == expected
    assert ("beam_search" in run.batch) == (config["spec"] == "none")


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_nothing_is_held_afterwards(config, served):
    assert served(config).held == []


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_no_batch_fell_back_to_one_sequence_at_a_time(config, served):
    """A step that raises is re-run a sequence at a time with the same outputs: only this
    count shows it."""
    assert served(config).num_fallbacks == 0


@pytest.mark.skipif(not HAS_LLGUIDANCE, reason="llguidance is not installed: the batch has no "
                    "structured choice")
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_the_structured_choice_is_one_of_the_choices(config, served):
    run = served(config)
    for output in (run.batch["choice"], run.alone["choice"]):
        assert output.outputs[0].text in CHOICES
        assert output.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_each_factor_does_what_it_is_there_for(config, served):
    """A tight cache preempts (by swapping under swap), a small budget chunks prompts, the
    proposers' drafts are accepted, the prefix cache supplies tokens: else the matrix would
    cross nothing."""
    run = served(config)
    assert (run.num_preemptions > 0) == (config["kv"] == "tight_kv")
    if config["kv"] == "tight_kv" and config["preemption"] == "swap":
        assert run.num_swapped_out > 0
    if config["preemption"] == "recompute":
        assert run.num_swapped_out == 0
    assert (run.num_prefill_chunks > 0) == (config["budget"] == "small_budget")
    assert (run.num_accepted_tokens > 0) == (config["spec"] != "none")
    assert (run.num_cached_tokens > 0) == (config["prefix"] == "prefix_cache")
    assert (run.num_forks > 0) == (config["spec"] == "none")  # its beams forked
    weight_dtype, kv_dtype = run.dtypes
    assert (weight_dtype == torch.int8) == (config["quant"] == "int8")
    assert (kv_dtype == torch.float8_e4m3fn) == (config["quant"] == "fp8_kv")


# ----------------------------------------------------------------------------- refused beams

@pytest.mark.parametrize("engine_changes, message", [
    (dict(policy="static"), "beam search does not run under policy static"),
    (dict(tensor_parallel_size=2), "beam search with tensor_parallel_size > 1"),
], ids=["static", "tensor_parallel"])
def test_beam_search_is_refused_by_name_where_it_cannot_run(engine_changes, message):
    engine = tiny(**engine_changes).engine
    with pytest.raises(ValueError, match=message):
        engine.add_beam_request("Hello", BeamSearchParams(beam_width=2, max_tokens=4))
    assert not engine.has_unfinished()
    assert_no_leaks(engine)


def test_use_beam_search_is_refused_with_structured_output():
    engine = tiny().engine
    body = dict(prompt="Hello", max_tokens=4, n=2, use_beam_search=True,
                structured_outputs={"choice": CHOICES})
    with server_in_process(engine) as url:
        status, answer = http(url, "/v1/completions", body)
    assert (status, answer["error"]["param"]) == (400, "structured_outputs")
    assert answer["error"]["message"] == "use_beam_search does not take structured_outputs"
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- disaggregation
# The "disagg" factor: under kv_consumer the engine loads each prompt's full blocks from a
# folder that a producer of the same model, block size and quantization filled (the proxy's
# max_tokens 1 prefill), in the background while the others run (kv_connector.py); the tests
# above hold it to the same outputs and to nothing held.

def kv_transfer_args(config: dict[str, str], requests: list[Request], draft_path: str) -> dict:
    """The consumer's kv_transfer_config, its folder filled by a producer (beside the draft
    model, in pytest's temporary folder); nothing for one instance."""
    if config["disagg"] == "one_instance":
        return {}
    folder = os.path.join(os.path.dirname(draft_path), "kv-" + config_id(config))
    producer = tiny(block_size=BLOCK_SIZE, **QUANTIZATION[config["quant"]],
                    kv_transfer_config=kv_config(folder, "kv_producer"))
    producer.generate([request.prompt for request in requests],
                      SamplingParams(max_tokens=1, temperature=0))
    assert_no_leaks(producer.engine)
    return dict(kv_transfer_config=kv_config(folder, "kv_consumer"))


def kv_config(folder: str, role: str) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder}}


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_a_consumer_loads_what_the_producer_saved(config, served):
    """Else the factor would cross nothing: a consumer loads prompt blocks (every prompt but
    the shortest has a full block before its last token), one instance none."""
    run = served(config)
    assert (run.num_kv_loaded_tokens > 0) == (config["disagg"] == "kv_consumer")


@pytest.mark.parametrize("config, message", [
    (dict(tensor_parallel_size=2), "kv_transfer_config with tensor_parallel_size > 1")])
def test_a_combination_disaggregation_refuses_says_why(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(preset="tiny", device="cpu",
                     kv_transfer_config=kv_config(str(tmp_path), "kv_consumer"), **config)
