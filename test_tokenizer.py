"""tokenizer.py's guarantees: tokenizer.json as transformers' tokenizers reads it, and chat
templates rendered as transformers renders them.
"""
import json
import os
import re
import shutil
import time

import pytest

import cli
from conftest import (HERE, MODEL_FIXTURES, chat_checkpoint, checkpoint_llm, http, nanoserve_main,
                      server_in_process, type_lines, write_byte_tokenizer)
from openai_protocol import render_chat
from sampling import SamplingParams
from tokenizer import (ChatTemplate, Detokenizer, Tokenizer, chat_template_environment,
                       gpt2_byte_chars, load_chat_template, load_tokenizer)


# ----------------------------------------------------------------------------- chat, defaults

def chatml(messages: list[dict]) -> str:
    """CHAT_TEMPLATE's text for messages, written out by hand (transformers' own rendering of
    the template was checked to be this text)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages
                    if m["content"])
    return f"<|endoftext|>{time.strftime('%Y')}\n{turns}<|im_start|>assistant\n"


def test_chat_prompt_is_the_checkpoints_template_rendered_as_transformers_does(tmp_path):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    messages = [dict(role="system", content="Be brief."), dict(role="user", content=""),
                dict(role="user", content="Hi")]
    want = llm.generate(chatml(messages), SamplingParams(max_tokens=8, temperature=0))[0]
    assert want.prompt_token_ids[0] == 256 != want.prompt_token_ids[1]  # bos_token, once
    with server_in_process(llm.engine) as url:
        tokenized = http(url, "/tokenize", dict(messages=messages))[1]
        status, got = http(url, "/v1/chat/completions", dict(messages=messages, max_tokens=8,
                                                              temperature=0))
    assert tokenized["tokens"] == want.prompt_token_ids
    assert status == 200 and got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert got["choices"][0]["message"]["content"] == want.outputs[0].text


def test_chat_template_kwargs_reach_the_template(tmp_path):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    messages = [dict(role="user", content="Hi")]
    _, want = llm.engine.parse_prompt(chatml(messages) + "<think>\n\n</think>\n\n")
    body = dict(messages=messages, chat_template_kwargs=dict(enable_thinking=False))
    with server_in_process(llm.engine) as url:
        assert http(url, "/tokenize", body)[1]["tokens"] == want
        status, got = http(url, "/v1/chat/completions", body | dict(max_tokens=2))
    assert status == 200 and got["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("body, param, message", [
    (dict(messages=[dict(role="user", content="x"), dict(role="tool", content="{}")]),
     "messages", "the chat template refused the messages: no role tool in this template"),
    (dict(messages=[dict(role="user", content="x")], chat_template_kwargs=[1]),
     "chat_template_kwargs", "chat_template_kwargs must be of type dict"),
    (dict(messages=[dict(role="bot", content="x")]), "messages", "messages must be"),
], ids=["raise_exception", "kwargs-not-an-object", "unknown-role"])
def test_a_chat_the_template_cannot_render_gets_400_naming_why(tmp_path, body, param, message):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    with server_in_process(llm.engine) as url:
        status, got = http(url, "/v1/chat/completions", body)
        assert (status, got["error"]["param"]) == (400, param)
        assert message in got["error"]["message"]
        assert http(url, "/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                                      max_tokens=1))[0] == 200


@pytest.mark.parametrize("files, want", [
    (dict(chat_template="{{ bos_token }}config"), "<|endoftext|>config"),
    (dict(chat_template=[dict(name="tool_use", template="tools"),
                         dict(name="default", template="default")]), "default"),
    (dict(chat_template="config", jinja="{{ eos_token }}file"), "<|endoftext|>file"),
    (dict(chat_template="{{ bos_token }}", bos_token=dict(content="<s>", lstrip=False)), "<s>"),
], ids=["tokenizer-config", "named-default", "jinja-file-first", "token-as-object"])
def test_chat_template_is_read_where_transformers_reads_it(tmp_path, files, want):
    jinja = files.pop("jinja", None)
    path = chat_checkpoint(tmp_path, template=None, **files)
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    template = load_chat_template(path)
    assert template.render([dict(role="user", content="x")], {}) == want


CHAT_TEMPLATE_FIXTURE = os.path.join(HERE, ".ci", "fixtures", "chat_templates", "rendered.json")


def chat_template_fixture() -> dict:
    """Templates in the style of Llama 3's, Qwen3's and SmolLM2's, with the prompts that
    transformers' renderer gave for them (.ci/fixtures/chat_templates/, with the script that
    made them, which needs transformers; the tests do not)."""
    with open(CHAT_TEMPLATE_FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def fixture_template(text: str) -> ChatTemplate:
    template = chat_template_environment().from_string(text)
    return ChatTemplate(template, {}, CHAT_TEMPLATE_FIXTURE)


@pytest.mark.parametrize("case", chat_template_fixture()["cases"], ids=lambda case: case["name"])
def test_chat_templates_render_as_transformers_renders_them(case):
    """Whitespace control, namespaces, reversed loops, tojson (indented, non-ASCII), tools,
    a date_string default and chat_template_kwargs: the prompt, character for character."""
    rendered = fixture_template(case["template"]).render(case["messages"], case["kwargs"])
    assert rendered == case["rendered"]


def test_a_template_refusal_carries_the_message_transformers_gives():
    fixture = chat_template_fixture()
    qwen3 = next(case for case in fixture["cases"] if case["name"] == "qwen3")
    with pytest.raises(ValueError, match=re.escape(fixture["refusal"])):
        fixture_template(qwen3["template"]).render([dict(role="robot", content="beep")], {})


@pytest.mark.parametrize("template, message", [
    ("{{ 1 / 0 }}", "the chat template failed: ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "the chat template failed: TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "the chat template failed: RecursionError"),
], ids=["division", "type", "recursion"])
def test_a_template_that_fails_as_code_is_a_value_error(template, message):
    """A template is code: whatever it raises is the request's error (a 400 over HTTP, a line
    in the REPL), not a crash."""
    with pytest.raises(ValueError, match=message):
        fixture_template(template).render([dict(role="user", content="hi")], {})


@pytest.mark.parametrize("template, message", [
    ("{% for %}", "tokenizer_config.json: the chat template does not compile"),
    ([dict(name="tool_use", template="x")], "no chat template is named default"),
], ids=["syntax", "no-default"])
def test_a_broken_chat_template_stops_the_engine_at_start_up(tmp_path, template, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_llm(chat_checkpoint(tmp_path, template))


def test_a_checkpoint_without_a_template_chats_in_the_documented_transcript(tmp_path):
    path = chat_checkpoint(tmp_path, template=None)
    llm = checkpoint_llm(path)
    messages = [dict(role="user", content="Hi")]
    _, want = llm.engine.parse_prompt(render_chat(messages))
    assert load_chat_template(path) is None
    with server_in_process(llm.engine) as url:
        assert http(url, "/tokenize", dict(messages=messages))[1]["tokens"] == want


def test_the_repl_chats_through_the_template_one_conversation_until_clear(tmp_path, monkeypatch,
                                                                         capsys):
    llm = checkpoint_llm(chat_checkpoint(tmp_path))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    hi = [dict(role="user", content="Hi")]
    reply = llm.generate(chatml(hi), greedy)[0].outputs[0].text
    type_lines(monkeypatch, ["Hi", "And?", "/clear", "Again"])
    seen = []
    add_request = llm.engine.add_request

    def add_and_record(prompt, params=None, request_id=None):
        seen.append(prompt)
        return add_request(prompt, params, request_id)
    monkeypatch.setattr(llm.engine, "add_request", add_and_record)
    cli.run_terminal(llm.engine, cli.parse_args(["--max-tokens", "4",
                                                             "--temperature", "0"]))
    conversation = hi + [dict(role="assistant", content=reply), dict(role="user", content="And?")]
    assert seen == [chatml(hi), chatml(conversation), chatml([dict(role="user", content="Again")])]
    assert "a new conversation" in capsys.readouterr().out


@pytest.mark.parametrize("key, value, message", [
    ("temperature", -1, "temperature must be a number in [0, inf], got -1"),
    ("top_p", 0, "top_p must be a number in (0, 1], got 0"),
    ("top_k", 1.5, "top_k must be an integer >= -1, got 1.5"),
    ("max_new_tokens", 0, "max_tokens must be an integer >= 1, got 0"),
])
def test_a_bad_generation_config_value_is_a_clear_error_at_start_up(tmp_path, capsys, key,
                                                                      value, message):
    path = chat_checkpoint(tmp_path, None, {key: value})
    said = f"generation_config.json: {key} {value!r} is not a valid default ({message})"
    with pytest.raises(ValueError, match=re.escape(said)):
        checkpoint_llm(path)
    status, _, err = nanoserve_main(capsys, "--model", path, "--device", "cpu", "--prompt", "x")
    assert status == 2 and err.startswith("error: ") and said in err


# ----------------------------------------------------------------------------- tokenizer.json

# Small tokenizer.json files configured as Llama 3's, Qwen2's, GPT-2's and SmolLM2's are, with
# the ids Hugging Face tokenizers gives for a text of mixed scripts (and for two others), and a
# SentencePiece-style one: .ci/fixtures/tokenizers/make_tokenizer_fixtures.py made them, so the
# tests need no tokenizers.
TOKENIZER_FIXTURES = os.path.join(HERE, ".ci", "fixtures", "tokenizers")


TOKENIZER_KINDS = ["llama3", "qwen2", "gpt2", "smollm2"]


def tokenizer_fixture(kind: str) -> tuple[Tokenizer, list[dict]]:
    """A fixture's tokenizer, as load_tokenizer reads its directory, and its reference cases
    ({text, ids, decoded})."""
    path = os.path.join(TOKENIZER_FIXTURES, kind)
    with open(os.path.join(path, "reference.json"), encoding="utf-8") as f:
        return load_tokenizer(path), json.load(f)["cases"]


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_json_encodes_to_the_ids_hugging_face_tokenizers_gives(kind):
    """Exactly tokenizers' ids: accents in NFC and NFD, CJK, Cyrillic, emoji, digit runs,
    runs of spaces, tabs and newlines, contractions, added tokens written in the text, the
    empty text; Llama 3's BOS first."""
    tokenizer, cases = tokenizer_fixture(kind)
    for case in cases:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_json_decode_leaves_out_special_tokens(kind):
    """decode is tokenizers' decode(skip_special_tokens=True), as vLLM decodes outputs."""
    tokenizer, cases = tokenizer_fixture(kind)
    for case in cases:
        assert tokenizer.decode(case["ids"]) == case["decoded"]


