"""Beam search on shared blocks: a request's beams are sequences whose block tables share their
common past, and a block is copied only when a beam writes into one another beam still reads.

vLLM's API and rule (`LLM.beam_search(prompts, BeamSearchParams(...))`): a request starts as
one beam, its prompt. At each step every live beam's top 2 x beam_width next tokens, by
log-probability (the log-softmax of its logits, divided by the temperature unless that is 0),
are candidates scored by the beam's cumulative log-probability plus the token's; the best
beam_width of them are the next step's beams. A candidate ending in end-of-text (unless
ignore_eos), or whose text completes one of the stop strings, is a finished hypothesis instead
(its text cut at the stop string unless include_stop_str_in_output: SamplingParams' rule, by
the engine's Detokenizer, which each beam keeps and each candidate forks); at max_tokens the
live beams finish too, and the best beam_width hypotheses by get_beam_search_score are the
request's sequences, best first.

The beams advance in the engine's steps beside every other request (nanoserve.py hooks this in
at three places: add_beam_request, update, and abort): each beam is a Sequence of the
scheduler, decoding one token a step, and the scheduler keeps a request's beams together
(scheduler.BeamGroup: admitted with room for beam_width sequences, preempted and readmitted
together). After a step, update() takes the beams' logits rows, chooses, and rearranges the
sequences: a beam that no candidate continues is finished and frees its blocks; a beam
continued once takes its token; a beam continued k times forks k - 1 sequences first
(BlockTable.fork: every block shared, reference counts up).

Copy-on-write, worked through. Blocks of 4 tokens, beam width 2, a 6-token prompt p0..p5:

    step 1   the prompt (one beam) computes p0..p5: blocks [A: p0-p3] [B: p4 p5 _ _]
             its candidates: "x" (-0.1) and "y" (-0.7), both kept: the beam forks
               beam 1: p0..p5 x   table [A, B]     ref counts A: 2, B: 2
               beam 2: p0..p5 y   table [A, B]
    step 2   both write token 6 into block B, slot 2; B has two owners, so the scheduler's
             BlockTable.ensure gives beam 2 a fresh block C and queues the copy B -> C; B has
             one owner again, and beam 1 writes into it in place
               beam 1: [A, B: p4 p5 x _]          beam 2: [A, C: p4 p5 y _]
             the engine copies B into C (swap.copy_blocks, one op for the step's copies)
             before the forward writes x's and y's K/V; A stays shared, never copied
    step 3   candidates "x a" (-0.3), "x b" (-0.5), "y c" (-0.9): beam 1 is continued twice
             and beam 2 not at all: beam 2 finishes (C freed, A's count down to 1), beam 1
             forks again: [A, B] shared by both, and the one writing token 7 into B copies it

So W beams hold their common prefix once, and a fork costs one block copy at most (none when
the beams' next token starts a new block). On a CPU they also read it once a step: a
request's beams attend their shared blocks together, W queries over one copy of the keys
(cascade attention: model_runner.beam_shared_prefixes, kernels.add_shared_prefix). The rule
is checked where a step's writes are laid out: BlockTable.assert_owned, no block written has
another owner.

Where transformers' `generate(num_beams=W)` differs: it divides a hypothesis's log-probability
by its generated length ** length_penalty (vLLM: its whole length, prompt included, less a
final end-of-text), and by default (early_stopping=False) it stops once no live beam can
beat the worst of W finished hypotheses; vLLM and this module run to max_tokens. With no
end-of-text among the candidates (ignore_eos) the two give the same W sequences in the same
order (test_beam_search.py checks it against a reference written after transformers').

In this file, in order: BeamSearchParams, BeamSearchSequence and BeamSearchOutput (vLLM's
output), get_beam_search_score, BeamSearchRequest (one request's search), BeamSearch (the
engine's hooks). Left out: LoRA, speculative decoding, streaming, min_tokens and stop token
ids (vLLM's BeamSearchParams has neither, nor stop strings, which this takes).
"""
import copy
import math
from dataclasses import dataclass, field
from operator import itemgetter

import torch

from model_runner import ModelOutput, ModelRunner, to_host
from options import check_fields, option
from sampling import parse_stop
from scheduler import BeamGroup, Scheduler, Sequence, SequenceStatus
from tokenizer import Detokenizer

MAX_BEAM_WIDTH = 128  # beams of one request at most (as sampling's MAX_N)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, validated when made."""
    beam_width: int = option(1, "beams kept at each step, and sequences returned",
                             high=MAX_BEAM_WIDTH)
    max_tokens: int = option(16, "tokens to generate (every beam runs to it)")
    ignore_eos: bool = option(False, "end-of-text is an ordinary token, not a finished "
                              "hypothesis")
    temperature: float = option(0.0, "divides the logits before the log-softmax; 0: as 1",
                                low=0)
    length_penalty: float = option(1.0, "a hypothesis scores cum_logprob / len ** this",
                                   low=-math.inf)
    stop: list[str] | None = option(None, "a hypothesis ends at any of these strings (a "
                                    "string, or strings: SamplingParams' stop)", type=list)
    include_stop_str_in_output: bool = option(False, "keep the stop string, or a final "
                                              "end-of-text's text")

    def __post_init__(self):
        self.stop = parse_stop(self.stop)
        check_fields(self)


