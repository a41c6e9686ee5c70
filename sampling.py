"""Sampling: from a step's logits to one token for each sequence that samples.

SamplingParams is a request's sampling, as vLLM and the OpenAI API name it, validated when it
is made. Each step, sampling_tensors() gathers the parameters of the sequences that sample
into device tensors (SamplingTensors; the penalties' token counts and the logit_bias rows only
when some sequence uses them), and sample() turns the logits (n, vocab) into n tokens at once:
logit_bias and min_tokens' bans, penalties, greedy or temperature, min_p, top-k, top-p, then
the Gumbel-max draw, a seeded sequence's from noise of its seed and the output position alone
(noise_seed), so that its tokens do not depend on its batch. generation_config_defaults()
reads a checkpoint's generation_config.json as the default fields of requests that leave them
unset.

The engine (model_runner.py) calls sampling_tensors(), sample(), and invalid_logits() on the
same logits (rows of NaN, which it fails); nothing here knows of the model or the KV cache.
"""
import itertools
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

import cuda_runtime
from options import check_fields, check_float, check_int, option
from scheduler import Sequence
from structured_output import StructuredOutputsParams

GREEDY_BELOW = 1e-5       # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20         # top log-probabilities per token at most (vLLM's max_logprobs)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # sampling computes in float32
# A request's lists are read at every token it makes, on the step's path: caps keep one
# request from slowing every other's steps (vLLM has none; OpenAI takes 4 stop strings).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 64
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300      # token ids a request may bias
MAX_N = 128               # samples of one request at most (OpenAI's limit)
# Top-k (and top-p within it) from the top_k largest of each row rather than a sort of the
# whole vocabulary (Qwen's: 151,936), when every row that uses top-k or top-p has a top_k up to
# this: a topk of k <= 1024 is a select and a sort of k values, far cheaper than sorting every
# row (CPU, 64 x 151,936: 35 ms for k 20, 91 for 1024, 1,840 for the sort).
MAX_TOP_K_CANDIDATES = 1024
NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}  # upload's dtypes
# A seeded sequence's noise is a function of its seed and of the output position the token is
# for, never of how many draws came before: its tokens then do not depend on what shared its
# steps, how many drafts it got, or a failed batch run again. One noise a position: the target
# draws the position's token with it, and a draft model its guess for the same position
# (draft_proposer.py), so that a draft close to the target guesses what the target will draw.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 over the golden ratio, odd


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM and the OpenAI API name it."""
    n: int = option(1, "samples of the prompt, one request (a seeded sample i uses seed + i)",
                    high=MAX_N)
    max_tokens: int = option(16, "tokens to generate at most")
    temperature: float = option(1.0, "0 (or below 1e-5): greedy", low=0)
    top_k: int = option(0, "keep the k most likely tokens; 0 or -1: all", low=-1)
    top_p: float = option(1.0, "keep the fewest most likely tokens whose probability reaches "
                          "top_p", low=0, high=1, open_low=True)
    seed: int | None = option(None, "per-request RNG: the same tokens whatever the batch",
                              low=-2**63, type=int)
    stop: list[str] | None = option(None, "stop before any of these strings", type=list)
    ignore_eos: bool = option(False, "keep going after an end-of-sequence token")
    logprobs: int | None = option(None, "each output token's log-probability and the top k",
                                  low=0, high=MAX_LOGPROBS, type=int)
    prompt_logprobs: int | None = option(None, "each prompt token's log-probability and the "
                                         "top k", low=0, high=MAX_LOGPROBS, type=int)
    presence_penalty: float = option(0.0, "minus this from the logit of every token generated "
                                     "so far (OpenAI's)", low=-2, high=2)
    frequency_penalty: float = option(0.0, "minus this times its count from the logit of every "
                                      "token generated so far (OpenAI's)", low=-2, high=2)
    # bounded, unlike vLLM's: a penalty of 1e-40 or 1e40 takes float32 logits to inf or 0
    repetition_penalty: float = option(1.0, "divide the positive logits (multiply the negative) "
                                       "of every token of the prompt and output by this",
                                       low=0.01, high=100)
    min_p: float = option(0.0, "drop tokens less likely than min_p times the most likely",
                          low=0, high=1)
    min_tokens: int = option(0, "no end-of-text, stop token or stop string before this many "
                             "tokens", low=0)
    stop_token_ids: list[int] | None = option(None, "stop after any of these tokens (kept in "
                                              "token_ids, not in the text)", type=list)
    include_stop_str_in_output: bool = option(False, "keep the stop string (or stop token) at "
                                              "the end of the text")
    logit_bias: dict[int, float] | None = option(None, "token id -> a bias in [-100, 100] "
                                                 "added to its logit (OpenAI's)", type=dict)
    structured_outputs: StructuredOutputsParams | None = option(
        None, "a JSON schema, regex, choice or grammar the output must match (a "
        "StructuredOutputsParams or a dict of its fields; structured_output.py)",
        type=StructuredOutputsParams)

    def __post_init__(self):
        self.stop = parse_stop(self.stop)
        self.stop_token_ids = parse_token_ids("stop_token_ids", self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} token ids; at most "
                             f"{MAX_STOP_TOKEN_IDS}")
        self.logit_bias = parse_logit_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        check_fields(self)
        self.top_k = max(self.top_k, 0)  # vLLM's -1 and 0 both mean off
        # past float32's largest a temperature is inf there, and a banned token's -inf / inf
        # NaN: it samples as the largest, set once here rather than at every step
        self.temperature = min(self.temperature, FLOAT32_MAX)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs this row's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


def parse_stop(value) -> list[str]:
    """None, a string, or any iterable of them (read once here: a generator is used up) -> a
    new list (SamplingParams' and BeamSearchParams' stop); ValueError for a map (its keys
    would pass for the strings), a non-iterable, an empty or non-string item, or past the
    caps."""
    stop = stop_list(value)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise ValueError(f"stop strings have at most {MAX_STOP_STRING_CHARS} characters, "
                         f"got one of {max(map(len, stop))}")
    return stop


def stop_list(value) -> list:
    """parse_stop's value as a new list, its items unchecked."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    refusal = f"stop must be a string or strings, got {value!r}"
    if isinstance(value, dict):
        raise ValueError(refusal)
    try:
        return list(value)
    except TypeError:
        raise ValueError(refusal) from None


