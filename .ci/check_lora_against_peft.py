"""Check nanoserve's LoRA against Hugging Face's peft, where transformers and peft are installed
(not a CI dependency; the tests check adapters against merged weights instead):

    python .ci/check_lora_against_peft.py CHECKPOINT_DIR [ADAPTER_DIR]

With no adapter directory, a random one (lora.save_random_lora, B nonzero) is written for the
checkpoint's family. Prints the largest log-probability difference over a prompt's positions
and whether 32 greedy tokens agree; exits 1 if they do not (fp32 on the CPU throughout).
Run 2026-12-02 (transformers 5.24.0, peft 0.21.2 in a separate virtual environment), random
rank-8 adapters on every target: SmolLM2-135M-Instruct (Llama targets) largest difference
1.0e-05, the shipped GPT-2 (c_attn, c_proj, c_fc: Conv1D, fan_in_fan_out) 8.6e-06; greedy
tokens agree on both (BENCHMARKS.md, section 15).
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lora import GPT2_TARGETS, LLAMA_TARGETS, LoRARequest, save_random_lora  # noqa: E402
from nanoserve import LLM  # noqa: E402
from sampling import SamplingParams  # noqa: E402

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


def main(checkpoint: str, adapter: str | None) -> int:
    import peft
    import transformers
    llm = LLM(checkpoint, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=64)
    model = llm.engine.model
    if adapter is None:
        adapter = tempfile.mkdtemp()
        is_gpt2 = model.config.position_encoding == "learned"
        save_random_lora(adapter, model, list(GPT2_TARGETS if is_gpt2 else LLAMA_TARGETS), r=8,
                         base_model_name_or_path=checkpoint)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
    ours = llm.generate(PROMPT, params, lora_request=LoRARequest("a", 1, adapter))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = torch.tensor([ours.prompt_token_ids])
    with torch.no_grad():
        logprobs = hf(ids).logits[0, :-1].log_softmax(-1)
        greedy = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    theirs = logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()
    mine = [next(iter(entry.values())) for entry in ours.prompt_logprobs[1:]]
    worst = max(abs(a - b) for a, b in zip(mine, theirs))
    same = greedy == ours.outputs[0].token_ids
    print(f"largest prompt log-probability difference {worst:.2e}; greedy tokens agree: {same}")
    return 0 if same and worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
