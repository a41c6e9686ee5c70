"""Structured output's guarantees, on the shipped Shakespeare model (which never writes JSON on
its own): every output under a schema parses and validates, a regular expression matches the
whole output, a choice is one of the choices; a constraint that allows every token changes no
greedy token; bad constraints are refused naming the field, before anything is queued; n > 1,
preemption and the other sampling options keep every output valid and leak no block; the
HTTP API (response_format, structured_outputs) and --jsonl take them.
"""
import io
import json
import re
import subprocess
import sys

import pytest
import torch

import structured_output
from conftest import HERE, assert_no_leaks, http, nanoserve_main, parse_events, run_to_end, \
    server_in_process
from nanoserve import LLM
from sampling import SamplingParams
from structured_output import (MAX_CHOICES, Grammar, StructuredOutputsParams,
                               apply_grammar_bitmask)

# nested objects, an array with bounds, enums, bounded integers and strings, required fields
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["king", "queen", "fool"]},
        "home": {"type": "object",
                 "properties": {"city": {"enum": ["Verona", "Mantua"]},
                                "floor": {"type": "integer", "minimum": -2, "maximum": 3}},
                 "required": ["city", "floor"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 2, "maxItems": 4},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "home", "scores"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-3]\d"
CHOICES = ["Montague", "Capulet", "a plague o' both your houses"]


def check_person(person) -> None:
    """PERSON's rules, checked by hand (jsonschema is no dependency of ours)."""
    assert isinstance(person, dict) and set(person) <= set(PERSON["properties"]), person
    assert set(PERSON["required"]) <= set(person), person
    assert isinstance(person["name"], str) and len(person["name"]) <= 8
    assert type(person["age"]) is int and 18 <= person["age"] <= 99
    assert person["role"] in ("king", "queen", "fool")
    home = person["home"]
    assert isinstance(home, dict) and set(home) == {"city", "floor"}
    assert home["city"] in ("Verona", "Mantua")
    assert type(home["floor"]) is int and -2 <= home["floor"] <= 3
    scores = person["scores"]
    assert isinstance(scores, list) and 2 <= len(scores) <= 4
    assert all(type(score) is int and 0 <= score <= 9 for score in scores)
    assert type(person.get("alive", False)) is bool


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32")