def parse_token_ids(name: str, value) -> list[int]:
    """None or token ids -> a new list; ValueError naming `name` unless ints >= 0 (a bool is
    not; the vocabulary's bound is the engine's to check)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for token_id in value:
        check_int(name, token_id, 0)
    return list(dict.fromkeys(value))  # each once, in order


def parse_logit_bias(value) -> dict[int, float]:
    """None or {token id: bias} -> a new dict; ValueError unless ids are ints >= 0 (or their
    decimal strings, as JSON sends them) and biases numbers in [-100, 100], as OpenAI's."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {value!r}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(value)} token ids; at most {MAX_LOGIT_BIAS}")
    bias = {}
    for key, number in value.items():
        token_id = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token_id = int(key)
        check_int("logit_bias's token id", token_id, 0)
        check_float("logit_bias's bias", number, -100, 100, open_low=False)
        bias[token_id] = float(number)
    return bias


# generation_config.json's sampling fields (vLLM's list) -> SamplingParams' names for them
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_config_defaults(generation_config: dict, path: str | None, mode: str) -> dict:
    """The sampling fields a checkpoint's generation_config.json gives, by SamplingParams'
    names ({"temperature": 0.6, "top_p": 0.95, ...}; {} with mode "vllm", for a preset or
    without the file): the defaults of a request that leaves them unset, as vLLM takes them
    (do_sample is not read). Each front end lays them over its own defaults, and the user's
    values over them. ValueError naming the file and the field unless each is a valid request
    value."""
    if mode == "vllm":
        return {}
    defaults = {}
    for key, name in GENERATION_CONFIG_FIELDS.items():
        if generation_config.get(key) is None:
            continue
        try:
            SamplingParams(**{name: generation_config[key]})
        except ValueError as e:
            file = os.path.join(path, "generation_config.json")
            raise ValueError(f"{file}: {key} {generation_config[key]!r} is not a valid default "
                             f"({e}); --generation-config vllm ignores the file") from None
        defaults[name] = generation_config[key]
    return defaults


