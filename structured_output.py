"""Structured output: a JSON schema, a regular expression, a list of choices or a grammar,
enforced token by token (vLLM's structured_outputs; OpenAI's response_format).

A constraint is compiled (by llguidance) into a matcher over the model's own tokens: from
the text so far, which tokens may come next. At each step, every constrained sequence that
samples writes its allowed tokens into its entry of a bitmask (bit t: token t may come next),
the bitmask goes to the device in one copy, and there the logits of the tokens it rules out
become -inf, before every other sampling transform: no temperature, penalty or top-p can
bring them back. The token sampled advances the matcher; once the grammar accepts and allows
nothing more, the sequence ends (finish_reason "stop"). A batch with no constrained sequence
does none of this.

In this file, in order: the limits, StructuredOutputsParams (what a request asks, vLLM's
names), how a constraint becomes llguidance's grammar (closed_objects, llguidance_grammar),
StructuredOutputManager (the engine's: llguidance's tokenizer, built from ours once, and the
compiled constraints, cached by their text), Grammar (one sequence's matcher), the bitmask
(grammar_bitmask, unpack_bitmask), then the step's hooks: apply_grammar_bitmask and
accept_token. Elsewhere, a line each: SamplingParams.structured_outputs; Sequence.grammar;
Engine.add_request compiles (before its lock, before anything is queued; the server first
compiles on a worker thread, Server.compile_structured_outputs, so neither its event loop
nor the engine's steps wait) and gives each sample a Grammar; ModelRunner._sample calls
apply_grammar_bitmask; Engine._append_tokens calls accept_token; check_stop ends a sequence
whose grammar is_terminated().

llguidance is imported at the first constrained request (import_llguidance): an engine runs
without it (the GPU image has none), and a constrained request there fails alone, saying
which package it needs (a 400 over HTTP).

Left out: structural tags and reasoning parsers (vLLM's: the constraint starts after
</think>), jump-forward decoding, speculative drafts for constrained sequences.
"""
import collections
import json
import threading
import time
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

import cuda_runtime

GRAMMAR_OF = attrgetter("grammar")  # a Sequence's matcher, or None

# Limits, checked before a request is queued: a constraint's text (a schema, a regular
# expression, a grammar, the choices joined), the time its compilation may take, and
# llguidance's own (its grammar's symbols; the fuel of the lexer's work at compile time and at
# each step, about 50k and 14k a millisecond: a step's mask is bounded too).
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_COMPILE_SECONDS = 2.0
LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              verbose_errors=False)  # errors name the problem, not the parser's state
MAX_CACHED_GRAMMARS = 256   # compiled constraints kept, the least recently used dropped
# JSON's whitespace between tokens: one space, or a newline and an indent of at most 12 (the
# default, unbounded, lets a small model write newlines until max_tokens, never closing it)
JSON_WHITESPACE = r"(\x20|\n[\x20\x09]{0,12})?"
KINDS = ("json", "regex", "choice", "grammar", "json_object")  # one of them, per request
# a JSON schema's keywords whose value maps names to schemas, and those whose value is data
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
DATA_KEYWORDS = ("enum", "const", "default", "examples")


class StructuredOutputUnavailableError(ValueError):
    """A constrained request, where llguidance is not installed: it alone is refused."""


def import_llguidance():
    """The llguidance module (and its tiktoken bridge), imported at first use: an engine that
    constrains nothing needs no llguidance; StructuredOutputUnavailableError without it."""
    try:
        import llguidance
        import llguidance.tiktoken
    except ImportError:
        raise StructuredOutputUnavailableError(
            "structured output needs the llguidance package (>= 1.9), which is not installed "
            "here: pip install llguidance") from None
    return llguidance


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, as vLLM names them: exactly one of json (a JSON
    schema, as a dict or its text), regex (the whole output matches it, Rust's regex syntax),
    choice (the output is one of these strings), grammar (Lark, or llama.cpp's GBNF) or
    json_object (any JSON object)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (vLLM's)

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {', '.join(given) or 'none'}")
        if type(self.disable_any_whitespace) is not bool:
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r}")
        check_kind(self.kind, getattr(self, self.kind))

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or a dict of its fields (a --jsonl line's, a
        request body's) -> one (or None); ValueError naming the field otherwise."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object with one of json, regex, "
                             f"choice, grammar, json_object; got {value!r:.80}")
        unknown = [name for name in value if name not in (*KINDS, "disable_any_whitespace")]
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not supported; use one of "
                             f"{', '.join(KINDS)}")
        return cls(**value)


def check_kind(kind: str, value) -> None:
    """ValueError naming structured_outputs.<kind> unless its value has the right type and
    size (whether it compiles is the manager's to say)."""
    name = f"structured_outputs.{kind}"
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{name} must be true, got {value!r}")
        return
    if kind == "json" and not isinstance(value, (dict, str)):
        raise ValueError(f"{name} must be a JSON schema (an object or its text), got {value!r:.80}")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise ValueError(f"{name} must be a non-empty list of strings, got {value!r:.80}")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"{name} has {len(value)} strings; at most {MAX_CHOICES}")
    num_chars = len(constraint_text(kind, value))
    if num_chars > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} has {num_chars} characters; at most {MAX_GRAMMAR_CHARS}")


