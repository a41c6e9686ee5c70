"""Records .ci/fixtures/repetition_penalty.json: the tokens Hugging Face transformers' greedy
generate(do_sample=False, repetition_penalty=p) picks on a seeded random GPT-2, the reference of
test_greedy_repetition_penalty_equals_transformers.

Why a fixture: transformers is the reference for what repetition_penalty means (over prompt and
generated tokens, a positive logit divided by p, a negative one multiplied), but it is no
dependency of nanoserve, so its answers are recorded here once and the tests read them.

For each case it records the prompt ids, the penalty, the generated ids and, for each generated
token, the gap between the top two penalized logits (transformers' processed scores): where a
gap is tiny two float32 implementations may pick either token, and the test stops comparing.
Before writing, it checks that the cases tell the right penalty from wrong ones (none, over
the output only, negative logits divided too), run through transformers the same way.

Re-run from the repo root when the checkpoint helpers in test_checkpoint.py (SMALL,
straddling_gpt2_state, write_random_gpt2) or the cases below change:

    pip install transformers   # for this script only: not in requirements.txt or pyproject
    python .ci/make_repetition_penalty_fixture.py

The JSON records the transformers version that made it (first made with 5.24.0).
"""
import json
import os
import sys
import tempfile

import torch
import transformers
from transformers import (GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList,
                          RepetitionPenaltyLogitsProcessor)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the flat modules and the tests live at the repo root

from test_checkpoint import (REPETITION_PENALTY_FIXTURE, SMALL, hf_gpt2_logits,  # noqa: E402
                             straddling_gpt2_state, tokens_before_near_tie, write_random_gpt2)

PROMPTS = [
    [72, 101, 108, 108, 111],                              # "Hello": one repeated id
    [7, 7, 7],                                             # one id, three times
    [200, 13, 200, 13, 256, 13, 99, 42, 5, 5, 250, 3],     # repeats and <|endoftext|>
    [31, 64, 105, 17, 90, 230, 211, 29, 160],              # ids this model favors: 105, 230, 29
]
PENALTIES = [1.3, 0.8, 2.0]  # above 1 discourages repeats, below 1 encourages them
NEW_TOKENS = 24


def load_reference(path: str) -> GPT2LMHeadModel:
    """transformers' GPT-2 from the checkpoint directory, float32, with no end-of-text token:
    it never stops early (nanoserve's ignore_eos=True). Its logits are checked against the
    hand-written GPT-2 in test_checkpoint, so a weight it failed to load cannot go unnoticed."""
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32,
                                            attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    idx = torch.arange(20) * 13 % SMALL.vocab_size
    with torch.no_grad():
        logits = model(idx[None]).logits[0]
    torch.testing.assert_close(logits, hf_gpt2_logits(straddling_gpt2_state(), SMALL, idx),
                               rtol=1e-4, atol=1e-4)
    return model


def greedy(model: GPT2LMHeadModel, prompt: list[int], penalty: float = 1.0,
           processor: LogitsProcessor | None = None) -> tuple[list[int], list[float]]:
    """(NEW_TOKENS generated ids, each one's gap between the top two processed logits), with
    transformers' repetition_penalty, or a processor of our own (a wrong meaning) instead."""
    input_ids = torch.tensor([prompt])
    processors = LogitsProcessorList([processor] if processor else [])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=False, repetition_penalty=penalty,
                             logits_processor=processors, max_new_tokens=NEW_TOKENS,
                             output_scores=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt):].tolist()
    assert len(generated) == len(out.scores) == NEW_TOKENS, "stopped early"
    gaps = []
    for scores in out.scores:
        top_two = scores[0].topk(2).values
        gaps.append(round((top_two[0] - top_two[1]).item(), 6))
    return generated, gaps


class SignBlindPenalty(LogitsProcessor):
    """A wrong repetition penalty: every seen token's logit divided, negative ones too."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, input_ids, True)
        return torch.where(seen, scores / self.penalty, scores)


def wrong_meanings(prompt: list[int], penalty: float) -> dict[str, LogitsProcessor | None]:
    """What a wrong implementation might do instead, by name; the fixture must tell each
    from the right one."""
    return {"no penalty": None,
            "output tokens only": RepetitionPenaltyLogitsProcessor(
                penalty, prompt_ignore_length=len(prompt)),
            "negative logits divided too": SignBlindPenalty(penalty)}


def fixture_text(cases: list[dict]) -> str:
    """The fixture's JSON, a case a line: small, and a re-run's diff reads case by case."""
    lines = ",\n".join(json.dumps(case) for case in cases)
    text = (f'{{"made_by": ".ci/make_repetition_penalty_fixture.py",\n'
            f' "transformers_version": "{transformers.__version__}",\n'
            f' "cases": [\n{lines}\n]}}\n')
    assert json.loads(text)["cases"] == cases
    return text


def main() -> None:
    """Every prompt with every penalty, checked and written as the fixture."""
    cases = []
    caught = dict.fromkeys(wrong_meanings([], 1.0), 0)  # cases that tell each from the right
    with tempfile.TemporaryDirectory() as path:
        write_random_gpt2(path)
        model = load_reference(path)
        for prompt in PROMPTS:
            for penalty in PENALTIES:
                generated, gaps = greedy(model, prompt, penalty)
                n = tokens_before_near_tie(gaps)
                print(f"prompt {prompt} penalty {penalty}: {generated}, {n} comparable")
                for name, processor in wrong_meanings(prompt, penalty).items():
                    wrong, _ = greedy(model, prompt, processor=processor)
                    caught[name] += wrong[:n] != generated[:n]
                cases.append(dict(prompt_token_ids=prompt, repetition_penalty=penalty,
                                  token_ids=generated, top_two_gaps=gaps))
    print(f"cases that tell a wrong meaning from the right one, of {len(cases)}: {caught}")
    assert all(caught.values()), "the fixture cannot tell a wrong penalty from the right one"
    os.makedirs(os.path.dirname(REPETITION_PENALTY_FIXTURE), exist_ok=True)
    with open(REPETITION_PENALTY_FIXTURE, "w") as f:
        f.write(fixture_text(cases))
    print(f"wrote {len(cases)} cases to {REPETITION_PENALTY_FIXTURE}")


if __name__ == "__main__":
    main()
