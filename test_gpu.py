"""What only a CUDA GPU can check, skipped without one: the Triton kernel against the reference
at real models' head shapes over 8k-token contexts, decodes replayed from CUDA graphs against
eager ones, and a grouped-query Llama checkpoint served in bf16 against transformers'.
.ci/gpu runs these on a lent GPU: part 2 all but the transformers tests, part 3 those.
"""
import gc

import pytest
import torch

import kernels
from conftest import fixture_llm
from kernels import paged_attention, paged_attention_ref
from nanoserve import LLM
from paged_cache import cdiv
from sampling import SamplingParams
from test_kernels import LOW_PRECISION, make_batch, nan_empty  # noqa: F401 (a fixture)
from test_model import BF16_TOL, bf16_reference, over_tolerance

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU: these check a GPU's own launches, "
    "graphs and numerics (.ci/gpu runs them on a lent one)")


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """Each test's engines are gone before the next starts: an engine's KV cache and its
    graphs' memory pool would otherwise stay with torch's allocator."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the kernel

# (query heads, K/V heads, head dim) of real models: G = 7 (padded to tl.dot's 16) and G = 4
HEAD_SHAPES = [pytest.param(14, 2, 64, id="qwen2.5-0.5b"),
               pytest.param(32, 8, 64, id="llama-3.2-1b"),
               pytest.param(32, 8, 128, id="llama-3-8b")]
# (context_len, q_len) a sequence, decodes first as the engine orders them: decodes over long
# cached contexts (8k, one short of it, 4k and one past a block, a single token), then a
# 256-token chunk after a 7,936-token prefix hit (the prompt's cached blocks), and a whole
# 300-token prompt.
LONG_CONTEXTS = [(8192, 1), (8191, 1), (4113, 1), (1, 1), (8192, 256), (300, 300)]
LONG_DECODES = 4
MAX_MODEL_LEN = 32768  # the block tables' width: a Qwen2.5 server's, and so its splits


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("dtype, tol", LOW_PRECISION)
@pytest.mark.parametrize("num_decodes", [LONG_DECODES, 0], ids=["decodes-apart", "one-kernel"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_SHAPES)
def test_triton_kernel_matches_reference_at_real_head_shapes_over_8k_contexts(
        num_heads, num_kv_heads, head_dim, num_decodes, dtype, tol):
    """fp16 and bf16 at Qwen2.5-0.5B's, Llama 3.2 1B's and Llama 3 8B's heads, as launched on
    this GPU: with num_decodes set, the decodes go to the decode kernel, each 8k context split
    over programs (on this GPU's SMs) and reduced, beside the prefill kernel's chunks; with
    none, every sequence to the prefill kernel (the kernel before the split). Every output
    written (torch.empty gives NaN here), each within a few roundings of the fp32 reference."""
    q, k_cache, v_cache, meta = make_batch(LONG_CONTEXTS, 16, head_dim, dtype,
                                           width=cdiv(MAX_MODEL_LEN, 16), num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, num_decodes=num_decodes)
    num_sms = kernels.device_num_sms(q.device)
    grids = kernels.launch_grids(meta, num_kv_heads, num_heads // num_kv_heads, 16, num_sms)
    if num_decodes and num_sms >= 2 * num_decodes * num_kv_heads:  # SMs for 2 splits each
        assert grids.reduce is not None, grids
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- CUDA graphs

GRAPH_TOL = 0.05  # |graphed - eager| log-probability: bf16's rounding, a few times over (the
                  # same requests in fp32 and in bf16 on a CPU differ by 0.0064 at most)


def count_replays(engine) -> list:
    """A list that each replay of the engine's decode graphs appends to from now on."""
    replays = []

    def counted(replay, size: int):
        def run() -> None:
            replays.append(size)
            replay()
        return run
    graphs = engine.model_runner.graphs
    for size, replay in graphs.items():
        graphs[size] = counted(replay, size)
    return replays


def test_decode_replayed_from_cuda_graphs_gives_eager_decodes_log_probabilities():
    """llama-tiny (8 query heads over 2 K/V heads) in bf16, greedy, the same requests on an
    engine that replays its decodes from CUDA graphs (the default) and on one that runs them
    eagerly (enforce_eager): every decode step replays a graph (5 sequences pad to the graph
    of 8, then 4, 2, 1 as they end). Each token's log-probability is the eager one's within
    bf16's rounding, wherever the tokens so far agree: cuBLAS picks its kernels by the batch's
    size, and a padded batch is another size, so a near-tie may go the other way; from there
    the two run different contexts, compared no further."""
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)]
               for i, n in enumerate((5, 17, 33, 64, 100))]
    lengths = [24, 9, 16, 3, 20]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
              for n in lengths]
    runs = {}
    for eager in (False, True):
        llm = LLM(preset="llama-tiny", device="cuda", dtype="bfloat16", kv_cache_tokens=4096,
                  max_num_seqs=8, enforce_eager=eager)  # graphs of 1, 2, 4 and 8 alone
        replays = count_replays(llm.engine)
        runs[eager] = [o.outputs[0] for o in llm.generate(prompts, params)], replays
        del llm
    (graphed, replays), (eager, no_replays) = runs[False], runs[True]
    assert no_replays == [] and len(replays) == max(lengths) - 1  # a decode step, a replay
    assert set(replays) == {8, 4, 2, 1}
    errors = []
    compared = 0  # decode tokens compared (a request's first token is its prompt's, eager)
    for ours, theirs in zip(graphed, eager):
        for i, (token, other) in enumerate(zip(ours.token_ids, theirs.token_ids)):
            if token != other:
                break
            errors.append(abs(ours.logprobs[i][token] - theirs.logprobs[i][token]))
            compared += i > 0
    assert compared >= sum(n - 1 for n in lengths) / 2, "the tokens parted too early to compare"
    assert max(errors) < GRAPH_TOL


