"""Speculative decoding: guess several tokens cheaply, verify them all in one step of the model,
and keep exactly the model's distribution (Leviathan et al. 2023, Chen et al. 2023).

Decoding reads every weight to make one token a sequence; reading them once for k + 1 tokens
of the same sequence costs little more, so each guess the model accepts is a step saved. A
proposer guesses (ngram_proposer.py: tokens that followed the same words earlier in the text;
draft_proposer.py: a small model that shares the tokenizer); the scheduler gives a decoding
sequence with k draft tokens k + 1 query tokens, through the ordinary paged path like a prompt
chunk; the model runner samples at all k + 1 positions, and verify() below keeps the longest
run of drafts the model agrees with, plus one token of the model's own.

Worked example, greedy, drafts [the, cat, sat] after "... on":
    query tokens      on    the   cat   sat       (4 positions, one forward)
    model's argmax    the   cat   ran   down
    accepted          the   cat                   (sat != ran: stop at the first difference)
    emitted           the   cat   ran             3 tokens for one step; had all 3 matched,
                                                  the 4th position's "down" was a bonus token
The K/V of "sat" were written to the cache but are never read: the sequence's
num_computed_tokens moves back past them, and blocks past the accepted tokens are freed.

Sampled positions keep the target's distribution p. An n-gram guess d is one token, q(d) = 1:
rejection sampling would accept it with probability p(d), else draw from p with d removed.
verify() gets exactly that by drawing each position's token from p as a step without drafts would,
with the same noise, and accepting while the token equals the draft: it is d with probability
p(d), and given it is not d it follows p without d. Worked example, sampled, drafts [the, cat]
after "... on":
    query tokens      on    the   cat         (3 positions, one forward)
    drawn from p      the   dog   sat         (each with its own position's noise)
    accepted          the                     (dog != cat: stop)
    emitted           the   dog               what two steps without drafts would have drawn
A seeded sequence's noise is a function of its seed and the output position alone
(sampling.noise_seed), so with n-gram drafts its tokens are those it has without speculation:
how many drafts it got, hence its batch, changes nothing. A draft model's q is not one-hot:
an unseeded draft d is rejection-sampled, accepted if u < p(d) / q(d), else the token drawn
from max(p - q, 0), normalised, which accepts more often than a match would against an
independent guess. A seeded one is matched as an n-gram draft is, and is no independent
guess: the draft drew it with the very noise the target draws that position with
(draft_proposer.py), so where q is close to p the two draws agree (Gumbel-max coupling), and
the seeded tokens are again those without speculation, whatever the batch. Every
sampling field (temperature, top-k/p, min_p, penalties, logit_bias, min_tokens, seeds) shapes
p at each position as if the tokens had come one step at a time: position j sees the drafts
before it counted by the penalties and in min_tokens.

In this file: SpeculativeConfig (vLLM's speculative_config; Engine._proposer makes its
proposer), the engine's Speculator (who drafts, and backs off when drafts keep failing), then
the model runner's side: SpecDecodeMetadata and count_drafts (each speculating sequence's
sampling positions and their penalties), verify (the rejection sampler) and accept_runs (the
emitted tokens). The scheduler (scheduler.py) schedules drafts; the engine's update()
appends the emitted tokens one at a time, checking stops after each.
"""
import dataclasses
from dataclasses import dataclass

import torch