def test_tokenizer_json_added_tokens_not_marked_special_are_text():
    """Qwen's <tool_call> is an added token (one id) but not special: decoded text keeps it;
    skip_special_tokens=False (vLLM's /detokenize) keeps the special ones too."""
    qwen2, _ = tokenizer_fixture("qwen2")
    ids = qwen2.encode("<|im_start|>a<tool_call>b<|im_end|>")
    assert qwen2.decode(ids) == "a<tool_call>b"
    assert qwen2.decode(ids, skip_special_tokens=False) == "<|im_start|>a<tool_call>b<|im_end|>"


def test_tokenizer_json_bos_is_added_once():
    """Llama 3's post-processor puts <|begin_of_text|> before a text, the empty one too; a text
    that starts with it (a chat template writes it) gets no second one. Without such a
    post-processor, no BOS."""
    llama3, _ = tokenizer_fixture("llama3")
    bos = llama3.token_id("<|begin_of_text|>")
    assert llama3.bos_token_id == bos and llama3.bos_token == "<|begin_of_text|>"
    hi = llama3.encode("Hi")
    assert hi[0] == bos and hi[1:].count(bos) == 0
    assert llama3.encode("<|begin_of_text|>Hi") == hi
    assert llama3.encode("") == [bos]
    assert llama3.encode("x<|begin_of_text|>") == [bos, llama3.token_id(b"x"), bos]  # as written
    qwen2, _ = tokenizer_fixture("qwen2")
    assert qwen2.bos_token_id is None and qwen2.encode("") == []


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_json_added_tokens_in_a_text_are_their_ids(kind):
    """Each added token written in a text is its one id, wherever it stands; one less a
    character is ordinary text."""
    tokenizer, _ = tokenizer_fixture(kind)
    prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    ordinary = tokenizer.encoding.encode_ordinary  # BPE alone: no added tokens, no BOS
    for text, token_id in tokenizer.added_tokens.items():
        if token_id == tokenizer.bos_token_id:
            continue
        assert tokenizer.encode(text) == prefix + [token_id]
        between = prefix + ordinary("a ") + [token_id] + ordinary("b")
        assert tokenizer.encode(f"a {text}b") == between
        assert token_id not in tokenizer.encode(text[:-1])


