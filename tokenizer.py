"""Tokenizers: text to token ids and back, and chat templates.

Tokenizer wraps tiktoken's byte-level BPE with what a Hugging Face tokenizer.json adds (added
tokens, NFC, a BOS); it is made from the presets' byte-level vocabulary, GPT-2's BPE files or
a tokenizer.json (Llama 3, Qwen2/3, SmolLM2; SentencePiece refused). The Detokenizer turns one
sequence's tokens into text a step at a time and finds its stop strings (each
scheduler.Sequence holds one). ChatTemplate is a checkpoint's Jinja2 chat template, rendered
as transformers' apply_chat_template renders it.

checkpoint.py loads these from a checkpoint directory; the engine detokenizes; the front ends
(server.py, cli.py) encode prompts and render chat templates.
"""
import codecs
import json
import os
import re
import unicodedata
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.sandbox
import regex
import tiktoken

EOT = "<|endoftext|>"
RECENT_CHARS = 64  # Detokenizer: the newest text kept in one string, besides a stop's overlap
GPT2_PATTERN = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"
# SmolLM2's pre-tokenizer as one regex: Digits(individual_digits) makes each digit a piece and
# ByteLevel splits the text between digits with GPT2_PATTERN, where spaces before a digit end
# that text, so they stay one piece: GPT-2's (?!\S) becomes "not before a non-digit non-space".
DIGITS_GPT2_PATTERN = (r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++"
                       r"|\s+(?![^\s\p{N}])|\s")
SENTENCEPIECE_REFUSAL = ("is not served: Llama 2, TinyLlama and Mistral 7B use it; nanoserve "
                         "serves byte-level BPE (GPT-2, Llama 3, Qwen2/2.5/3, SmolLM2)")