from options import check_int, json_fields
from sampling import Penalties, SamplingTensors, adjust_logits, draw, sampling_probs, upload

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64     # ngram: the longest suffix looked up, at most
# A sequence whose drafts were all rejected pauses drafting for this many steps, doubled each
# time it happens again in a row (up to MAX_BACKOFF_STEPS), reset by any accepted draft: free
# text rarely repeats, and a draft that fails costs its verification tokens every step.
FIRST_BACKOFF_STEPS = 1
MAX_BACKOFF_STEPS = 32
# disable_by_batch_size left unset, on a CPU: drafts only while at most this many sequences
# run. A CPU's step is compute-bound at a few sequences, so verification tokens cost what
# they compute: SmolLM2-135M free writing at batch 8 ran at 0.64x with n-gram drafts, copying
# at batch 32 at 1.14x (BENCHMARKS.md, section 12). A GPU reads the weights at the same cost
# for far more tokens: no limit there unless set.
CPU_DISABLE_BY_BATCH_SIZE = 4


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": PATH, "num_speculative_tokens":
    4} (method draft_model)."""
    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None               # draft_model: a checkpoint sharing the tokenizer
    prompt_lookup_max: int | None = None   # ngram: the longest suffix looked up
    prompt_lookup_min: int | None = None   # ngram: the shortest
    disable_by_batch_size: int | None = None  # no drafts while more sequences run than this;
                                              # None: CPU_DISABLE_BY_BATCH_SIZE on a CPU

    def __post_init__(self):
        if self.model is not None and self.method == "ngram":
            self.method = "draft_model"  # as vLLM infers it from a model given alone
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; choose one "
                             f"of {', '.join(METHODS)}")
        check_int("speculative_config's num_speculative_tokens", self.num_speculative_tokens,
                  1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            check_int("speculative_config's disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "draft_model":
            self._check_draft_model()
            return
        self._check_prompt_lookup()

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config's model: method draft_model needs a checkpoint "
                             f"path, got {self.model!r}")
        if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise ValueError("speculative_config's prompt_lookup_max and prompt_lookup_min are "
                             "for method ngram, not draft_model")

    def _check_prompt_lookup(self) -> None:
        """One bound given: the other takes it; neither: 2 to 4 (vLLM takes 5 for both, which
        finds fewer matches in a small model's shorter texts)."""
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None:
                check_int(f"speculative_config's {name}", value, 1, MAX_PROMPT_LOOKUP)
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_min, self.prompt_lookup_max = 2, 4
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config's prompt_lookup_min ({self.prompt_lookup_min})"
                             f" is more than prompt_lookup_max ({self.prompt_lookup_max})")


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict or its JSON text (the command line's) -> a validated
    SpeculativeConfig or None; ValueError naming the field for anything else."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_fields("speculative_config", value, SpeculativeConfig)
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens")
    return SpeculativeConfig(**value)


# --- the engine's side: who drafts ---------------------------------------------------------

class Speculator:
    """Asks the proposer for the next step's drafts of every running sequence that decodes,
    within what each may still emit, and pauses a sequence whose drafts keep failing."""

    def __init__(self, config: SpeculativeConfig, proposer, device: str):
        self.config = config
        self.proposer = proposer
        self.backoff: dict = {}   # seq -> (steps it still waits, steps it waits next time)
        self.disable_by_batch_size = config.disable_by_batch_size
        if self.disable_by_batch_size is None and device.startswith("cpu"):
            self.disable_by_batch_size = CPU_DISABLE_BY_BATCH_SIZE

    def propose(self, running: list) -> None:
        """Set spec_token_ids of each running sequence that will decode at the next step."""
        limit = self.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        wanted = {}
        for seq in running:
            num_drafts = self._num_drafts(seq)
            if num_drafts > 0:
                wanted[seq] = num_drafts
        if wanted:
            self.proposer.propose(wanted)

    def _num_drafts(self, seq) -> int:
        """How many drafts seq may take: none unless it decodes next (one uncomputed token),
        has no structured output (its grammar would have to check each draft first), is not
        waiting out a backoff, and may emit more than the one token a step gives."""
        if seq.num_uncomputed_tokens != 1 or seq.params.structured_outputs is not None:
            return 0
        waits, next_wait = self.backoff.get(seq, (0, 0))
        if waits > 0:
            self.backoff[seq] = (waits - 1, next_wait)
            return 0
        room = seq.params.max_tokens - seq.num_output_tokens - 1  # the step's own token aside
        return min(self.config.num_speculative_tokens, room)

    def verified(self, seq, num_drafts: int, num_accepted: int) -> None:
        """After a step verified num_drafts of seq's drafts: all rejected pauses it, for
        FIRST_BACKOFF_STEPS, then twice as long each time in a row; any accepted resets."""
        if num_accepted > 0:
            self.backoff.pop(seq, None)
            return
        _, next_wait = self.backoff.get(seq, (0, FIRST_BACKOFF_STEPS))
        self.backoff[seq] = (next_wait, min(2 * next_wait, MAX_BACKOFF_STEPS))

    def remove(self, seq) -> None:
        """seq finished or was preempted: its proposer state (a draft's cache) goes."""
        self.backoff.pop(seq, None)
        seq.spec_token_ids = []
        seq.draft_probs = None
        self.proposer.remove(seq)


# --- the model runner's side: verification ----------------------------------------------------

@dataclass
class SpecDecodeMetadata:
    """The sampling positions of a step with drafts (vLLM's name): a sequence with k drafts
    samples at k + 1 positions, j the one after its j-th token (j = 0: after the token sampled
    last step); the step's logits have a row for each, R in all."""
    draft_token_ids: torch.Tensor   # (R,) int64: position j's draft (position j + 1's token);
                                    # any token at a sequence's last position, which has none
    has_draft: torch.Tensor         # (R,) bool: the position holds a draft to accept or reject
    draft_probs: torch.Tensor | None  # (R, vocab) the proposer's q at draft positions (a draft
                                    # model's), 0 elsewhere; None: every draft one-hot (ngram)


def output_offsets(num_sampled_tokens: list[int]) -> list[int]:
    """Each sampling position's tokens emitted before it in its own step: [0, 1, .., k] for a
    sequence of k drafts (min_tokens and the penalties see the drafts before a position)."""
    return [j for n in num_sampled_tokens for j in range(n)]


def count_drafts(penalties: Penalties, num_sampled_tokens: list[int],
                 drafts: list[list[int]]) -> Penalties:
    """The Penalties of a step's sequences (one entry each) spread over their sampling
    positions, each with the drafts before it counted: position j's penalties are those it
    would have had with the drafts before it sampled one step at a time. Example, drafts
    [5, 9]: position 0 as the sequence's own, 1 with token 5 counted once more, 2 with 5 and 9."""
    device = penalties.presence.device
    repeats = upload(dict(repeats=num_sampled_tokens), torch.int64, device)["repeats"]
    size = sum(num_sampled_tokens)  # given: repeat_interleave would read it from the device
    spread = dataclasses.replace(
        penalties, presence=penalties.presence.repeat_interleave(repeats, output_size=size),
        frequency=penalties.frequency.repeat_interleave(repeats, output_size=size),
        repetition=penalties.repetition.repeat_interleave(repeats, output_size=size),
        input_batch_rows=penalties.input_batch_rows.repeat_interleave(repeats, output_size=size))
    positions = []
    token_ids = []
    first = 0  # the sequence's first sampling position
    for n, seq_drafts in zip(num_sampled_tokens, drafts):
        for j in range(1, n):  # position first + j has drafts 0..j-1 before it
            positions += [first + j] * j
            token_ids += seq_drafts[:j]
        first += n
    uploaded = upload(dict(positions=positions, token_ids=token_ids), torch.int64, device)
    index = (uploaded["positions"], uploaded["token_ids"])
    if penalties.output_counts is not None:
        counts = penalties.output_counts.repeat_interleave(repeats, dim=0, output_size=size)
        ones = torch.ones(len(positions), device=device)
        spread.output_counts = counts.index_put_(index, ones, accumulate=True)
    if penalties.seen is not None:
        seen = penalties.seen.repeat_interleave(repeats, dim=0, output_size=size)
        seen[index] = True
        spread.seen = seen
    return spread


def verify(logits: torch.Tensor, t: SamplingTensors, spec: SpecDecodeMetadata,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification at a step's sampling positions, logits (R, vocab) -> (drawn (R,),
    accepted (R,)), both int64 on the device. accepted: a draft position's draft stands. drawn:
    the position's token if its run stops there. p is the target's distribution after every
    sampling field (sampling.py), q the proposer's. Greedy: drawn is the argmax, accepted where
    it is the draft. n-gram drafts (q one-hot, spec.draft_probs None): drawn is the position's
    token drawn from p as without drafts, accepted where it is the draft. A draft model's:
    rejection sampling, accepted where u < p(d) / q(d), drawn from max(p - q, 0) (p at a
    position without a draft); a seeded sequence's matched as an n-gram draft is (its draft
    drew it with the same noise: draft_proposer.py)."""
    logits = adjust_logits(logits, t)
    greedy = logits.argmax(dim=-1)
    is_greedy_match = greedy == spec.draft_token_ids
    if t.all_greedy:
        return greedy, is_greedy_match.to(torch.int64)
    probs = sampling_probs(logits, t)
    if spec.draft_probs is None:
        drawn = torch.where(t.greedy, greedy, draw(probs, t, generator))
        accepted = (drawn == spec.draft_token_ids) & spec.has_draft
        return drawn, accepted.to(torch.int64)
    d = spec.draft_token_ids[:, None]
    p_draft = probs.gather(1, d)[:, 0]
    q = spec.draft_probs
    q_draft = q.gather(1, d)[:, 0]
    uniform = torch.rand(len(probs), generator=generator, device=probs.device)
    is_sampled_match = uniform * q_draft < p_draft  # u < p / q, without dividing by q = 0
    residual = (probs - q).clamp_(min=0)  # q is 0 without a draft: p itself
    drawn_sampled = draw(residual, t, generator)
    if any(seed is not None for seed in t.seeds):
        seeded = upload(dict(seeded=[seed is not None for seed in t.seeds]), torch.int64,
                        probs.device)["seeded"].bool()
        drawn_as_without_drafts = draw(probs, t, generator)
        is_match = drawn_as_without_drafts == spec.draft_token_ids
        is_sampled_match = torch.where(seeded, is_match, is_sampled_match)
        drawn_sampled = torch.where(seeded, drawn_as_without_drafts, drawn_sampled)
    accepted = torch.where(t.greedy, is_greedy_match, is_sampled_match) & spec.has_draft
    drawn = torch.where(t.greedy, greedy, drawn_sampled)
    return drawn, accepted.to(torch.int64)


def accept_runs(num_sampled_tokens: list[int], drafts: list[list[int]], drawn: list[int],
                accepted: list[int]) -> list[list[int]]:
    """Each sequence's emitted tokens, from verify()'s results read on the host: its drafts up
    to the first rejected one, then that position's drawn token (or, all accepted, the last's).
    Example: drafts [7, 8, 9], accepted [1, 0, ..], drawn [.., 4, ..] -> [7, 4]."""
    emitted = []
    first = 0  # the sequence's first sampling position
    for n, seq_drafts in zip(num_sampled_tokens, drafts):
        tokens = []
        for j in range(n):
            position = first + j
            if j < len(seq_drafts) and accepted[position]:
                tokens.append(seq_drafts[j])
                continue
            tokens.append(drawn[position])
            break
        emitted.append(tokens)
        first += n
    return emitted