def constraint_text(kind: str, value) -> str:
    """A constraint as text: what the cache is keyed by, and what is compiled."""
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "choice" or (kind == "json" and isinstance(value, dict)):
        return json.dumps(value)
    return value


def closed_objects(schema):
    """A copy of a JSON schema in which every object that names its properties and says
    nothing of others (additionalProperties) allows no others, as vLLM's default backend
    (xgrammar's strict mode) and OpenAI's strict schemas read it: otherwise a small model adds
    keys of its own until max_tokens (SmolLM2-135M, in 5 of 18 outputs), never closing the
    object. Example: {"properties": {"a": {...}}} -> {"properties": {"a": {...}},
    "additionalProperties": false}; a schema that allows others keeps them."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            closed[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(item) for name, item in value.items()}
        else:
            closed[key] = closed_objects(value)
    if "properties" in schema and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The constraint in llguidance's own form (a JSON schema, a regular expression and a Lark
    grammar each become one), to compile; ValueError if its text is not what its kind needs
    (a schema that is not JSON, a GBNF grammar that does not convert)."""
    llguidance = import_llguidance()
    kind = params.kind
    text = constraint_text(kind, getattr(params, kind))
    if kind in ("json", "json_object"):
        whitespace = dict(whitespace_flexible=False) if params.disable_any_whitespace \
            else dict(whitespace_pattern=JSON_WHITESPACE)
        schema = closed_objects(json.loads(text))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":  # each string as a Lark literal (JSON's escapes are Lark's)
        choices = json.loads(text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.grammar_from("grammar", text)  # Lark as is; GBNF converted to Lark


class StructuredOutputManager:
    """The engine's side of structured output (vLLM's name): llguidance's view of the model's
    tokenizer, built at the first constrained request (about 0.1 s for 49,152 tokens; a server
    that constrains nothing never builds it), and each compiled constraint, cached by its
    text so a repeated schema compiles once. compile() may be called from any thread."""

    def __init__(self, tokenizer, eos_token_ids: list[int], vocab_size: int):
        self.tokenizer = tokenizer  # tokenizer.py's: its tiktoken encoding is llguidance's too
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self._cache: collections.OrderedDict = collections.OrderedDict()  # (kind, text) -> matcher
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations (cache misses), for the tests and bench.py

    @property
    def ll_tokenizer(self) -> "llguidance.LLTokenizer":
        llguidance = import_llguidance()
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.tiktoken.lltokenizer_from_encoding(
                    self.tokenizer.encoding, n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams | None, field: str | None = None
                ) -> "llguidance.LLMatcher | None":
        """The compiled constraint of params (None: unconstrained), from the cache or compiled
        now; ValueError naming the field (`field`, else structured_outputs.<kind>) if it does
        not compile (an invalid schema or regular expression, an unsupported keyword) or is
        too large or too slow to. Each sequence matches with a copy (new_grammar)."""
        if params is None:
            return None
        key = (params.kind, params.disable_any_whitespace,
               constraint_text(params.kind, getattr(params, params.kind)))
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                return matcher
        matcher = self._compile(params, field or f"structured_outputs.{params.kind}")
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def _compile(self, params: StructuredOutputsParams, field: str) -> "llguidance.LLMatcher":
        llguidance = import_llguidance()
        ll_tokenizer = self.ll_tokenizer
        start = time.perf_counter()
        try:
            grammar = llguidance_grammar(params)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        # llguidance reports a bad grammar as the matcher's error state, never by raising
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        seconds = time.perf_counter() - start
        if matcher.is_error():
            raise ValueError(f"{field}: {error_summary(matcher.get_error())}")
        if seconds > MAX_COMPILE_SECONDS:
            raise ValueError(f"{field} took {seconds:.1f} s to compile; at most "
                             f"{MAX_COMPILE_SECONDS} s")
        self.num_compiled += 1
        return matcher


def error_summary(error: str) -> str:
    """llguidance's error on one line: its first, then the reason a regular expression's parser
    gives on a line of its own ("error: unclosed group"), without the excerpts it draws."""
    lines = error.strip().splitlines()
    reasons = [line.removeprefix("error: ") for line in lines[1:] if line.startswith("error: ")]
    return " ".join([lines[0], *reasons])


class Grammar:
    """One sequence's matcher (vLLM's StructuredOutputGrammar): a copy of its request's
    compiled constraint that has consumed the sequence's output tokens so far."""

    def __init__(self, compiled: "llguidance.LLMatcher"):
        self.matcher = compiled.deep_copy()  # microseconds: the compiled parts are shared
        self.num_accepted_tokens = 0

    def accept_token(self, token: int) -> None:
        """Advance by a sampled token; ValueError if the constraint does not allow it, which
        happens only when it left no token to sample (min_tokens' or stop_token_ids' bans
        covered every token it allows): its logits were all -inf."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"structured_outputs: token {token} does not fit the constraint; "
                             "no token it allows was left to sample (min_tokens and "
                             "stop_token_ids ban some)")
        self.num_accepted_tokens += 1

    def is_terminated(self) -> bool:
        """The grammar accepts what is there and allows nothing more: the sequence ends."""
        return self.matcher.is_stopped()

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state the one these output tokens lead to: it is already, unless
        it has fallen behind them (the engine advances it at every token it appends), then it
        is rebuilt from them, as a recomputed sequence's KV cache is from its tokens."""
        if self.num_accepted_tokens == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_accepted_tokens = 0
        for token in output_token_ids:
            self.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into entry `index` of a host bitmask
        (n, cdiv(vocab, 32)) int32: bit t % 32 of word t // 32 set if token t may come next
        (none if the matcher failed)."""
        words = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


def new_grammar(compiled: "llguidance.LLMatcher | None") -> Grammar | None:
    """A new sequence's Grammar for its request's compiled constraint (None: unconstrained)."""
    if compiled is None:
        return None
    return Grammar(compiled)


def grammar_bitmask(seqs: list, constrained: list[int], vocab_size: int) -> torch.Tensor:
    """The allowed tokens of the sequences at indices `constrained` of seqs, an entry each,
    (c, W) int32 on the host, W = cdiv(vocab, 32), each filled by its sequence's matcher
    (brought up to the sequence's tokens first)."""
    num_words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(constrained), num_words), dtype=torch.int32)
    for i, index in enumerate(constrained):
        seq = seqs[index]
        seq.grammar.sync(seq.token_ids[seq.num_prompt_tokens:])
        seq.grammar.fill_bitmask(bitmask, i)
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(c, W) int32 on the host -> (c, vocab) bool: True where a token's bit is set. Example:
    word 0 = 0b...0101 sets tokens 0 and 2 (bit i of word w is token 32w + i). numpy's
    unpackbits, over the words' bytes (little-endian, as on x86 and ARM) least bit first, puts
    the bits in token order: 0.5 ms for (32, 49,152), where shifts in torch take 8."""
    as_bytes = bitmask.numpy().view(np.uint8)                                # (c, 4W)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size]  # (c, vocab)
    return torch.from_numpy(bits).view(torch.bool)


# ----------------------------------------------------------------------------- the step's hooks

def apply_grammar_bitmask(seqs: list, logits: torch.Tensor) -> torch.Tensor:
    """The logits (n, vocab) of a step's sampling positions (seqs (n,): each one's sequence),
    with -inf on every token that a constrained sequence's grammar rules out; the same tensor,
    untouched, if none is constrained. Not in place: the log-probabilities returned are the
    model's own. The mask (a byte a token, unpacked on the host) and the indices it covers go
    to the device as the step's other inputs do (sampling.upload): pinned on CUDA, never
    waited for."""
    grammars = list(map(GRAMMAR_OF, seqs))  # a C loop: a plain step runs no bytecode a row
    if grammars.count(None) == len(grammars):  # most steps: none constrained
        return logits
    constrained = [i for i, grammar in enumerate(grammars) if grammar is not None]
    vocab_size = logits.shape[1]
    bitmask = grammar_bitmask(seqs, constrained, vocab_size)
    ruled_out = unpack_bitmask(~bitmask, vocab_size)  # the negated words: set where ruled out
    ruled_out = to_device(ruled_out, logits.device)
    if len(constrained) == len(seqs):  # every one constrained: one pass, no gather
        return logits.masked_fill(ruled_out, float("-inf"))
    index = to_device(torch.tensor(constrained), logits.device)
    masked = logits[index].masked_fill(ruled_out, float("-inf"))  # (c, vocab)
    return logits.index_copy(0, index, masked)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device in one non-blocking copy, pinned on CUDA (torch's caching
    host allocator, as sampling.upload's: imported from there, it would import this module)."""
    if cuda_runtime.is_cuda(device):
        host = cuda_runtime.pinned(host)
    return host.to(device, non_blocking=True)


def accept_token(seq, token: int) -> None:
    """Advance a constrained sequence's grammar by the token just appended to it (check_stop
    then ends it if the grammar is terminated); ValueError, which fails that request alone,
    if the token does not fit."""
    if seq.grammar is None:
        return
    seq.grammar.accept_token(token)