def constrained(max_tokens=300, temperature=1.0, n=1, stop=None, ignore_eos=False, **kwargs
                ) -> SamplingParams:
    """Seeded sampling under one constraint (kwargs: StructuredOutputsParams' fields)."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, stop=stop,
                          ignore_eos=ignore_eos, seed=0,
                          structured_outputs=StructuredOutputsParams(**kwargs))


def texts(outputs) -> list[str]:
    return [completion.text for out in outputs for completion in out.outputs]


def finish_reasons(outputs) -> set[str]:
    return {completion.finish_reason for out in outputs for completion in out.outputs}


# ----------------------------------------------------------------------------- what it makes

def test_every_output_under_a_schema_parses_and_validates(llm):
    outputs = llm.generate(["ROMEO:", "JULIET:", "x"], constrained(json=PERSON, n=3))
    for text in texts(outputs):
        check_person(json.loads(text))
    assert finish_reasons(outputs) == {"stop"}  # ended by the grammar, not by max_tokens
    assert_no_leaks(llm.engine)


def test_a_schema_given_as_text_is_the_same_constraint(llm):
    as_dict = llm.generate(["ROMEO:"], constrained(json=PERSON))
    as_text = llm.generate(["ROMEO:"], constrained(json=json.dumps(PERSON)))
    assert texts(as_dict) == texts(as_text)


def test_objects_hold_only_their_named_properties_unless_the_schema_allows_others(llm):
    """As vLLM's default backend reads a schema (xgrammar's strict mode): an object that names
    its properties and says nothing of others gets none; a schema may still allow them."""
    named = {"type": "object", "properties": {"act": {"enum": [1, 2, 3]}}}
    outputs = llm.generate(["ROMEO:"], constrained(json=named, n=8, max_tokens=100))
    assert all(set(json.loads(text)) <= {"act"} for text in texts(outputs)), texts(outputs)
    tricky = {"properties": {"properties": {"enum": [{"properties": 1}]}},
              "additionalProperties": True, "$defs": {"x": {"properties": {}}}}
    assert structured_output.closed_objects(tricky) == {
        "properties": {"properties": {"enum": [{"properties": 1}]}},
        "additionalProperties": True,
        "$defs": {"x": {"properties": {}, "additionalProperties": False}}}


def test_json_object_outputs_are_objects(llm):
    # any object: its values unbounded, so many run to max_tokens; those that end are objects
    outputs = llm.generate(["ROMEO:"], constrained(json_object=True, n=8, max_tokens=60))
    completions = outputs[0].outputs
    ended = [c.text for c in completions if c.finish_reason == "stop"]
    assert ended, [c.text for c in completions]
    assert all(isinstance(json.loads(text), dict) for text in ended)
    assert all(c.text.startswith("{") for c in completions)


def test_compact_json_has_no_whitespace_between_tokens(llm):
    outputs = llm.generate(["ROMEO:"], constrained(json=PERSON, n=4, disable_any_whitespace=True))
    for text in texts(outputs):
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', text)
        assert not re.search(r"\s", outside_strings), text
        check_person(json.loads(text))


def test_regex_outputs_match_in_full(llm):
    outputs = llm.generate(["ROMEO:", "When"], constrained(regex=DATE, n=4))
    assert all(re.fullmatch(DATE, text) for text in texts(outputs)), texts(outputs)
    assert finish_reasons(outputs) == {"stop"}


def test_a_sequence_ends_when_its_grammar_is_complete(llm):
    """Once the grammar accepts and allows nothing more it ends there, finish_reason "stop",
    without an end-of-text token (which ignore_eos would not have stopped at)."""
    outputs = llm.generate(["ROMEO:"], constrained(regex=DATE, n=4, ignore_eos=True))
    eos = llm.engine.eos_token_ids
    for completion in outputs[0].outputs:
        assert re.fullmatch(DATE, completion.text) and completion.finish_reason == "stop"
        assert len(completion.token_ids) == 10 and completion.token_ids[-1] not in eos


def test_choices_are_one_of_the_choices(llm):
    outputs = llm.generate(["ROMEO:", "Who?"], constrained(choice=CHOICES, n=8))
    assert set(texts(outputs)) <= set(CHOICES)
    assert len(set(texts(outputs))) > 1  # sampled among them


def test_a_grammar_constrains_as_lark_and_as_gbnf(llm):
    lark = 'start: "Ay" | "No, " NAME\nNAME: /[A-Z][a-z]{1,6}/'
    gbnf = 'root ::= "Ay" | "No, " [A-Z] [a-z] [a-z]?'
    for grammar, pattern in ((lark, r"Ay|No, [A-Z][a-z]{1,6}"), (gbnf, r"Ay|No, [A-Z][a-z]{1,2}")):
        outputs = llm.generate(["ROMEO:"], constrained(grammar=grammar, n=6))
        assert all(re.fullmatch(pattern, text) for text in texts(outputs)), texts(outputs)


def test_a_constraint_allowing_every_token_leaves_greedy_output_unchanged(llm):
    free = SamplingParams(max_tokens=60, temperature=0)
    every_token = constrained(regex=r"(?s:.*)", max_tokens=60, temperature=0)
    prompts = ["ROMEO:", "Hello there", "KING HENRY"]
    want = [out.outputs[0].token_ids for out in llm.generate(prompts, free)]
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, every_token)]
    assert got == want


def test_a_constrained_row_leaves_its_batch_neighbours_unchanged(llm):
    free = SamplingParams(max_tokens=40, temperature=0)
    alone = llm.generate(["JULIET:"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["JULIET:", "ROMEO:"], [free, constrained(regex=DATE)])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(DATE, mixed[1].outputs[0].text)


def test_greedy_constrained_output_does_not_depend_on_preemption_or_batch(llm):
    """A KV cache too small for them all: sequences are preempted and recomputed; each one's
    grammar goes on from its tokens, and the outputs are those served alone."""
    prompts = ["ROMEO:", "JULIET:", "x" * 30, "O"]
    params = constrained(json=PERSON, temperature=0, max_tokens=400)
    alone = [llm.generate([p], params)[0].outputs[0].text for p in prompts]
    tight = LLM(device="cpu", dtype="float32", kv_cache_tokens=512, max_num_batched_tokens=64)
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert texts(outputs) == alone
    for text in alone:
        check_person(json.loads(text))
    assert_no_leaks(tight.engine)


def test_sampling_options_keep_outputs_valid(llm):
    """Penalties, min_p, top-k, top-p and logit_bias all come after the mask: they reshape the
    allowed tokens' chances, never bring a ruled-out token back. Log-probabilities are the
    model's own, before the mask (as vLLM's)."""
    params = SamplingParams(n=4, max_tokens=300, temperature=1.5, seed=1, top_k=40, top_p=0.9,
                            min_p=0.01, presence_penalty=1.5, frequency_penalty=1.0,
                            repetition_penalty=1.3, logit_bias={ord("{"): -100}, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outputs = llm.generate(["ROMEO:"], params)
    for completion in outputs[0].outputs:
        check_person(json.loads(completion.text))
        assert len(completion.logprobs) == len(completion.token_ids)
    free = llm.generate(["ROMEO:"], SamplingParams(max_tokens=1, temperature=0, logprobs=2))
    first = outputs[0].outputs[0]
    assert first.token_ids[0] == llm.engine.tokenizer.encode("{")[0]  # the schema's only start
    model_logprobs = free[0].outputs[0].logprobs[0]
    assert first.logprobs[0] == pytest.approx(first.logprobs[0] | model_logprobs, abs=1e-4)


def test_stop_strings_and_streaming_with_a_constraint(llm):
    engine = llm.engine
    params = constrained(json=PERSON, temperature=0, max_tokens=200)
    whole = llm.generate(["ROMEO:"], params)[0].outputs[0].text
    request_id = engine.add_request("ROMEO:", params)  # streamed: a delta each token
    deltas = run_to_end(engine)[request_id]
    assert "".join(d.outputs[0].text for d in deltas) == whole
    stop = whole[:whole.index(":")]  # the first key, then a stop string at its colon
    stopped = llm.generate(["ROMEO:"], constrained(json=PERSON, temperature=0, stop=[":"]))
    assert stopped[0].outputs[0].text == stop
    assert stopped[0].outputs[0].stop_reason == ":"
    assert_no_leaks(engine)


def test_a_constraint_that_leaves_no_token_fails_that_request_alone(llm):
    """The schema allows only "b" after "a", and min_tokens bans "b" (a stop token) until
    there are 2 tokens: nothing is left to sample, and that request alone fails."""
    engine = llm.engine
    b = engine.tokenizer.encode("b")[0]
    stuck = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[b], temperature=0,
                           structured_outputs=StructuredOutputsParams(regex="ab"))
    free = SamplingParams(max_tokens=20, temperature=0)
    alone = llm.generate(["KING:"], free)[0].outputs[0]
    outputs = llm.generate(["ROMEO:", "KING:"], [stuck, free])
    failed = outputs[0].outputs[0]
    assert failed.finish_reason == "error" and "structured_outputs" in failed.error
    assert outputs[1].outputs[0].token_ids == alone.token_ids
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- bad input

BAD_CONSTRAINTS = [
    (dict(json={"type": "array", "uniqueItems": True}),
     'structured_outputs.json: Unimplemented keys: ["uniqueItems"]'),
    (dict(json={"type": "wheel"}), "structured_outputs.json: Invalid type: wheel"),
    (dict(json="{not json"), "structured_outputs.json: "),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 3}),
     "structured_outputs.json: Unsatisfiable schema: minimum (5) is greater than maximum (3)"),
    (dict(regex="a(b"), "structured_outputs.regex: at 1(8): invalid regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar: "),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list of strings"),
    (dict(choice=["a", 1]), "structured_outputs.choice must be a non-empty list of strings"),
    (dict(regex="a", choice=["a"]), "structured_outputs must set exactly one of json, regex, "
     "choice, grammar, json_object; got regex, choice"),
    (dict(), "structured_outputs must set exactly one of"),
    (dict(json_object=False), "structured_outputs.json_object must be true"),
    (dict(regex="a" * (64 * 1024 + 1)), "structured_outputs.regex has 65537 characters; "
     "at most 65536"),
]


@pytest.mark.parametrize("fields, message", BAD_CONSTRAINTS, ids=[
    "unsupported-keyword", "invalid-type", "schema-not-json", "unsatisfiable", "bad-regex",
    "bad-grammar", "no-choices", "choice-not-string", "two-kinds", "no-kind",
    "json-object-false", "too-large"])
def test_bad_constraints_are_refused_naming_the_field(llm, fields, message):
    engine = llm.engine
    with pytest.raises(ValueError) as error:
        engine.add_request("ROMEO:", SamplingParams(structured_outputs=fields))
    assert str(error.value).startswith(message)
    assert_no_leaks(engine)  # refused before anything was queued


def test_a_constraint_too_slow_to_compile_is_refused(llm, monkeypatch):
    monkeypatch.setattr(structured_output, "MAX_COMPILE_SECONDS", 0.0)
    with pytest.raises(ValueError, match=r"structured_outputs.regex took .* s to compile; at most"):
        llm.engine.add_request("x", SamplingParams(structured_outputs={"regex": "[0-9]{1,4}x"}))
    assert_no_leaks(llm.engine)


def test_a_choice_holds_at_most_max_choices_strings():
    StructuredOutputsParams(choice=[str(i) for i in range(MAX_CHOICES)])
    with pytest.raises(ValueError, match=f"choice has {MAX_CHOICES + 1} strings; at most "
                                         f"{MAX_CHOICES}"):
        StructuredOutputsParams(choice=[str(i) for i in range(MAX_CHOICES + 1)])


def test_structured_outputs_must_be_params_or_their_fields():
    with pytest.raises(ValueError, match="structured_outputs must be an object with one of"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="structured_outputs.schema is not supported"):
        SamplingParams(structured_outputs={"schema": {}})
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")


# ----------------------------------------------------------------------------- the machinery

def test_a_repeated_constraint_compiles_once(llm):
    manager = llm.engine.structured_output_manager
    schema = {"type": "object", "properties": {"only_here": {"enum": [1, 2]}}}
    before = manager.num_compiled
    for _ in range(3):
        llm.generate(["ROMEO:"], constrained(json=schema, max_tokens=30))
    llm.generate(["ROMEO:"], constrained(json=json.dumps(schema), max_tokens=30))
    assert manager.num_compiled == before + 1


class Unconstrained:
    """A sampling position as apply_grammar_bitmask sees it, without a grammar."""
    grammar = None


def test_an_unconstrained_batch_is_not_touched():
    logits = torch.randn(3, 257)
    assert apply_grammar_bitmask([Unconstrained()] * 3, logits) is logits


class AllowsTheFirstTen:
    """A grammar that allows tokens 0 to 9 alone, whatever came before."""

    def sync(self, output_token_ids: list[int]) -> None:
        pass

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0
        bitmask[index, 0] = 2**10 - 1


class Constrained:
    """A sampling position as apply_grammar_bitmask sees it, with AllowsTheFirstTen."""
    grammar = AllowsTheFirstTen()
    token_ids = []
    num_prompt_tokens = 0


def test_a_cuda_step_uploads_the_mask_and_its_rows_pinned(fake_cuda):
    """On CUDA the mask and the rows it covers go up as the step's other inputs do, from
    pinned memory (never waited for); the constrained row alone is masked."""
    logits = torch.randn(3, 257)
    masked = apply_grammar_bitmask([Unconstrained(), Constrained(), Unconstrained()], logits)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.equal(masked[1, :10], logits[1, :10]) and masked[1, 10:].isneginf().all()
    assert [shape for (shape,) in fake_cuda.calls_to("pinned")] == [(1, 257), (1,)]


def test_a_grammar_that_fell_behind_is_rebuilt_from_the_tokens(llm):
    """sync(): a matcher that has not consumed a sequence's tokens (rolled back, say) is
    rebuilt from them, and allows what the one that consumed them allows."""
    manager = llm.engine.structured_output_manager
    compiled = manager.compile(StructuredOutputsParams(json=PERSON))
    tokens = llm.engine.tokenizer.encode('{"name": "Rom')
    followed = Grammar(compiled)
    for token in tokens:
        followed.accept_token(token)
    behind = Grammar(compiled)
    behind.sync(tokens)
    masks = torch.zeros(2, (257 + 31) // 32, dtype=torch.int32)
    followed.fill_bitmask(masks, 0)
    behind.fill_bitmask(masks, 1)
    assert behind.num_accepted_tokens == len(tokens)
    assert torch.equal(masks[0], masks[1]) and masks[0].any()
    inside_a_string = structured_output.unpack_bitmask(masks[:1], 257)[0]
    assert inside_a_string[llm.engine.tokenizer.encode("e")[0]]  # a letter may come next
    assert not inside_a_string[llm.engine.tokenizer.encode("\n")[0]]  # JSON escapes newlines


# ----------------------------------------------------------------------------- the HTTP API

def schema_format(schema: dict) -> dict:
    """OpenAI's response_format for a JSON schema."""
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_chat_response_format_json_schema_validates(llm):
    body = dict(messages=[{"role": "user", "content": "Who are you?"}], max_tokens=300, n=3,
                seed=0, response_format=schema_format(PERSON))
    with server_in_process(llm.engine) as url:
        status, response = http(url, "/v1/chat/completions", body)
    assert status == 200, response
    for choice in response["choices"]:
        check_person(json.loads(choice["message"]["content"]))
        assert choice["finish_reason"] == "stop"


