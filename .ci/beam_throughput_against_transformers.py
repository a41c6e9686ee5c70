"""Beam search throughput: nanoserve's LLM.beam_search against transformers'
generate(num_beams=W) on the shipped model (or CHECKPOINT_DIR), where transformers is installed
(not a CI dependency):

    python .ci/beam_throughput_against_transformers.py [CHECKPOINT_DIR]

16 random 128-token prompts, W = 4, 128 new tokens each, no end-of-text on either side, one
thread, fp32 on the CPU; after a short warm-up call of each, the two run alternately, twice
each, every run timed whole. Prints
beam tokens/s (16 x W x 128 over the run's wall time). BENCHMARKS.md, section 17.
"""
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from nanoserve import LLM, BeamSearchParams  # noqa: E402

WIDTH, NEW_TOKENS, NUM_PROMPTS, PROMPT_LEN = 4, 128, 16, 128


def main(checkpoint: str) -> None:
    import transformers
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, PROMPT_LEN).tolist() for _ in range(NUM_PROMPTS)]
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf = hf.eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, as transformers has it
    hf.generation_config.pad_token_id = 0
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True)

    def ours():
        llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)

    def theirs():
        with torch.no_grad():
            hf.generate(torch.tensor(prompts), num_beams=WIDTH, num_return_sequences=WIDTH,
                        do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        length_penalty=1.0, early_stopping=False)

    warm_up = [{"prompt_token_ids": p} for p in prompts[:2]]
    llm.beam_search(warm_up, BeamSearchParams(beam_width=WIDTH, max_tokens=8, ignore_eos=True))
    with torch.no_grad():  # each side's first call pays one-time costs (allocations, dispatch)
        hf.generate(torch.tensor(prompts[:2]), num_beams=WIDTH, max_new_tokens=8)
    for name, run in (("nanoserve", ours), ("transformers", theirs)) * 2:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        tokens = NUM_PROMPTS * WIDTH * NEW_TOKENS
        print(f"{name}: {wall:.1f} s, {tokens / wall:.0f} beam tokens/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "checkpoints", "shakespeare"))
