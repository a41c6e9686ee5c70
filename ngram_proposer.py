"""The n-gram proposer (prompt lookup decoding): guess that the text goes on as it did the last
time its newest words appeared. Free to run (no model), and right surprisingly often where
a model copies: editing, quoting, summarising, code.

The sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min, are
looked for earlier in its tokens (prompt and output); at the latest earlier match with k
tokens after it (else the earliest), the k tokens that followed it are the draft. Example, n from 3 down to 2, k = 3:

    tokens  To be or not to be , that is the question . To be
    last 3 ". To be": not found earlier; last 2 "To be": at 0, followed by "or not to"
    draft   [or, not, to]

The drafts are one-hot guesses (q(d) = 1): spec_decode.verify accepts each with the
target's own probability of it. vLLM's NgramProposer and prompt lookup decoding
(Saxena 2023) are the models.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, wanted: dict) -> None:
        """Each sequence of wanted (seq -> drafts it may take) gets spec_token_ids."""
        for seq, num_drafts in wanted.items():
            seq.spec_token_ids = self.find_draft(seq.token_ids, num_drafts)

    def find_draft(self, token_ids: list[int], num_drafts: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix of
        token_ids (prompt_lookup_max down to prompt_lookup_min tokens), at most num_drafts;
        [] if no suffix occurs earlier."""
        tokens = np.asarray(token_ids)
        for n in range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1):
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:]
            # every window of n tokens that ends before the last token (the suffix itself)
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts) == 0:
                continue
            # the latest match that has num_drafts tokens after it, else the earliest (the
            # most after it): in "a b a b a b", the suffix "a b" at 2, not at 4 (one token left)
            has_all_after = starts + n + num_drafts <= len(tokens)
            start = starts[has_all_after][-1] if has_all_after.any() else starts[0]
            follows = start + n
            return tokens[follows:follows + num_drafts].tolist()
        return []

    def remove(self, seq) -> None:
        """Nothing is kept per sequence."""