def print_sampling_defaults(defaults: dict) -> None:
    """The start-up line (stderr) that names the checkpoint's sampling defaults, if it gave any."""
    if not defaults:
        return
    taken = ", ".join(f"{name} {value}" for name, value in defaults.items())
    print(f"using the checkpoint's sampling defaults (generation_config.json): {taken}; a "
          "request's own values win (--generation-config vllm ignores the file)",
          file=sys.stderr, flush=True)


@dataclass
class SamplingTensors:
    """The sampling parameters of a step's rows that sample, on the device: one entry a row."""
    temperature: torch.Tensor       # (n,) fp32; 1 on greedy rows
    top_k: torch.Tensor             # (n,) int64; the vocabulary size where off
    top_p: torch.Tensor             # (n,) fp32; 1 where off
    greedy: torch.Tensor            # (n,) bool
    seeds: list                     # per row: its request's seed, or None (the engine's noise)
    positions: list                 # per row: the output position its token is for (0: the
                                    # first token after the prompt); seeded rows' noise reads it
                                    # (empty where no row is seeded)
    all_greedy: bool
    any_top_k_top_p: bool           # some row that draws (not greedy) uses top-k or top-p
    any_greedy: bool = True         # False: no row takes the argmax, and it is not computed
    max_top_k: int | None = None    # the largest top_k of the rows that draw and use top-k or
                                    # top-p, if at most MAX_TOP_K_CANDIDATES (rows above it
                                    # use neither, or are greedy); None: the vocabulary sorted
    # Built only when some row uses them (None otherwise: the fast path pays nothing).
    logit_bias: torch.Tensor | None = None      # (n, vocab) fp32: logit_bias, -inf where
                                                # min_tokens bans a token (end-of-text, stop ids)
    min_p: torch.Tensor | None = None           # (n,) fp32; 0 where off
    penalties: "Penalties | None" = None  # InputBatch.penalties' (input_batch.py)


@dataclass
class Penalties:
    """What the penalties need, per row that samples (on a row without penalties, whatever its
    row held: its neutral penalties ignore it)."""
    output_counts: torch.Tensor | None  # (n, vocab) fp32: each token's count in the row's
                                        # output (None unless any_frequency_or_presence)
    seen: torch.Tensor | None       # (n, vocab) bool: the token is in the prompt or the output
                                    # (None unless any_repetition)
    presence: torch.Tensor          # (n,) fp32; 0 where off
    frequency: torch.Tensor         # (n,) fp32; 0 where off
    repetition: torch.Tensor        # (n,) fp32; 1 where off
    input_batch_rows: torch.Tensor  # (n,) int64: each row's row of state in the input batch
    any_repetition: bool            # some row's repetition penalty is not 1
    any_frequency_or_presence: bool  # some row's frequency or presence penalty is not 0