def test_tokenizer_json_nfc_applies_where_declared():
    """Qwen2's normalizer is NFC: decomposed text (e + U+0301) encodes as composed text does.
    Llama 3 declares none: there the two differ, as in tokenizers."""
    composed, decomposed = "café naïve Ångström", "cafe\u0301 nai\u0308ve A\u030angstro\u0308m"
    qwen2, _ = tokenizer_fixture("qwen2")
    assert qwen2.encode(decomposed) == qwen2.encode(composed)
    llama3, _ = tokenizer_fixture("llama3")
    assert llama3.encode(decomposed) != llama3.encode(composed)


def test_tokenizer_json_ids_past_the_vocabulary_have_no_text():
    """Qwen's embedding has rows past its tokenizer's ids: such an id (or a negative one)
    decodes to nothing, in decode and in a request's Detokenizer."""
    qwen2, _ = tokenizer_fixture("qwen2")
    ids = qwen2.encode("ab")
    assert qwen2.decode([qwen2.n_vocab, *ids, qwen2.n_vocab + 100, -1]) == "ab"
    detokenizer = Detokenizer(qwen2, [])
    for token in [*ids, qwen2.n_vocab, qwen2.token_id("<|im_end|>")]:
        detokenizer.append(token)
    assert detokenizer.new_text(finished=True) == "ab"


