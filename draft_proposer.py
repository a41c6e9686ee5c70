"""The draft-model proposer: a small model that shares the target's tokenizer guesses the next
k tokens, one cheap forward each; the target verifies them in one step (spec_decode.py).

The draft runs on the engine's own code: a ModelRunner with a paged cache of its own, and for
each target sequence a draft Sequence with a block table in that cache. Before proposing, a
draft sequence takes the target's tokens: its K/V stay good up to the first token where they
differ (the draft's rejected guesses), its progress moves back there and blocks past it are
freed. Then a first forward computes what it lacks (the prompt, on its first proposal; the
accepted tokens and the target's own token after that) and samples draft 1; k - 1 more of one
token each sample the rest. Example, k = 3, the target at [.. on] with drafts [the, cat, sat]
of which it accepted [the, cat] and emitted "ran": the draft had computed [.. on, the, cat]
and sampled sat; it keeps [.. on, the, cat], computes [ran] and samples 3 new drafts.

A draft token is sampled from the draft's softmax(logits / temperature) (greedy for a greedy
request), and that distribution, q, goes with it for the rejection test. A seeded request's
draft draws its guess for output position i with the noise the target draws position i's
token with (sampling.noise_seed): the target accepts a seeded guess only where its own draw
equals it (spec_decode.verify), and with the same noise a draft whose q is close to p makes
the same draw (Gumbel-max coupling: q = p always agrees), so seeded guesses are accepted
about as often as rejection sampling accepts, and the tokens are those without speculation.
"""
import dataclasses

import torch

from checkpoint import Checkpoint, load_model
from model_runner import ModelRunner
from paged_cache import BlockTable, kv_bytes_per_token, kv_cache_torch_dtype
from sampling import GREEDY_BELOW, SamplingParams
from scheduler import Sequence

PROBE_TEXT = "Hello, world! The quick brown fox jumps over 13 lazy dogs."


def load_draft(path: str, config, dtype: torch.dtype, tokenizer) -> Checkpoint:
    """speculative_config's model on the engine's device in its dtype, checked to share the
    target's tokenizer. The engine loads it before its KV cache is sized: the draft's weights
    and its cache take their part of the GPU too."""
    try:
        checkpoint = load_model(path, None, config.seed, config.device, dtype)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config's model: {e}") from None
    check_same_tokenizer(path, checkpoint.tokenizer, tokenizer)
    return checkpoint


def draft_kv_bytes_per_token(checkpoint: Checkpoint | None, kv_cache_dtype: str = "auto") -> int:
    """A draft's K/V bytes a token (0: no draft), what its cache adds to the target's: in the
    target's kv_cache_dtype, which its runner takes too (its weights are not quantized)."""
    if checkpoint is None:
        return 0
    c = checkpoint.model.config
    dtype = kv_cache_torch_dtype(kv_cache_dtype, checkpoint.dtype)
    return kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_dim, dtype)


