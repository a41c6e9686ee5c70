"""The persistent batch: what the engine keeps on the device about the sequences it runs, from
one step to the next, so that a step's host work grows with what is new in it (a token a
sequence, a block every block_size steps), not with what the sequences already hold.

Each sequence the engine runs has a row, from the first step that schedules it until it
finishes or is preempted, and in that row:
- its block table: a row of `block_tables` (max_num_seqs, max blocks a sequence) int32 on the
  device, extended by the blocks its BlockTable gained since the last step. A step uploads
  those new (row, column, block id) entries, not every sequence's whole table: at 4,096
  tokens of context that is 256 block ids a sequence, 65,536 at batch 256, for one new
  block a sequence every 16 steps;
- if it has penalties, its penalty state: its output tokens' counts and the tokens it has
  seen (prompt and output), rows of (max_num_seqs, vocab) on the device, and its three
  penalty values. Built from its tokens the first time it samples, then given each token it
  samples where it was sampled, on the device: after that the host sends nothing for it.

Rows are handed out and taken back like blocks. A step's tables are its sequences' rows, in
batch order, gathered on the device, as wide as its longest table (rounded up to 16 columns).

    row 0: A  blocks [3, 7]        step: B (prompt chunk), A (decode)
    row 1: B  blocks [5]     +2    uploads (1, 1, 2), (1, 2, 9): B's new blocks 2 and 9
                                   block_tables[[1, 0], :16] = [[5, 2, 9, 0 ...], [3, 7, 0 ...]]

vLLM v1's InputBatch and its BlockTable (in its GPU worker) are the model; vLLM also keeps
each row's other sampling parameters there, where a step here uploads a few numbers a
sequence (sampling.py's sampling_tensors).
"""
import torch

from paged_cache import cdiv
from sampling import Penalties, upload
from scheduler import Sequence

BLOCK_TABLE_ALIGNMENT = 16  # a step's block tables' width, in block ids, is a multiple of this