def gpt2_byte_chars() -> list[tuple[int, str]]:
    """GPT-2's 256 one-byte tokens in id order, as (byte, the character vocab.json writes)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return [(b, chr(b)) for b in printable] + [(b, chr(256 + n)) for n, b in enumerate(others)]


BYTE_OF_CHAR = {ch: b for b, ch in gpt2_byte_chars()}  # a byte-level file's character -> byte


def byte_level_bytes(token: str) -> bytes:
    """A token as byte-level files write it (vocab.json, merges, tokenizer.json: a character
    per byte, gpt2_byte_chars's) -> its bytes; KeyError for a character that is no byte's."""
    return bytes(BYTE_OF_CHAR[ch] for ch in token)


class Tokenizer:
    """Text <-> token ids, for the engine. tiktoken does the byte-level BPE (in Rust); around it
    is what a Hugging Face tokenizer.json adds: added tokens, each its id wherever a text writes
    it (those marked special are left out of decoded text, as vLLM's skip_special_tokens; the
    others, as Qwen's <tool_call>, are text), an NFC normalizer (Qwen2/3's) and a BOS that the
    post-processor puts before a text (Llama 3's <|begin_of_text|>). The byte-level tokenizer,
    GPT-2's files and tokenizer.json all give one."""

    def __init__(self, name: str, pat_str: str, mergeable_ranks: dict[bytes, int],
                 added_tokens: dict[str, int], special_token_ids: set[int],
                 bos_token: str | None = None, nfc: bool = False):
        # a rank is the token's id: tiktoken first merges the adjacent pair whose joined bytes
        # have the lowest; added tokens are tiktoken's special tokens (decoded as their text)
        self.encoding = tiktoken.Encoding(name=name, pat_str=pat_str,
                                          mergeable_ranks=mergeable_ranks,
                                          special_tokens=added_tokens)
        self.added_tokens = added_tokens                       # text -> id
        self.special_token_ids = frozenset(special_token_ids)  # no text in decoded output
        self.bos_token = bos_token
        self.bos_token_id = None if bos_token is None else added_tokens[bos_token]
        self.nfc = nfc
        self.n_vocab = self.encoding.n_vocab  # ids 0..n_vocab-1; an embedding may have more rows
        self.pat_str = pat_str
        # bytes that are no token, dropped from a text as Hugging Face's tokenizers drops them
        self.missing_bytes = frozenset(b for b in range(256) if bytes([b]) not in mergeable_ranks)
        self.added_pattern = None  # added tokens, longest first: of two at one place, the longer
        if added_tokens:
            longest_first = sorted(added_tokens, key=len, reverse=True)
            self.added_pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def encode(self, text: str) -> list[int]:
        """A text's token ids, as Hugging Face's tokenizer gives them: an added token the text
        writes is its id; the text between them is normalized (NFC, if declared), split by
        the regex and merged; the BOS comes first if the post-processor adds one, unless the
        text starts with it already (a chat template writes it): never two. ValueError for
        a text with a lone surrogate (JSON's escape \\ud800 makes one), which UTF-8 cannot
        hold."""
        check_utf8(text)
        pieces = [text] if self.added_pattern is None else self.added_pattern.split(text)
        ids = []
        for i, piece in enumerate(pieces):
            if i % 2 == 1:  # split() puts the added tokens it found at the odd places
                ids.append(self.added_tokens[piece])
            elif piece:
                if self.nfc:
                    piece = unicodedata.normalize("NFC", piece)
                ids += self.encode_ordinary(piece)
        if self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Text without added tokens -> ids: tiktoken splits it by the regex and merges each
        piece. A byte the vocabulary has no token for (SmolLM2 lacks 21, control characters
        and bytes no UTF-8 text holds) is dropped as Hugging Face's tokenizers drops it: from
        its piece, after the split, the rest of the piece merged as if it had not been there.
        tiktoken would fail on such a byte, so a text with one is split here, with the regex
        module that tiktoken itself splits with in Python (its own dependency, not ours)."""
        if not self.missing_bytes.intersection(text.encode()):
            return self.encoding.encode_ordinary(text)
        ids = []
        for piece in regex.findall(self.pat_str, text):
            kept = bytes(b for b in piece.encode() if b not in self.missing_bytes)
            if kept:
                ids += self.encoding._encode_single_piece(kept)  # a piece: no regex split
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text, without the special tokens unless not skip_special_tokens (vLLM's
        /detokenize keeps them); bytes that are no UTF-8 character become U+FFFD."""
        data = b"".join([self.token_bytes(t, skip_special_tokens) for t in token_ids])
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """One token's bytes (a piece of a UTF-8 character, maybe); b"" for a special token
        (unless not skip_special_tokens) and for an id that is no token: Qwen's embedding has
        rows past its tokenizer's n_vocab."""
        if skip_special_tokens and token_id in self.special_token_ids:
            return b""
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError):  # no such id (OverflowError: negative or >= 2**32)
            return b""

    def token_id(self, token: str | bytes) -> int:
        """The id of one token: an added token's text (<|im_end|>) or a vocabulary token's
        bytes; KeyError if it is no one token."""
        return self.encoding.encode_single_token(token)


def byte_ranks() -> dict[bytes, int]:
    """GPT-2's first 256 tokens, one a byte, each byte -> its id (GPT-2's order of the bytes)."""
    return {bytes([b]): i for i, (b, _) in enumerate(gpt2_byte_chars())}


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens (GPT-2's first 256 ids) plus <|endoftext|> = 256: GPT-2 without merges."""
    return Tokenizer("bytes", GPT2_PATTERN, byte_ranks(), {EOT: 256}, {256})


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of checkpoint directory `path`: its tokenizer.json (Llama 3, Qwen2/2.5/3,
    SmolLM2) if it has one, else GPT-2's BPE files. Files it cannot read as a tokenizer are a
    ValueError naming the directory, here, not at the first request: a text is encoded once
    to see that the files work."""
    hf_file = os.path.join(path, "tokenizer.json")
    try:
        if os.path.exists(hf_file):
            tokenizer = load_hf_tokenizer(hf_file)
        else:
            tokenizer = load_gpt2_tokenizer(path)
        tokenizer.encode("Hello, world! 123")
        return tokenizer
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 (tiktoken's Rust panics are BaseExceptions)
        if isinstance(e, ValueError) and str(e).startswith(path):  # ours: names file and why
            raise
        raise ValueError(f"{path}: malformed tokenizer files: {type(e).__name__}: "
                         f"{str(e)[:200]}") from None


def tokenizer_files(path: str) -> tuple[str, str]:
    """The vocabulary and merges files in directory `path`: Hugging Face's names, else OpenAI's."""
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        vocab_file = os.path.join(path, vocab_name)
        merges_file = os.path.join(path, merges_name)
        if os.path.exists(vocab_file) and os.path.exists(merges_file):
            return vocab_file, merges_file
    if os.path.exists(os.path.join(path, "tokenizer.model")):
        raise ValueError(f"{path} has only a SentencePiece model (tokenizer.model, no "
                         f"tokenizer.json), which {SENTENCEPIECE_REFUSAL}")
    raise ValueError(f"{path} has no tokenizer: expected tokenizer.json, vocab.json + merges.txt "
                     "or encoder.json + vocab.bpe")


def load_gpt2_tokenizer(path: str) -> Tokenizer:
    """GPT-2 BPE: Hugging Face's vocab.json + merges.txt, or OpenAI's encoder.json + vocab.bpe.
    The ranks the merges give must be the ids the vocabulary gives."""
    vocab_file, merges_file = tokenizer_files(path)
    ranks = byte_ranks()
    with open(merges_file, encoding="utf-8") as f:
        merges = [line.split() for line in f.read().split("\n")[1:] if line]  # line 0: #version
    ranks |= {byte_level_bytes(a) + byte_level_bytes(b): rank
              for rank, (a, b) in enumerate(merges, start=256)}
    vocab = read_json(vocab_file)
    if EOT not in vocab:
        raise ValueError(f"{vocab_file} has no {EOT} token")
    eot_id = vocab.pop(EOT)
    if {byte_level_bytes(t): i for t, i in vocab.items()} != ranks:
        raise ValueError(f"{vocab_file} and {merges_file} disagree on the token ranks")
    return Tokenizer(os.path.basename(os.path.normpath(path)), GPT2_PATTERN, ranks,
                     {EOT: eot_id}, {eot_id})


def load_hf_tokenizer(file: str) -> Tokenizer:
    """A Hugging Face tokenizer.json, if it is byte-level BPE as GPT-2's, Llama 3's, Qwen2/2.5/
    3's and SmolLM2's are; anything else is refused, naming what is not served. Its vocabulary
    becomes tiktoken's ranks, its pre-tokenizer one tiktoken regex, its added tokens tiktoken's
    special tokens, its post-processor's leading special token the BOS. tiktoken looks each
    piece up whole before merging (ignore_merges, which Llama 3 sets); a trained BPE reaches
    the same tokens without it (the fixtures in .ci/fixtures/tokenizers check both)."""
    spec = read_json(file)
    check_not_sentencepiece(spec, file)
    bpe = spec.get("model") or {}
    check_bpe_model(bpe, file)
    check_decoder(spec.get("decoder"), file)
    added_tokens, special_token_ids = read_added_tokens(spec.get("added_tokens") or [], file)
    return Tokenizer(os.path.basename(os.path.dirname(os.path.abspath(file))),
                     pre_tokenizer_pattern(spec.get("pre_tokenizer"), file),
                     bpe_ranks(bpe, set(added_tokens.values()), file),
                     added_tokens, special_token_ids,
                     bos_token=post_processor_bos(spec.get("post_processor"), added_tokens, file),
                     nfc=declares_nfc(spec.get("normalizer"), file))


def components(component: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer, pre-tokenizer, post-processor or decoder as a list of
    parts: a Sequence's (listed under `key`), flattened; one part alone; none for null."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [part for sub in component.get(key) or [] for part in components(sub, key)]
    return [component]


def check_not_sentencepiece(spec: dict, file: str) -> None:
    """SentencePiece-style BPE (a space is ▁, a character outside the vocabulary its <0x..>
    byte tokens) is refused first, by its signs: of what is not served, it is the common case."""
    signs = []
    for where, key in (("normalizer", "normalizers"), ("pre_tokenizer", "pretokenizers"),
                       ("decoder", "decoders")):
        for part in components(spec.get(where), key):
            if part.get("type") in ("Metaspace", "Prepend", "ByteFallback"):
                signs.append(f"{part['type']} {where}")
    if (spec.get("model") or {}).get("byte_fallback"):
        signs.append("byte_fallback")
    if signs:
        raise ValueError(f"{file}: a SentencePiece-style tokenizer ({', '.join(signs)}), which "
                         f"{SENTENCEPIECE_REFUSAL}")


def check_bpe_model(bpe: dict, file: str) -> None:
    """The model is plain BPE: no dropout, no subword prefix or word suffix."""
    kind = bpe.get("type", "BPE" if "merges" in bpe else None)  # old files may omit it
    if kind != "BPE":
        raise ValueError(f"{file}: a {kind} model is not served: byte-level BPE only")
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if bpe.get(option):
            raise ValueError(f"{file}: BPE's {option} {bpe[option]!r} is not served")


def check_decoder(decoder: dict | None, file: str) -> None:
    """Decoding is byte-level: ids -> bytes -> UTF-8, what ByteLevel's decoder does."""
    types = [part.get("type") for part in components(decoder, "decoders")]
    if types not in ([], ["ByteLevel"]):
        raise ValueError(f"{file}: decoder {' + '.join(map(str, types))} is not served: "
                         "ByteLevel only")


def read_added_tokens(entries: list, file: str) -> tuple[dict[str, int], set[int]]:
    """Every added token, text -> id (each is its id wherever a text writes it, special or not),
    and the ids of those marked special, which decoded text leaves out."""
    added = {}
    special = set()
    for entry in entries:
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word"):
            raise ValueError(f"{file}: added token {entry['content']!r} takes the spaces beside "
                             "it or matches whole words only (lstrip, rstrip, single_word), "
                             "which is not served")
        if not entry["content"]:  # it would match between every two characters
            raise ValueError(f"{file}: added token {entry['id']} is empty")
        if entry["id"] in added.values():  # decoding the id could give either text
            raise ValueError(f"{file}: two added tokens have id {entry['id']}")
        added[entry["content"]] = entry["id"]
        if entry.get("special"):
            special.add(entry["id"])
    return added, special


def pre_tokenizer_pattern(pre_tokenizer: dict | None, file: str) -> str:
    """The one tiktoken regex that splits a text as the pre-tokenizer does: ByteLevel's own
    (GPT-2's regex; use_regex), a Split regex before a ByteLevel that splits no more (Llama 3,
    Qwen2/3), or Digits(individual_digits) before ByteLevel's (SmolLM2)."""
    parts = components(pre_tokenizer, "pretokenizers")
    types = [part.get("type") for part in parts]
    described = " + ".join(map(str, types)) or "none"
    if types[-1:] != ["ByteLevel"]:
        raise ValueError(f"{file}: pre-tokenizer {described} is not served: byte-level BPE "
                         "ends with ByteLevel")
    byte_level = parts[-1]
    if byte_level.get("add_prefix_space"):
        raise ValueError(f"{file}: ByteLevel's add_prefix_space is not served")
    splits = byte_level.get("use_regex", True)  # GPT-2's regex, after the parts before it
    if types == ["ByteLevel"] and splits:
        return GPT2_PATTERN
    if types == ["Split", "ByteLevel"] and not splits:
        return split_pattern(parts[0], file)
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and splits:
        return DIGITS_GPT2_PATTERN
    raise ValueError(f"{file}: pre-tokenizer {described} (ByteLevel use_regex {splits}) is not "
                     "served: ByteLevel (GPT-2), Split + ByteLevel (Llama 3, Qwen2/3) or "
                     "Digits(individual_digits) + ByteLevel (SmolLM2) only")


def split_pattern(split: dict, file: str) -> str:
    """A Split pre-tokenizer's regex for tiktoken. Split (Isolated) makes each match a piece and
    each stretch between matches another; tiktoken drops what no match covers, so a stretch is
    one more alternative (Llama 3's and Qwen2's regexes leave none: it never matches)."""
    regex = (split.get("pattern") or {}).get("Regex")
    if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise ValueError(f"{file}: a Split pre-tokenizer is served as Llama 3's and Qwen2's "
                         "only: a Regex pattern, behavior Isolated, not inverted")
    return f"{regex}|(?:(?!{regex})[\\s\\S])+"


def declares_nfc(normalizer: dict | None, file: str) -> bool:
    """Whether a text is NFC-normalized before it is split (Qwen2/3's normalizer); none other
    is served."""
    types = [part.get("type") for part in components(normalizer, "normalizers")]
    if types not in ([], ["NFC"]):
        raise ValueError(f"{file}: normalizer {' + '.join(map(str, types))} is not served: "
                         "none, or NFC")
    return types == ["NFC"]


def bpe_ranks(bpe: dict, added_ids: set[int], file: str) -> dict[bytes, int]:
    """tiktoken's mergeable ranks: each vocabulary token's bytes (ByteLevel writes a byte as one
    of GPT-2's 256 characters) -> its id, less the added tokens (GPT-2 and SmolLM2 list theirs
    in the vocabulary too). A byte may lack a token (SmolLM2's vocabulary has none for 21 of
    them: Tokenizer drops those from a text); the merges must be in id order."""
    vocab = bpe.get("vocab") or {}
    ranks = {}
    for token, token_id in vocab.items():
        if token_id in added_ids:
            continue
        if not all(ch in BYTE_OF_CHAR for ch in token):
            raise ValueError(f"{file}: vocabulary token {token!r} is not byte-level: byte-level "
                             "BPE only")
        ranks[byte_level_bytes(token)] = token_id
    if not ranks:
        raise ValueError(f"{file}: the vocabulary has no token")
    check_merge_order(bpe.get("merges") or [], vocab, file)
    return ranks


def check_merge_order(merges: list, vocab: dict[str, int], file: str) -> None:
    """tiktoken merges the adjacent pair whose joined bytes have the lowest rank (id); Hugging
    Face's BPE the pair listed first in merges. They can agree only if the merges list their
    tokens in id order (one token may have several: Llama 3 lists every split of each)."""
    last = -1
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge  # "a b": before 0.20
        token_id = vocab.get("".join(pair)) if len(pair) == 2 else None
        if token_id is None:
            raise ValueError(f"{file}: merge {merge!r} makes no token of the vocabulary")
        if token_id < last:
            raise ValueError(f"{file}: the merges are not in the order of their tokens' ids "
                             f"({merge!r} makes id {token_id}, after id {last}), which "
                             "tiktoken's ranks need")
        last = token_id


def post_processor_bos(post_processor: dict | None, added_tokens: dict[str, int], file: str
                       ) -> str | None:
    """The token the post-processor puts before a text (Llama 3's TemplateProcessing
    "<|begin_of_text|> $A"), or None (ByteLevel's adds nothing). A template that adds anything
    else (an EOS after the text) is not served."""
    bos = None
    for part in components(post_processor, "processors"):
        if part.get("type") == "ByteLevel":
            continue
        if part.get("type") != "TemplateProcessing":
            raise ValueError(f"{file}: post-processor {part.get('type')} is not served: "
                             "ByteLevel or TemplateProcessing only")
        template = part.get("single") or []
        words = [item["SpecialToken"]["id"] if "SpecialToken" in item
                 else "$" + item["Sequence"]["id"] for item in template]
        if words == ["$A"]:
            continue
        if len(words) != 2 or words[1] != "$A" or "SpecialToken" not in template[0] or bos:
            raise ValueError(f"{file}: post-processor template {' '.join(words)!r} is not "
                             "served: one token before the text, or none")
        bos = words[0]
    if bos is not None and bos not in added_tokens:
        raise ValueError(f"{file}: the post-processor's BOS {bos!r} is no added token")
    return bos


class Detokenizer:
    """A request's text, decoded a token at a time: a step costs what its new tokens cost. An
    unfinished UTF-8 character waits in the decoder; stop strings are looked for in the new
    text and the longest one's overlap; text that could start one is held back until it
    cannot, so what was streamed is never taken back.

    It keeps only the text that new_text has not returned yet, in two parts: `recent`, the
    newest characters, which each token's text is added to and where stop strings are looked
    for, and `settled`, older pieces that no stop string can reach any more. `recent` stays
    short (at most RECENT_CHARS past the longest stop string's overlap), so adding a token
    copies a few dozen characters, not all the text so far (`bench.py --detokenizer`: one
    string grown token by token took 2.0-2.3 us a token at 64k characters, this 0.6-1.1 us
    at any length).

    Returned text is never needed again: a stop string cannot start in it, since new_text
    holds back every ending that could begin one. Example, stop ["END"] (overlap 2):
    recent "...the EN" -> new_text holds back "EN" (it may begin "END") and returns the rest;
    the next token "D" completes "END" in recent, which is cut before it."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop  # the text ends after the stop string, not before
        longest_stop = max(map(len, stop), default=0)
        # a stop string's overlap: the characters before a token's text where one may start
        self.overlap = max(longest_stop - 1, 0)
        self.max_recent_chars = RECENT_CHARS + self.overlap  # then recent is settled
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.settled: list[str] = []  # not returned yet, and out of every stop string's reach
        self.recent = ""              # not returned yet, the newest text

    def append(self, token: int, check_stop: bool = True) -> str | None:
        """Add a token's text (none for a special token, or an id past the tokenizer); return
        the stop string it completed (unless not check_stop: before min_tokens), the text cut
        before it (or after it, if include_stop)."""
        search_from = max(0, len(self.recent) - self.overlap)
        self.recent += self.decoder.decode(self.tokenizer.token_bytes(token))
        found = None
        if check_stop and self.stop:
            found = self._find_stop(search_from)
        if len(self.recent) > self.max_recent_chars:
            self._settle()
        return found

    def fork(self) -> "Detokenizer":
        """A copy that goes on on its own (beam search: a beam's text, tried with each of its
        candidate tokens)."""
        copy = Detokenizer(self.tokenizer, self.stop, self.include_stop)
        copy.decoder.setstate(self.decoder.getstate())  # an unfinished character's bytes
        copy.settled = list(self.settled)
        copy.recent = self.recent
        return copy

    def _find_stop(self, search_from: int) -> str | None:
        """The stop string that recent holds from search_from on, recent cut at it; None if
        none. One token can complete several: the earliest in the text wins, whatever the
        list's order; of those found at the same place ("ab" and "abc"), the longest."""
        found = None
        found_at = -1
        for stop in self.stop:
            at = self.recent.find(stop, search_from)
            if at < 0:
                continue
            if found is None or at < found_at or (at == found_at and len(stop) > len(found)):
                found = stop
                found_at = at
        if found is None:
            return None
        end = found_at
        if self.include_stop:
            end = found_at + len(found)
        self.recent = self.recent[:end]
        return found

    def _settle(self) -> None:
        """Move all of recent but a stop string's overlap into settled."""
        split = len(self.recent) - self.overlap
        self.settled.append(self.recent[:split])
        self.recent = self.recent[split:]

    def flush(self) -> None:
        """The text ended: the bytes of an unfinished character become U+FFFD."""
        self.recent += self.decoder.decode(b"", final=True)

    def new_text(self, finished: bool) -> str:
        """Text not returned yet, less (unless finished) what could still become a stop string."""
        end = len(self.recent)
        for n in range(0 if finished else min(self.overlap, end), 0, -1):
            if any(s.startswith(self.recent[-n:]) for s in self.stop):
                end -= n
                break
        new = "".join(self.settled) + self.recent[:end]
        self.settled = []
        self.recent = self.recent[end:]
        return new


def check_utf8(text: str) -> None:
    """ValueError unless the text can be written in UTF-8, naming the first character that
    cannot: a lone surrogate, U+D800 to U+DFFF (JSON's escapes make them, and Python's
    surrogateescape makes U+DC80 to U+DCFF of bytes that are not UTF-8)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        raise ValueError(f"the text is not UTF-8: character {e.start} is a lone surrogate, "
                         f"U+{bad:04X}") from None


def read_json(path: str) -> dict:
    """A JSON object from a file; {} if there is no such file."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object")
    return value


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # transformers' special_tokens_map's names


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers' mark of the assistant's text (for
    training masks), which some templates hold; rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def template_tojson(value, ensure_ascii=False, indent=None, separators=None,
                    sort_keys=False) -> str:
    """transformers' tojson filter: json.dumps' text, its arguments too (Jinja2's own filter
    escapes HTML characters, which a prompt must keep as they are)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message: str):
    """A template's refusal of a conversation (transformers' global): the request's error."""
    raise jinja2.TemplateError(message)