def test_completions_take_structured_outputs_and_stream(llm):
    body = dict(prompt="ROMEO:", max_tokens=50, n=2, seed=0, stream=True,
                structured_outputs={"regex": DATE})
    with server_in_process(llm.engine) as url:
        status, text = http(url, "/v1/completions", body)
        status_object, whole = http(url, "/v1/completions", dict(
            prompt="ROMEO:", max_tokens=200, response_format={"type": "json_object"}))
    assert status == 200 and status_object == 200, text
    streamed = {0: "", 1: ""}
    for event in parse_events(text)[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert all(re.fullmatch(DATE, t) for t in streamed.values()), streamed
    assert whole["choices"][0]["text"].startswith("{")


def test_response_format_text_is_unconstrained(llm):
    body = dict(prompt="ROMEO:", max_tokens=20, temperature=0)
    with server_in_process(llm.engine) as url:
        _, free = http(url, "/v1/completions", body)
        _, text = http(url, "/v1/completions", body | dict(response_format={"type": "text"}))
    assert text["choices"][0]["text"] == free["choices"][0]["text"]


@pytest.mark.parametrize("fields, param, message", [
    (dict(response_format=schema_format({"type": "array", "uniqueItems": True})),
     "response_format", 'response_format.json_schema.schema: Unimplemented keys: ["uniqueItems"]'),
    (dict(structured_outputs={"regex": "a(b"}), "structured_outputs",
     'structured_outputs.regex: at 1(8): invalid regex "a(b" (in regex): regex parse error: '
     "unclosed group"),
    (dict(structured_outputs={"grammar": "start: nowhere"}), "structured_outputs",
     "structured_outputs.grammar: "),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "response_format.json_schema must be {"),
    (dict(response_format={"type": "xml"}), "response_format",
     'response_format.type must be "text", "json_object" or "json_schema"'),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "response_format", "give response_format or structured_outputs, not both"),
    (dict(structured_outputs={"choice": "ab"}), "structured_outputs",
     "structured_outputs.choice must be a non-empty list of strings"),
    (dict(structured_outputs="a+"), "structured_outputs", "structured_outputs must be of type"),
], ids=["unsupported-keyword", "bad-regex", "bad-grammar", "no-schema", "unknown-type", "both",
        "choice-not-list", "not-an-object"])