def sample(logits: torch.Tensor, t: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """One token per row of logits (n, vocab) -> (n,), the whole batch at once, in vLLM's
    order: logit_bias (and min_tokens' bans), then the penalties; greedy rows take the argmax;
    the others temperature, min_p, top-k, top-p, then the Gumbel-max trick, argmax(probs / E)
    with E ~ Exponential(1), a draw from probs. A seeded row's E is its (seed, output
    position)'s noise and no row depends on another's parameters or logits: its tokens do not
    depend on its batch, and a row of NaN logits gets some token while the others keep theirs
    (the engine fails it: invalid_logits()). The logits are not changed in place:
    log-probabilities are the model's own, before all this. Speculative decoding's verify()
    (spec_decode.py) uses the same three parts: adjust_logits, sampling_probs, draw."""
    logits = adjust_logits(logits, t)
    greedy = logits.argmax(dim=-1) if t.any_greedy else None
    if t.all_greedy:
        return greedy
    drawn = draw(sampling_probs(logits, t), t, generator)
    return drawn if greedy is None else torch.where(t.greedy, greedy, drawn)


def adjust_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logit_bias (and min_tokens' bans), then the penalties: the logits greedy rows take the
    argmax of."""
    if t.logit_bias is not None:
        logits = logits + t.logit_bias
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    return logits


def sampling_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Adjusted logits (n, vocab) -> the distribution each row draws from (n, vocab):
    temperature, min_p, top-k, top-p, softmax."""
    logits = logits / t.temperature[:, None]
    if t.min_p is not None:
        logits = apply_min_p(logits, t.min_p)
    if t.any_top_k_top_p:
        logits = apply_top_k_top_p(logits, t.top_k, t.top_p, t.max_top_k)
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, t: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs (n, vocab) -> (n,), by the Gumbel-max trick: argmax(probs / E),
    E ~ Exponential(1), E = -log U; a seeded row's U its own noise (seeded_uniform_), the
    others' from the engine's generator. probs need not sum to 1 (speculative
    decoding draws from max(p - q, 0) unnormalised). probs is overwritten."""
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device) \
        if None in t.seeds else torch.empty_like(probs)
    seeded_uniform_(uniform, t.seeds, t.positions)
    # E = -log U ~ Exp(1) > 0 (no NaN), and probs / log U = -(probs / E) bit for bit: its
    # argmin is argmax(probs / E), without a pass to negate
    return probs.div_(uniform.log_()).argmin(dim=-1)


def seeded_uniform_(uniform: torch.Tensor, seeds: list, positions: list) -> None:
    """Overwrite each seeded row of uniform (n, ...) with uniforms in [0, 1) from its own noise:
    a generator seeded with noise_seed(seed, position), so that row's values depend on
    nothing else. Rows whose seed is None keep theirs. One generator on uniform's device,
    seeded again for each row (a host-side setting: no wait for the device)."""
    noise = None
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        if seed is None:
            continue
        if noise is None:
            noise = torch.Generator(uniform.device)
        noise.manual_seed(noise_seed(seed, position))
        uniform[row].uniform_(generator=noise)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded sequence's noise for its output token `position`: element
    `position` of the SplitMix64 sequence of `seed` (Steele et al. 2014; Java's
    SplittableRandom), an int in [0, 2**64). A mix, not seed + position: the seeds seed + i of a request's n
    samples would share their noise, shifted by i positions; and a CPU generator (a Mersenne
    Twister) keeps only the low 32 bits of its seed, which SplitMix64's finaliser makes depend
    on every bit of the seed and the position."""
    z = (seed + (position + 1) * GOLDEN_GAMMA) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def invalid_logits(logits: torch.Tensor) -> torch.Tensor:
    """(n,) bool, on the device: which rows of the model's logits (n, vocab) hold a NaN or +inf
    (an fp16 overflow upstream), which sample() would turn into an arbitrary token (softmax
    over +inf is NaN; the argmax of NaN, its index). The engine calls it on the logits it
    gives sample() and reads it with the token ids, in the step's one wait, to fail those
    requests alone. One reduction over the logits, which propagates NaN (an isnan pass would
    write an (n, vocab) mask first); -inf alone is a token ruled out, not an error."""
    return ~logits.amax(dim=-1).isfinite()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Mask logits (n, vocab) outside each row's top-k (every token tied with its k-th largest
    stays), then outside its top-p nucleus (the fewest most likely tokens whose probability
    reaches top_p: the token that crosses it stays). top_k = vocab and top_p = 1 leave a row
    exactly as it was. max_top_k (SamplingTensors'): the largest top_k of the rows that use
    either, rows above it using neither; given, a topk of that many takes the place of a sort
    of the vocabulary, and the same tokens are drawn."""
    if max_top_k is None:
        return top_k_top_p_by_sort(logits, top_k, top_p)
    return top_k_top_p_by_topk(logits, top_k, top_p, max_top_k)


def top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    """apply_top_k_top_p() by a sort of each row (n, vocab): what a top_k past
    MAX_TOP_K_CANDIDATES, or a row with top-p and no top-k, needs."""
    ascending, order = logits.sort(dim=-1)
    kth = ascending.gather(1, (logits.shape[-1] - top_k).clamp(min=0)[:, None])  # k-th largest
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    drop = outside_top_p(ascending, top_p)
    return torch.empty_like(logits).scatter_(1, order, ascending.masked_fill(drop, float("-inf")))


def top_k_top_p_by_topk(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        max_top_k: int) -> torch.Tensor:
    """apply_top_k_top_p() from each row's max_top_k largest logits, (n, max_top_k): top-k and
    top-p there, as the sort does them, find the row's smallest kept logit, and one pass masks
    what is below it (so ties with it stay, as with the sort). A row whose top_k exceeds
    max_top_k uses neither and keeps every token (the sort drops those of probability 0 in
    float32, which are never drawn). The nucleus' probabilities are summed over max_top_k
    values rather than over the vocabulary (whose other values are -inf), which may round
    the last bit differently: a token whose cumulative probability is that close to
    1 - top_p may stay in one and not the other; otherwise the same tokens stay."""
    ascending = logits.topk(max_top_k, dim=-1).values.flip(-1)  # (n, max_top_k), sorted
    kth = ascending.gather(1, (max_top_k - top_k).clamp(min=0)[:, None])
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    drop = outside_top_p(ascending, top_p)
    smallest_kept = ascending.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    smallest_kept = smallest_kept.masked_fill(top_k[:, None] > max_top_k, float("-inf"))
    return logits.masked_fill(logits < smallest_kept, float("-inf"))


def outside_top_p(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of logits sorted ascending, top-k's cut -inf, (n, m) -> (n, m) bool: True outside
    each row's top-p nucleus (its probability and all less likely reach at most 1 - top_p)."""
    below = ascending.softmax(dim=-1).cumsum(dim=-1)  # probability of this token and all less
    drop = below <= 1 - top_p[:, None]
    drop[:, -1] = False  # the most likely token always stays, whatever rounding did to `below`
    return drop


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """The repetition penalty (transformers' and vLLM's): a token of the prompt or the output
    has its logit divided by it if positive, multiplied by it if negative. Then OpenAI's
    frequency and presence penalties, over the output only: logit - frequency x count -
    presence x [count > 0]. Elementwise over (n, vocab), without a wait for the device. A
    penalty no row uses is skipped: it would change no value (a row's neutral 1 or 0 leaves
    its logits bit for bit as they were), but each costs passes over all (n, vocab) values
    (Qwen2.5's default, a repetition penalty alone, halves the work)."""
    if p.any_repetition:
        repetition = torch.where(p.seen, p.repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    if p.any_frequency_or_presence:
        logits = logits - p.frequency[:, None] * p.output_counts
        logits = logits - p.presence[:, None] * (p.output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask each row's tokens whose probability is below min_p times its most likely token's
    (after temperature, before top-k and top-p, as vLLM). min_p = 0 leaves a row as it was."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def upload(host_lists: dict[str, list], dtype: torch.dtype, device: str
           ) -> dict[str, torch.Tensor]:
    """Named host lists -> device tensors of one dtype, by the same names: one pinned buffer,
    one non-blocking copy (on CUDA). The engine sends a step's inputs the same way.

    The pinned buffer comes from torch's caching host allocator, which hands a block out again
    only once the copy from it has run; a buffer of our own, kept from step to step, would
    need a wait before each rewrite (a step that samples nothing never waits for the device,
    so the last step's copy may still be queued behind its forward)."""
    flat = list(itertools.chain.from_iterable(host_lists.values()))
    # through numpy: 3x faster than torch.tensor on a list (1,800 ints: 51 against 163 us)
    host = torch.from_numpy(np.array(flat, dtype=NUMPY_DTYPES[dtype]))
    if cuda_runtime.is_cuda(device):
        host = cuda_runtime.pinned(host)
    on_device = host.to(device, non_blocking=True)
    sizes = [len(values) for values in host_lists.values()]
    return dict(zip(host_lists, on_device.split(sizes)))


def sampling_tensors(seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int],
                     device: str, output_offsets: list[int] | None = None) -> SamplingTensors:
    """The sampling parameters of the sequences that sample (a row each), as device tensors;
    the penalties' state, kept from step to step, is the persistent batch's (input_batch.py).
    output_offsets: per row, the tokens its sequence emits before it in this step (a
    speculative step's rows: spec_decode.output_offsets); None: 0 each."""
    if output_offsets is None:
        output_offsets = [0] * len(seqs)
    params = [seq.params for seq in seqs]
    greedy = [p.temperature < GREEDY_BELOW for p in params]
    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    # 0 (off) or past the vocabulary: every token (and 2**64 fits no int64)
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    floats = upload(dict(temperature=temperature, top_p=top_p), torch.float32, device)
    ints = upload(dict(top_k=top_k, greedy=greedy), torch.int64, device)
    # a greedy row's draw is thrown away: its top-k or top-p neither applies nor forces a sort
    used_top_k = [k for k, p, g in zip(top_k, top_p, greedy) if not g and (k < vocab_size or p < 1)]
    max_top_k = max(used_top_k, default=vocab_size)
    seeds = [p.seed for p in params]
    positions = []  # only a seeded row's noise reads them: none made for a step without one
    num_unseeded = seeds.count(None)  # a C loop: any() over a generator cost 8 bytecodes a row
    if num_unseeded < len(seeds):
        positions = [seq.num_output_tokens + offset for seq, offset in zip(seqs, output_offsets)]
    tensors = SamplingTensors(
        temperature=floats["temperature"], top_p=floats["top_p"],
        greedy=ints["greedy"].bool(), top_k=ints["top_k"],
        seeds=seeds, all_greedy=all(greedy), positions=positions,
        any_top_k_top_p=bool(used_top_k), any_greedy=any(greedy),
        max_top_k=max_top_k if max_top_k <= MAX_TOP_K_CANDIDATES else None)
    if any(p.min_p > 0 for p in params):
        min_p = [p.min_p for p in params]
        tensors.min_p = upload(dict(min_p=min_p), torch.float32, device)["min_p"]
    tensors.logit_bias = logit_bias_rows(seqs, vocab_size, eos_token_ids, device, output_offsets)
    return tensors


def logit_bias_rows(seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int],
                    device: str, output_offsets: list[int]) -> torch.Tensor | None:
    """(n, vocab): each row's logit_bias, and -inf on the tokens that would end it while it
    has fewer than min_tokens (end-of-text unless ignored, its stop_token_ids), counting the
    row's output_offsets tokens emitted before it; None if no row has either. One scatter from
    one upload."""
    rows = []
    token_ids = []
    biases = []
    for row, (seq, offset) in enumerate(zip(seqs, output_offsets)):
        params = seq.params
        if not params.logit_bias and not params.min_tokens:  # most rows: nothing to add
            continue
        holds_back = seq.num_output_tokens + offset < params.min_tokens
        banned = []
        if holds_back:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += eos_token_ids
        entries = list(params.logit_bias.items()) + [(i, -math.inf) for i in banned]
        for token_id, bias in entries:
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if not rows:
        return None
    index = upload(dict(rows=rows, token_ids=token_ids), torch.int64, device)
    values = upload(dict(biases=biases), torch.float32, device)["biases"]
    logit_bias = torch.zeros(len(seqs), vocab_size, device=device)
    return logit_bias.index_put_((index["rows"], index["token_ids"]), values, accumulate=True)