def test_sentencepiece_style_tokenizer_is_refused_by_name(tmp_path):
    """Llama 2's kind (Metaspace, byte_fallback) is refused saying what it is and who uses it,
    from its tokenizer.json or from a directory holding only tokenizer.model."""
    with pytest.raises(ValueError, match=re.escape(
            "a SentencePiece-style tokenizer (Metaspace pre_tokenizer, Metaspace decoder, "
            "byte_fallback), which is not served: Llama 2, TinyLlama and Mistral 7B use it")):
        load_tokenizer(os.path.join(TOKENIZER_FIXTURES, "sentencepiece"))
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x05<unk>")
    with pytest.raises(ValueError, match=re.escape(
            "has only a SentencePiece model (tokenizer.model, no tokenizer.json), which is not "
            "served: Llama 2, TinyLlama and Mistral 7B use it")):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("where, value, message", [
    ("model.type", "WordPiece", "a WordPiece model is not served"),
    ("model.dropout", 0.1, "BPE's dropout 0.1 is not served"),
    ("model.merges.0", ["e", "r"], "the merges are not in the order of their tokens' ids"),
    ("normalizer", {"type": "NFKC"}, "normalizer NFKC is not served"),
    ("pre_tokenizer", {"type": "Whitespace"}, "pre-tokenizer Whitespace is not served"),
    ("pre_tokenizer.pretokenizers.0.behavior", "Removed", "a Split pre-tokenizer is served as"),
    ("pre_tokenizer.pretokenizers.1.add_prefix_space", True, "add_prefix_space is not served"),
    ("pre_tokenizer.pretokenizers.1.use_regex", True, "(ByteLevel use_regex True) is not served"),
    ("post_processor.processors.1.single", [{"Sequence": {"id": "A", "type_id": 0}},
                                            {"SpecialToken": {"id": "<|eot_id|>", "type_id": 0}}],
     "template '$A <|eot_id|>' is not served"),
    ("decoder", {"type": "WordPiece"}, "decoder WordPiece is not served"),
    ("added_tokens.1.lstrip", True, "added token '<|end_of_text|>' takes the spaces beside it"),
    ("model.vocab", {}, "the vocabulary has no token"),
    ("added_tokens.0.content", "", "is empty"),
    ("added_tokens.1.id", 800, "two added tokens have id 800"),
])
def test_tokenizer_json_not_served_is_refused_by_name(tmp_path, where, value, message):
    """Llama 3's tokenizer.json with one thing changed to what is not served: a ValueError
    naming the file and that thing, at load time."""
    write_changed_llama3_tokenizer(tmp_path, where, value)
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        load_tokenizer(str(tmp_path))
    assert str(refused.value).startswith(str(tmp_path / "tokenizer.json") + ": ")