def test_bad_constraints_are_a_400_naming_the_field(llm, fields, param, message):
    with server_in_process(llm.engine) as url:
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = dict(prompt="x", messages=[{"role": "user", "content": "x"}]) | fields
            del body["messages" if path == "/v1/completions" else "prompt"]
            status, response = http(url, path, body)
            assert (status, response["error"]["param"]) == (400, param), response
            assert response["error"]["message"].startswith(message)
    assert_no_leaks(llm.engine)  # refused before anything was queued


def test_openai_client_parses_a_pydantic_model_from_the_server(llm):
    openai = pytest.importorskip("openai", reason="the openai package is not a dependency: "
                                 "pip install openai to run this client test")
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Verdict(pydantic.BaseModel):
        speaker: Literal["Romeo", "Juliet", "Nurse"]
        line_count: int = pydantic.Field(ge=1, le=9)
        mood: str = pydantic.Field(max_length=8)
        allies: list[Literal["Mercutio", "Benvolio"]] = pydantic.Field(max_length=2)

    with server_in_process(llm.engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        completion = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Who speaks?"}],
            response_format=Verdict, max_tokens=300, seed=0)
    verdict = completion.choices[0].message.parsed
    assert isinstance(verdict, Verdict), completion.choices[0].message.content


# ----------------------------------------------------------------------------- --jsonl