@dataclass
class BeamSearchSequence:
    """One hypothesis, as vLLM returns it: tokens and text include the prompt."""
    tokens: list[int]
    logprobs: list[dict[int, float]]  # per output token: {its id: its log-probability}
    cum_logprob: float = 0.0
    text: str | None = None  # in the search: the output's alone, set where a stop string cut it
    finish_reason: str | None = None  # "stop" (end-of-text, a stop string) or "length"
    stop_reason: str | None = None    # the stop string that ended it


@dataclass
class BeamSearchOutput:
    """A request's beam_width best hypotheses, best first (vLLM's)."""
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score of a hypothesis: its log-probability over its length ** length_penalty,
    the length counting the prompt but not a final end-of-text."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len ** length_penalty)


@dataclass(eq=False)
class BeamSearchRequest:
    """One request's search: its live beams (the group the scheduler keeps together), their
    top candidates as each gets them (a step may run some of them and not the others), and
    the finished hypotheses."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    group: BeamGroup
    candidates: dict[Sequence, tuple[list[float], list[int]]] = field(default_factory=dict)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    num_forks: int = 0
    aborted: bool = False
    error: str | None = None

    def best(self, eos_token_id: int | None) -> list[BeamSearchSequence]:
        """The beam_width best hypotheses, best first (a stable sort: a tie keeps the order
        they finished in)."""
        def score(hypothesis: BeamSearchSequence) -> float:
            return get_beam_search_score(hypothesis.tokens, hypothesis.cum_logprob,
                                         eos_token_id, self.params.length_penalty)
        return sorted(self.finished, key=score, reverse=True)[:self.params.beam_width]


@dataclass(eq=False)
class Candidate:
    """A beam and a next token: their cumulative log-probability, the token's own."""
    cum_logprob: float
    beam: Sequence
    token_id: int
    logprob: float
    detokenizer: Detokenizer | None = None  # beam's text with the token's (with stop strings)