class DraftModelProposer:
    def __init__(self, path: str, checkpoint: Checkpoint, engine):
        """checkpoint: the draft, from load_draft."""
        config = engine.config
        if checkpoint.model.config.n_positions < engine.max_model_len:
            raise ValueError(f"speculative_config's model: {path} has a context of "
                             f"{checkpoint.model.config.n_positions} tokens; the engine serves "
                             f"{engine.max_model_len} (lower max_model_len)")
        # its own cache, as many tokens as the target's (it mirrors every running sequence;
        # the target's was sized for both), and no swap space: a preempted sequence's draft
        # is dropped (remove), and recomputed from its tokens when it drafts again
        draft_config = dataclasses.replace(
            config, model=path, preset=None, speculative_config=None, enforce_eager=True,
            enable_prefix_caching=False, kv_cache_tokens=engine.kv_cache_tokens,
            preemption_mode="recompute")
        self.runner = ModelRunner(draft_config, checkpoint.model.eval(), checkpoint.dtype,
                                  engine.vocab_size, engine.eos_token_ids)
        self.runner.prepare(engine.max_model_len)
        self.draft_seqs: dict[Sequence, Sequence] = {}  # target sequence -> its draft's

    def propose(self, wanted: dict) -> None:
        """Each sequence of wanted (seq -> drafts it may take) gets spec_token_ids and, unless
        greedy, draft_probs: up to that many tokens, k forwards of the draft for all at once."""
        most_drafts = max(wanted.values())
        targets = {}   # draft sequence -> its target sequence
        num_new = {}   # draft sequence -> the tokens its next forward computes
        for seq in wanted:
            draft = self._synced_draft(seq)
            targets[draft] = seq
            if draft.block_table.ensure(len(draft.token_ids) + most_drafts):
                num_new[draft] = len(draft.token_ids) - draft.num_computed_tokens
        draft_tokens = {draft: [] for draft in num_new}  # the tokens it proposes
        draft_q = {draft: [] for draft in num_new}       # the distribution of each (or None)
        for _ in range(most_drafts):
            active = {draft: n for draft, n in num_new.items()
                      if len(draft_tokens[draft]) < wanted[targets[draft]]}
            if not active:
                break
            output = self.runner.execute_model(active)
            if output.failed:  # NaN in the draft: no guesses this step
                return
            for row, (draft, tokens) in enumerate(output.sampled_token_ids.items()):
                draft.num_computed_tokens += active[draft]
                draft.token_ids += tokens
                draft_tokens[draft].append(tokens[0])
                draft_q[draft].append(draft_distribution(output.logits[row], draft.params))
                num_new[draft] = 1
        for draft, tokens in draft_tokens.items():
            seq = targets[draft]
            seq.spec_token_ids = tokens
            q_rows = draft_q[draft]
            seq.draft_probs = None if q_rows[0] is None else torch.stack(q_rows)

    def _synced_draft(self, seq: Sequence) -> Sequence:
        """seq's draft sequence, made on its first proposal, holding seq's tokens now: good
        K/V up to the first token where its own guesses differ from seq's tokens."""
        draft = self.draft_seqs.get(seq)
        if draft is None:
            draft = self._new_draft(seq)
            self.draft_seqs[seq] = draft
        tokens = seq.token_ids
        common = draft.num_prompt_tokens
        limit = min(len(tokens), len(draft.token_ids))
        while common < limit and draft.token_ids[common] == tokens[common]:
            common += 1
        del draft.token_ids[common:]
        draft.token_ids += tokens[common:]
        # the last token's logits give draft 1: it is computed (again, if the draft had)
        draft.num_computed_tokens = min(draft.num_computed_tokens, common, len(tokens) - 1)
        draft.block_table.truncate(draft.num_computed_tokens)
        self.runner.truncate(draft)
        return draft

    def _new_draft(self, seq: Sequence) -> Sequence:
        """A draft sequence for seq: its prompt, and sampling by temperature alone (greedy for
        a greedy request), with seq's seed (its output positions are seq's: the same noise)."""
        params = seq.params
        temperature = 0.0 if params.temperature < GREEDY_BELOW else params.temperature
        draft_params = SamplingParams(temperature=temperature, max_tokens=params.max_tokens,
                                      ignore_eos=True, seed=params.seed)
        return Sequence(seq.seq_id, None, seq.prompt_token_ids, draft_params,
                        BlockTable(self.runner.block_pool))

    def remove(self, seq: Sequence) -> None:
        """seq finished or was preempted: its draft's blocks and row go."""
        draft = self.draft_seqs.pop(seq, None)
        if draft is None:
            return
        draft.block_table.release()
        self.runner.remove(draft)


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """q, the distribution a draft token was drawn from: softmax(logits / temperature), (vocab,);
    None for a greedy draft (a greedy target checks the argmax and needs no q)."""
    if params.temperature < GREEDY_BELOW:
        return None
    return (logits / params.temperature).softmax(dim=-1)


def check_same_tokenizer(path: str, draft, target) -> None:
    """ValueError naming speculative_config's model unless the draft's tokenizer is the
    target's: the same number of ids and the same ids for a probe text."""
    if draft.n_vocab != target.n_vocab:
        raise ValueError(f"speculative_config's model: {path} has a tokenizer of {draft.n_vocab} "
                         f"ids; the target's has {target.n_vocab}: a draft must share it")
    if draft.encode(PROBE_TEXT) != target.encode(PROBE_TEXT):
        raise ValueError(f"speculative_config's model: {path} tokenizes text differently from "
                         "the target: a draft must share its tokenizer")