class InputBatch:
    """Rows of per-sequence state on the device: block tables, and penalty state if needed."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: str):
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.rows: dict[Sequence, int] = {}           # each running sequence's row
        self.free_rows = list(range(max_num_seqs))[::-1]  # pop() hands out row 0 first
        width = aligned(cdiv(max_model_len, block_size))
        self.block_tables = torch.zeros(max_num_seqs, width, dtype=torch.int32, device=device)
        self.num_blocks = [0] * max_num_seqs          # blocks a row holds of its sequence's
        self.holds_penalties = [False] * max_num_seqs  # a row's penalty state is its sequence's
        # made when a sequence with penalties first samples: (max_num_seqs, vocab) ...
        self.output_counts: torch.Tensor | None = None  # fp32: each token's count in the output
        self.seen: torch.Tensor | None = None            # bool: in the prompt or the output
        # ... and (max_num_seqs,) fp32, each row's penalty values (neutral: 0, 0 and 1)
        self.presence: torch.Tensor | None = None
        self.frequency: torch.Tensor | None = None
        self.repetition: torch.Tensor | None = None

    def row(self, seq: Sequence) -> int:
        """seq's row; a sequence new to the batch takes a free one, with nothing in it."""
        row = self.rows.get(seq)
        if row is not None:
            return row
        row = self.free_rows.pop()
        self.rows[seq] = row
        self.num_blocks[row] = 0
        return row

    def remove(self, seq: Sequence) -> None:
        """seq left the batch (it finished or was preempted): its row is free again, its table
        zeroed (tables are padded with block 0)."""
        row = self.rows.pop(seq, None)
        if row is None:  # never scheduled (aborted while waiting)
            return
        self.block_tables[row, :self.num_blocks[row]] = 0
        self.free_rows.append(row)
        if self.holds_penalties[row]:  # neutral values, for a next owner without penalties
            self.holds_penalties[row] = False
            self.presence[row] = 0
            self.frequency[row] = 0
            self.repetition[row] = 1

    def new_blocks(self, seq: Sequence) -> tuple[int, int, list[int]]:
        """(seq's row, the first column to fill, the blocks to fill it with): those seq's
        BlockTable gained since the last call. A table only grows while its sequence runs; a
        preempted sequence comes back to a new row."""
        row = self.row(seq)
        block_ids = seq.block_table.block_ids
        first_column = self.num_blocks[row]
        self.num_blocks[row] = len(block_ids)
        return row, first_column, block_ids[first_column:]

    def truncate(self, seq: Sequence) -> None:
        """seq's table lost its last blocks (speculative decoding's rollback): its row forgets
        them, so the blocks it takes next are written again."""
        row = self.rows.get(seq)
        if row is None:
            return
        num_blocks = len(seq.block_table.block_ids)
        if num_blocks >= self.num_blocks[row]:
            return
        self.block_tables[row, num_blocks:self.num_blocks[row]] = 0
        self.num_blocks[row] = num_blocks

    def step_block_tables(self, rows: torch.Tensor, new_rows: torch.Tensor,
                          new_columns: torch.Tensor, new_block_ids: torch.Tensor,
                          max_num_blocks: int) -> torch.Tensor:
        """Write the step's new entries, then gather its tables: rows (S,) -> (S, width) int32
        on the device, width max_num_blocks rounded up to a multiple of 16 (Triton specialises
        the kernel on whether a row's stride divides by 16: every batch launches one kernel)."""
        if len(new_block_ids):  # most decode steps add no block (a shape: no wait)
            self.block_tables[new_rows, new_columns] = new_block_ids.to(torch.int32)
        columns = self.block_tables[:, :aligned(max_num_blocks)]
        # index_select, not columns[rows]: 2.4x faster on a CPU (256 rows of 288 columns)
        return torch.index_select(columns, 0, rows)

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each new token's cache slot (N,) int64, read from its sequence's table on the device
        (after step_block_tables wrote the step's new blocks): the block holding its position,
        times the block size, plus its offset in the block. token_rows (N,): each token's
        sequence's row; positions (N,): its position in its sequence."""
        block_ids = self.block_tables[token_rows, positions // self.block_size]
        return block_ids.to(torch.int64) * self.block_size + positions % self.block_size

    def penalties(self, seqs: list[Sequence]) -> Penalties:
        """The Penalties of a step's sampling sequences, seqs in order. A row's state is built
        once, in the first step its sequence samples with penalties: its tokens (prompt and
        output) go up in one upload, its three penalty values in another. After that it takes
        only the tokens it samples, on the device (count_sampled): the host does nothing for it
        but name its row. A sequence without penalties gets whatever its row holds, which the
        neutral values (see remove) ignore."""
        if self.output_counts is None:
            self._make_penalty_state()
        rows = []
        new_seqs = []  # penalised sequences whose rows hold no state yet
        for seq in seqs:
            row = self.rows[seq]
            rows.append(row)
            if not self.holds_penalties[row] and seq.params.has_penalties:
                new_seqs.append(seq)
        if new_seqs:
            self._build_penalty_rows(new_seqs)
        step_rows = upload(dict(rows=rows), torch.int64, self.device)["rows"]
        any_repetition = any(seq.params.repetition_penalty != 1 for seq in seqs)
        any_frequency_or_presence = any(seq.params.frequency_penalty != 0
                                        or seq.params.presence_penalty != 0 for seq in seqs)
        output_counts, seen = self.penalty_rows(step_rows, any_frequency_or_presence,
                                                any_repetition)
        return Penalties(output_counts=output_counts, seen=seen,
                         presence=self.presence[step_rows], frequency=self.frequency[step_rows],
                         repetition=self.repetition[step_rows], input_batch_rows=step_rows,
                         any_repetition=any_repetition,
                         any_frequency_or_presence=any_frequency_or_presence)

    def count_sampled(self, penalties: Penalties, token_ids: torch.Tensor) -> None:
        """After sampling with penalties: each row's new token (token_ids (n,), on the device,
        in the rows' order) counted in its output and seen, without a wait for the device or
        anything from the host. The counts that sampling used were gathered before."""
        ones = torch.ones(len(token_ids), device=self.device)
        rows = penalties.input_batch_rows
        self.output_counts.index_put_((rows, token_ids), ones, accumulate=True)
        self.seen[rows, token_ids] = True

    def count_emitted(self, seqs: list[Sequence], emitted: list[list[int]]) -> None:
        """After a speculative step with penalties: each sequence's emitted tokens (a run of
        them, known only on the host) counted in its output and seen. One upload."""
        rows = []
        token_ids = []
        for seq, tokens in zip(seqs, emitted):
            row = self.rows[seq]
            if not self.holds_penalties[row]:
                continue
            rows += [row] * len(tokens)
            token_ids += tokens
        index = upload(dict(rows=rows, token_ids=token_ids), torch.int64, self.device)
        ones = torch.ones(len(rows), device=self.device)
        self.output_counts.index_put_((index["rows"], index["token_ids"]), ones, accumulate=True)
        self.seen[index["rows"], index["token_ids"]] = True

    def penalty_rows(self, rows: torch.Tensor, counts: bool, seen: bool
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The penalty state's rows (n,) that the step's penalties read, gathered in the step's
        order: (n, vocab) counts if `counts` (frequency and presence read them), (n, vocab) seen
        if `seen` (repetition reads it), else None. Device work: on a CPU, a copy of n x vocab
        values each (51 MB of counts at batch 256 and GPT-2's vocabulary)."""
        gathered_counts = None
        if counts:
            gathered_counts = self.output_counts[rows]
        gathered_seen = None
        if seen:
            gathered_seen = self.seen[rows]
        return gathered_counts, gathered_seen

    def _make_penalty_state(self) -> None:
        """The rows' penalty state, made when a sequence with penalties first samples."""
        num_rows = self.block_tables.shape[0]
        self.output_counts = torch.zeros(num_rows, self.vocab_size, device=self.device)
        self.seen = torch.zeros(num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        self.presence = torch.zeros(num_rows, device=self.device)
        self.frequency = torch.zeros(num_rows, device=self.device)
        self.repetition = torch.ones(num_rows, device=self.device)

    def _build_penalty_rows(self, seqs: list[Sequence]) -> None:
        """Build the penalty state of seqs' rows from their tokens: the rows are emptied (their
        previous owners' state goes), each token is seen, an output token also counted, and
        each row takes its sequence's three penalty values. Two uploads in all."""
        ints = dict(rows=[], seen_rows=[], seen_ids=[], output_rows=[], output_ids=[])
        for seq in seqs:
            row = self.rows[seq]
            self.holds_penalties[row] = True
            output_ids = seq.token_ids[seq.num_prompt_tokens:]
            ints["rows"].append(row)
            ints["seen_rows"] += [row] * len(seq.token_ids)
            ints["seen_ids"] += seq.token_ids
            ints["output_rows"] += [row] * len(output_ids)
            ints["output_ids"] += output_ids
        index = upload(ints, torch.int64, self.device)
        floats = upload(dict(presence=[seq.params.presence_penalty for seq in seqs],
                             frequency=[seq.params.frequency_penalty for seq in seqs],
                             repetition=[seq.params.repetition_penalty for seq in seqs]),
                        torch.float32, self.device)
        rows = index["rows"]
        self.output_counts[rows] = 0
        self.seen[rows] = False
        ones = torch.ones(len(ints["output_ids"]), device=self.device)  # made there
        self.output_counts.index_put_((index["output_rows"], index["output_ids"]), ones,
                                      accumulate=True)
        self.seen[index["seen_rows"], index["seen_ids"]] = True
        self.presence[rows] = floats["presence"]
        self.frequency[rows] = floats["frequency"]
        self.repetition[rows] = floats["repetition"]


def aligned(num_blocks: int) -> int:
    """num_blocks rounded up to a multiple of BLOCK_TABLE_ALIGNMENT."""
    return cdiv(num_blocks, BLOCK_TABLE_ALIGNMENT) * BLOCK_TABLE_ALIGNMENT