class BeamSearch:
    """The engine's beam-search requests, and the hooks that advance them."""

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner,
                 eos_token_ids: list[int]):
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, BeamSearchRequest] = {}
        self.num_forks = 0  # beams forked, in all (each a table shared, not a block copied)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def add(self, request: BeamSearchRequest) -> None:
        self.requests[request.request_id] = request
        for seq in request.group.seqs:
            self.scheduler.add(seq)

    def update(self, model_output: ModelOutput) -> list[BeamSearchRequest]:
        """After a step: for each beam that sampled (its sampled token means nothing; the
        engine leaves it), keep its top 2 x beam_width candidates, and advance each request
        whose live beams all have theirs. The requests that finished."""
        if not self.requests:  # most steps: no beam search, no pass over the step's samples
            return []
        rows = []
        beams = []
        for row, seq in enumerate(model_output.sample_seqs):
            if seq.beams is not None and seq in model_output.sampled_token_ids:
                rows.append(row)
                beams.append(seq)
        if not beams:
            return []
        for seq, candidates in zip(beams, self._top_candidates(model_output.logits, rows, beams)):
            self._request(seq).candidates[seq] = candidates
        finished = []
        for request in {id(self._request(seq)): self._request(seq) for seq in beams}.values():
            if all(seq in request.candidates for seq in request.group.seqs):
                if self._advance(request):
                    finished.append(request)
        return finished

    def _request(self, seq: Sequence) -> BeamSearchRequest:
        return self.requests[seq.request_id]

    def _top_candidates(self, logits: torch.Tensor, rows: list[int], beams: list[Sequence]
                        ) -> list[tuple[list[float], list[int]]]:
        """Each beam's top 2 x beam_width (log-probability, token id), best first: the
        log-softmax of its logits row at its temperature (0: as 1), on the device, then one
        read of values and ids."""
        device = logits.device
        temperatures = [self._request(seq).params.temperature or 1.0 for seq in beams]
        widths = [2 * self._request(seq).params.beam_width for seq in beams]
        index = torch.tensor(rows, dtype=torch.int64).to(device)
        scale = torch.tensor(temperatures, dtype=torch.float32).to(device)
        logprobs = torch.log_softmax(logits[index] / scale[:, None], dim=-1)  # (b, vocab)
        values, ids = logprobs.topk(min(max(widths), logprobs.shape[1]), dim=-1)
        values, ids = to_host(values), to_host(ids)
        return [(v[:k], i[:k]) for v, i, k in zip(values, ids, widths)]

    def _advance(self, request: BeamSearchRequest) -> bool:
        """One step of the search (vLLM's rule): every candidate of every live beam, best
        first; one ending in end-of-text (unless ignore_eos) or a stop string is a finished
        hypothesis, the best beam_width of the others the next beams. Whether the request
        finished."""
        params = request.params
        scored = []  # (cum_logprob, beam, token id, logprob): a Candidate only once looked at
        for seq in request.group.seqs:
            values, ids = request.candidates.pop(seq)
            cum_logprob = seq.cum_logprob
            scored += [(cum_logprob + value, seq, token_id, value)
                       for value, token_id in zip(values, ids)]
        scored.sort(key=itemgetter(0), reverse=True)  # stable: ties keep beam, then rank order
        # without end-of-text or stop strings only the best beam_width can matter
        only_kept = params.ignore_eos and not params.stop
        kept = []
        for entry in scored:
            candidate = Candidate(*entry)
            if candidate.token_id in self.eos_token_ids and not params.ignore_eos:
                request.finished.append(self._hypothesis(candidate.beam, candidate, "stop"))
                continue
            stop = self._stop_string(candidate)
            if stop is not None:
                hypothesis = self._hypothesis(candidate.beam, candidate, "stop")
                hypothesis.stop_reason = stop
                hypothesis.text = candidate.detokenizer.new_text(finished=True)  # cut at stop
                request.finished.append(hypothesis)
            elif len(kept) < params.beam_width:
                kept.append(candidate)
            if only_kept and len(kept) == params.beam_width:
                break
        self._rearrange(request, kept)
        live = request.group.seqs
        if live and live[0].num_output_tokens < params.max_tokens:
            return False
        for seq in live:
            request.finished.append(self._hypothesis(seq, None, "length"))
        self.release(request)
        return True

    @staticmethod
    def _stop_string(candidate: Candidate) -> str | None:
        """The stop string that the candidate's token completes in its beam's text, if any
        (the engine's Detokenizer, forked: the candidate's text, kept for it); None without
        stop strings."""
        if candidate.beam.detokenizer is None:
            return None
        candidate.detokenizer = candidate.beam.detokenizer.fork()
        return candidate.detokenizer.append(candidate.token_id)

    def _rearrange(self, request: BeamSearchRequest, kept: list[Candidate]) -> None:
        """Make the kept candidates the live beams: a beam kept by none finishes (its blocks
        freed), one kept once takes its token, one kept k times forks k - 1 sequences first,
        sharing its blocks (the first to write into a shared block copies it)."""
        continued = {}  # beam -> its candidates kept, best first
        for candidate in kept:
            continued.setdefault(candidate.beam, []).append(candidate)
        for seq in request.group.seqs:
            if seq not in continued:
                self._drop(seq)
        new_beams = {}  # candidate -> the sequence that continues it
        for parent, candidates in continued.items():
            for candidate in candidates[1:]:
                new_beams[candidate] = self._fork(request, parent)
            new_beams[candidates[0]] = parent  # the parent itself: it takes its token below
        for candidate in kept:
            seq = new_beams[candidate]
            seq.token_ids.append(candidate.token_id)
            seq.logprobs.append({candidate.token_id: candidate.logprob})
            seq.cum_logprob = candidate.cum_logprob
            seq.detokenizer = candidate.detokenizer
        request.group.seqs[:] = [new_beams[candidate] for candidate in kept]  # best first

    def _fork(self, request: BeamSearchRequest, parent: Sequence) -> Sequence:
        """A running copy of parent sharing its blocks (BlockTable.fork)."""
        request.num_forks += 1
        self.num_forks += 1
        child = copy.copy(parent)  # not dataclasses.replace: its __init__ copies the prompt
        child.seq_id = f"{request.num_forks}_{request.request_id}"
        child.block_table = parent.block_table.fork()
        child.token_ids = list(parent.token_ids)
        child.logprobs = list(parent.logprobs)
        child.host_block_ids = []
        child.spec_token_ids = []
        child.queue_entry = None
        self.scheduler.fork(parent, child)
        return child

    def _drop(self, seq: Sequence) -> None:
        """A beam that leaves the search (dropped, finished or aborted): its blocks and its
        input-batch row go back."""
        if not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.model_runner.remove(seq)

    def _hypothesis(self, seq: Sequence, candidate: Candidate | None, finish_reason: str
                    ) -> BeamSearchSequence:
        """seq as a finished hypothesis, with candidate's token appended if given."""
        tokens = list(seq.token_ids)
        logprobs = list(seq.logprobs)
        cum_logprob = seq.cum_logprob
        if candidate is not None:
            tokens.append(candidate.token_id)
            logprobs.append({candidate.token_id: candidate.logprob})
            cum_logprob = candidate.cum_logprob
        return BeamSearchSequence(tokens, logprobs, cum_logprob, finish_reason=finish_reason)

    def release(self, request: BeamSearchRequest) -> None:
        """The request leaves: its live beams give their blocks back."""
        for seq in request.group.seqs:
            self._drop(seq)
        request.group.seqs.clear()
        request.candidates.clear()
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> BeamSearchRequest | None:
        """Cancel a request now (its beams' blocks freed); None if it is not ours."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.aborted = True
        self.release(request)
        return request

    def fail(self, seq: Sequence, error: str) -> BeamSearchRequest | None:
        """A beam failed (its logits were NaN): its whole request fails; None if the request
        has gone already (another of its beams failed in the same step)."""
        request = self.requests.get(seq.request_id)
        if request is None:
            return None
        request.error = error
        self.release(request)
        return request