def strftime_now(fmt: str) -> str:
    """The local date and time as fmt writes it (transformers' global; Llama 3.x's templates
    put today's date in the system turn)."""
    return datetime.now().strftime(fmt)


def chat_template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Jinja2 set up as transformers' apply_chat_template sets it up: sandboxed (a template is
    a program that came with the checkpoint), trim_blocks and lstrip_blocks, {% break %} and
    {% continue %}, its tojson filter and its raise_exception and strftime_now globals."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationTag])
    env.filters["tojson"] = template_tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass
class ChatTemplate:
    """A checkpoint's chat template, compiled, and the special tokens' text it renders with."""
    template: jinja2.Template
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: tokenizer_config.json's
    source: str                     # the file it came from

    def render(self, messages: list[dict], kwargs: dict) -> str:
        """The prompt's text as transformers' apply_chat_template(messages,
        add_generation_prompt=True, **kwargs) renders it: the special tokens, tools and
        documents None, then kwargs (a request's chat_template_kwargs, which may set any of
        those: Qwen3's enable_thinking, say). ValueError with the template's message if it
        refuses the conversation."""
        context = self.special_tokens | dict(tools=None, documents=None,
                                             add_generation_prompt=True) | kwargs
        try:
            return self.template.render(context | dict(messages=messages))
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # noqa: BLE001 (a template is code: it fails as code does)
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None