@pytest.mark.parametrize("where, value", [
    ("model", "BPE"), ("pre_tokenizer", "ByteLevel"), ("added_tokens.0", {"id": 5}),
    ("pre_tokenizer.pretokenizers.0.pattern.Regex", ""),
], ids=["model-a-string", "pre-tokenizer-a-string", "added-token-without-content",
        "regex-matching-nothing"])
def test_a_malformed_tokenizer_json_is_an_error_at_load_time(tmp_path, where, value):
    """Not a crash, and not at every request: an empty Split regex loaded before, and then
    made tiktoken panic at every encode."""
    write_changed_llama3_tokenizer(tmp_path, where, value)
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}: malformed tokenizer"):
        load_tokenizer(str(tmp_path))


def write_changed_llama3_tokenizer(path, where: str, value) -> None:
    """Llama 3's tokenizer.json, the value at `where` (dotted keys, list indices as numbers)
    changed to `value`, written in directory path."""
    with open(os.path.join(TOKENIZER_FIXTURES, "llama3", "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    *parents, last = where.split(".")
    part = spec
    for key in parents:
        part = part[int(key)] if isinstance(part, list) else part[key]
    part[int(last) if isinstance(part, list) else last] = value
    (path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")


def test_engine_encodes_a_text_prompt_with_the_checkpoints_tokenizer_json(tmp_path):
    """A checkpoint with a Llama 3 tokenizer.json (its bytes only: the fixture models embed
    257 ids, <|begin_of_text|> = 256) and vocab.json beside it: tokenizer.json is read, a text
    prompt gets the BOS once, and the output's text leaves it out."""
    shutil.copytree(os.path.join(MODEL_FIXTURES, "llama3-tied"), tmp_path, dirs_exist_ok=True)
    write_byte_tokenizer(tmp_path)  # read only if tokenizer.json were not there
    with open(os.path.join(TOKENIZER_FIXTURES, "llama3", "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["model"]["vocab"] = {ch: i for i, (_, ch) in enumerate(gpt2_byte_chars())}
    spec["model"]["merges"] = []
    spec["added_tokens"] = [spec["added_tokens"][0] | {"id": 256}]  # <|begin_of_text|>
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    llm = checkpoint_llm(tmp_path, kv_cache_tokens=1024)
    tokenizer = llm.engine.tokenizer
    assert tokenizer.bos_token_id == 256
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={256: 100})
    for prompt in ["Hi", "<|begin_of_text|>Hi"]:
        out = llm.generate([prompt], params)[0]
        assert out.prompt_token_ids == [256, tokenizer.token_id(b"H"), tokenizer.token_id(b"i")]
        assert out.outputs[0].token_ids == [256] * 4 and out.outputs[0].text == ""


def test_tokenizer_json_drops_the_bytes_its_vocabulary_lacks_as_tokenizers_does():
    """SmolLM2's published tokenizer.json has no token for 21 bytes (six control characters,
    0xc0, 0xc1, 0xf1, 0xf2, 0xf5-0xff); tokenizers drops such a byte from each pre-tokenized
    piece and merges what is left. The missing_bytes fixture (SmolLM2's kind less those bytes)
    writes them alone, at either end, between letters, digits, punctuation and spaces,
    repeated, beside added tokens and as the first byte of characters U+40000 and up: exactly
    tokenizers' ids, and its decode."""
    tokenizer, cases = tokenizer_fixture("missing_bytes")
    for case in cases:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.decode(case["ids"]) == case["decoded"], case["text"]