# ----------------------------------------------------------------------------- transformers

BF16_MEAN_TOL = 0.1  # the mean |log-probability - transformers'|: bf16 moves single positions
                     # by tenths, never all of them


def prompt_logprobs(llm: LLM, ids: list[int], top: int) -> list[dict]:
    """The engine's log-probabilities of each prompt token after those before it (its top
    `top` beside it), then of its one greedy token after the prompt: position p's next."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=top, prompt_logprobs=top)
    out = llm.generate([ids], params)[0]
    return out.prompt_logprobs[1:] + out.outputs[0].logprobs


def test_bf16_engine_on_cuda_gives_the_stored_transformers_bf16_log_probabilities(tmp_path):
    """test_model's CPU check, on CUDA: the llama31-bf16 fixture (4 query heads over 2 K/V
    heads, Llama 3.1's RoPE) served in bf16, its 2,048-token prompt prefilled in chunks of 512
    (each chunk's queries over the chunks cached before it, through the Triton kernel): at
    every recorded position, its top 20 log-probabilities are transformers' stored bf16 ones
    (computed on a CPU: no transformers needed here)."""
    ref = bf16_reference()
    llm = fixture_llm("llama31-bf16", tmp_path, device="cuda", dtype="bfloat16",
                      kv_cache_tokens=2304, max_num_batched_tokens=512, max_num_seqs=1,
                      enforce_eager=True)
    by_position = prompt_logprobs(llm, ref["input_ids"][0].tolist(), 20)
    want = ref["logits"].log_softmax(dim=-1)
    errors = [max(abs(logprob - want[i, token].item()) for token, logprob in top.items())
              for i, top in enumerate(by_position[p] for p in ref["positions"].tolist())]
    over = over_tolerance(ref["positions"], errors)
    assert not over, f"max |log-probability error| >= {BF16_TOL} at positions {over}"


def transformers_prompt_logprobs(transformers, path, ids: list[int], device: str
                                  ) -> torch.Tensor:
    """transformers' bf16 log-probability (T - 1,) of each of ids after those before it, its
    model loaded from `path` in bf16 (from_pretrained's dtype: RoPE's inv_freq stays fp32, as
    .to(torch.bfloat16) would not keep it) with sdpa attention, on `device`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    tokens = torch.tensor([ids], device=device)
    with torch.inference_mode():
        logits = model(tokens).logits[0, :-1].float()  # (T - 1, vocab): position p's next
    return logits.log_softmax(dim=-1).gather(1, tokens[0, 1:, None])[:, 0].cpu()


def test_bf16_engine_on_cuda_gives_transformers_bf16_log_probabilities_live(tmp_path):
    """The llama31-bf16 fixture served on CUDA in bf16 (chunks of 512 over the paged cache)
    against transformers' own bf16 forward on the same GPU (sdpa attention), every one of the
    2,047 prompt tokens after the first compared by its log-probability (prompt_logprobs):
    none off by BF16_TOL, and the mean well under it (a systematic error, a wrong RoPE or
    grouped-head mapping, moves every position)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (the lent GPU machine has it)")
    ids = bf16_reference()["input_ids"][0].tolist()
    llm = fixture_llm("llama31-bf16", tmp_path, device="cuda", dtype="bfloat16",
                      kv_cache_tokens=2304, max_num_batched_tokens=512, max_num_seqs=1,
                      enforce_eager=True)
    by_position = prompt_logprobs(llm, ids, 1)
    ours = torch.tensor([top[token] for top, token in zip(by_position, ids[1:])])
    del llm
    errors = (ours - transformers_prompt_logprobs(transformers, tmp_path, ids, "cuda")).abs()
    worst = errors.argmax().item()
    assert errors.max() < BF16_TOL, f"|log-probability error| {errors.max():.3f} at {worst + 1}"
    assert errors.mean() < BF16_MEAN_TOL, f"mean |log-probability error| {errors.mean():.4f}"