def load_chat_template(path: str | None) -> ChatTemplate | None:
    """The chat template of the checkpoint directory `path`, where transformers looks for it:
    chat_template.jinja, else tokenizer_config.json's chat_template. Compiled here, so a broken
    one is an error at start-up. None for a preset (path None) or a checkpoint with neither:
    chat is then render_chat's transcript."""
    if path is None:
        return None
    config_file = os.path.join(path, "tokenizer_config.json")
    config = read_json(config_file)
    source = os.path.join(path, "chat_template.jinja")
    if os.path.exists(source):
        with open(source, encoding="utf-8") as f:
            text = f.read()
    else:
        source = config_file
        text = default_chat_template(config.get("chat_template"), source)
    if text is None:
        return None
    try:
        template = chat_template_environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: the chat template does not compile: {e}") from None
    return ChatTemplate(template, special_tokens(config), source)


def default_chat_template(value, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates [{"name",
    "template"}, ...] of which chat uses the one named "default", as transformers does;
    ValueError naming the file for anything else."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        raise ValueError(f"{source}: chat_template must be a string or a list of "
                         f'{{"name": ..., "template": ...}}, got {value!r:.80}')
    named = {t["name"]: t["template"] for t in value}
    if "default" not in named:
        raise ValueError(f"{source}: no chat template is named default (the names: "
                         f"{', '.join(named)})")
    return named["default"]


def special_tokens(config: dict) -> dict[str, str]:
    """tokenizer_config.json's special tokens as a template sees them, by name (bos_token:
    "<s>", ...); a token written as an object ({"content": "<s>", ...}, older files) is its
    content. A template that reads one the file lacks gets Jinja2's empty undefined."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
