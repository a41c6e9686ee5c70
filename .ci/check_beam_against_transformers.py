"""Check nanoserve's beam search against transformers' generate(num_beams=W), where transformers
is installed (not a CI dependency; test_beam_search.py checks a reference written after
transformers' algorithm instead):

    python .ci/check_beam_against_transformers.py [CHECKPOINT_DIR]

CHECKPOINT_DIR: a Hugging Face checkpoint with its tokenizer (default: the shipped model).
For each prompt and W in 1, 2, 4: LLM.beam_search with ignore_eos against generate(num_beams=W,
num_return_sequences=W, do_sample=False, length_penalty=1.0) with no end-of-text token, so that
no hypothesis finishes early on either side (ignore_eos, as transformers has it: its
generation_config's eos_token_id set to None). Both then return the W live beams after
MAX_TOKENS steps, ordered by their log-probability (every length is the same, so the length
they divide by does not reorder them). Prints each W's sequences side by side; exits 1 if any
token or the order differs (fp32 on the CPU throughout). Run 2026-12-02 with transformers
5.24.0 in a separate virtual environment: the shipped model and SmolLM2-135M-Instruct, every
W the same (BENCHMARKS.md, section 17).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoserve import LLM, BeamSearchParams  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(HERE, "checkpoints", "shakespeare")
PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore art thou", "First Citizen:\n"]
WIDTHS = (1, 2, 4)
MAX_TOKENS = 16


def hf_beams(hf, prompt_ids: list[int], beam_width: int) -> list[list[int]]:
    """transformers' W returned sequences, best first: their generated token ids."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam_width,
                          num_return_sequences=beam_width, do_sample=False,
                          length_penalty=1.0, early_stopping=False, max_new_tokens=MAX_TOKENS,
                          min_new_tokens=0, pad_token_id=0, eos_token_id=None)
    return [row[len(prompt_ids):].tolist() for row in out]


def main(checkpoint: str) -> int:
    import transformers
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    hf = hf.eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: no hypothesis ends before the last
    failures = 0
    for prompt in PROMPTS:
        prompt_ids = llm.engine.tokenizer.encode(prompt)
        for beam_width in WIDTHS:
            params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS,
                                      ignore_eos=True)
            output, = llm.beam_search([prompt_ids], params)
            ours = [s.tokens[len(prompt_ids):] for s in output.sequences]
            theirs = hf_beams(hf, prompt_ids, beam_width)
            same = ours == theirs
            failures += not same
            print(f"{prompt!r} W={beam_width}: {'same' if same else 'DIFFERENT'}")
            for rank, (mine, hf_tokens) in enumerate(zip(ours, theirs)):
                score = output.sequences[rank].cum_logprob
                print(f"  {rank}: {score:9.4f} {mine}\n               {hf_tokens}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else SHIPPED))