def test_jsonl_lines_take_structured_outputs(capsys, monkeypatch):
    lines = [json.dumps(dict(prompt="ROMEO:", max_tokens=50, seed=0,
                             structured_outputs={"regex": DATE})),
             json.dumps(dict(prompt="ROMEO:", structured_outputs={"regex": "a(b"}))]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    status, out, err = nanoserve_main(capsys, "--jsonl")
    got = [json.loads(line) for line in out.splitlines()]
    assert re.fullmatch(DATE, got[0]["text"]) and got[0]["finish_reason"] == "stop"
    assert got[1]["error"] == ('line 2: structured_outputs.regex: at 1(8): invalid regex "a(b" '
                               "(in regex): regex parse error: unclosed group")
    assert (status, err) == (1, "error: 1 of 2 lines failed\n")


# ----------------------------------------------------------------------------- without llguidance

WITHOUT_LLGUIDANCE = """
import importlib
import re
import sys
sys.modules["llguidance"] = None  # `import llguidance` now raises ImportError, as if absent
with open("pyproject.toml") as f:
    listed = re.search(r"^py-modules = \\[(.*?)\\]$", f.read(), re.M | re.S).group(1)
for name in re.findall(r'"([^"]+)"', listed):
    importlib.import_module(name)
from conftest import http, server_in_process, tiny
from sampling import SamplingParams
llm = tiny()
plain = llm.generate(["A"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
print("plain:", len(plain.token_ids))
try:
    llm.generate(["A"], SamplingParams(max_tokens=3, structured_outputs={"regex": "a+"}))
except ValueError as e:
    print("offline:", type(e).__name__, e)
with server_in_process(llm.engine) as url:
    status, body = http(url, "/v1/completions", dict(prompt="A", max_tokens=3,
                                                      structured_outputs={"regex": "a+"}))
print("http:", status, body["error"]["message"])
"""


def test_an_engine_imports_and_serves_without_llguidance():
    """The GPU image has no llguidance: every module imports without it, an engine serves a
    plain request, and a constrained one is refused, naming the package, offline (a
    ValueError) and over HTTP (400)."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_LLGUIDANCE], cwd=HERE,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    message = ("structured output needs the llguidance package (>= 1.9), which is not "
               "installed here: pip install llguidance")
    assert result.stdout.splitlines() == [
        "plain: 3", f"offline: StructuredOutputUnavailableError {message}", f"http: 400 {message}"]
