"""kernels.py's guarantees: paged attention (the CPU path and the Triton kernel, in Triton's
interpreter) equals the reference; the kernel as launched compiles for sm_80 and sm_90.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import kernels
import nanoserve
from conftest import DEVICE, HERE, CountSyncs
from kernels import (AttentionMetadata, paged_attention, paged_attention_cpu, paged_attention_ref,
                     store_kv)
from nanoserve import Engine, EngineConfig
from paged_cache import cdiv
from sampling import SamplingParams


# ----------------------------------------------------------------------------- Triton kernel

NUM_HEADS = 2


needs_cuda = pytest.mark.skipif(
    DEVICE != "cuda", reason="no CUDA GPU: the CPU runs Triton's interpreter, which says nothing "
    "of a GPU's launch, its waits or its numerics")


MAX_MODEL_LEN = 256  # the engine's block tables are cdiv(max_model_len, block_size) wide


# (context_len, q_len) per sequence; context_len counts this step's tokens, as in the engine.
BATCHES = {
    # decodes (one at position 0) mixed with a whole prompt of 2 query tiles and a prefill chunk
    # whose sequence already cached 70 tokens (2 key steps of TILE_KEYS = 64)
    "mixed": [(37, 1), (20, 20), (83, 13), (1, 1), (130, 1), (9, 9)],
    "decode_only": [(5, 1), (64, 1), (71, 1), (16, 1)],
}


def make_batch(seq_shapes, block_size, head_dim, dtype=torch.float32, seed=0, width=None,
               device=DEVICE, num_heads=NUM_HEADS, num_kv_heads=None):
    """Random q (N, num_heads, D), caches (NB, BS, num_kv_heads, D) (default: num_heads) and
    metadata as Engine._prepare_inputs builds them: shuffled blocks, 0-padding.

    Block tables are `width` columns wide (default: just wide enough for the longest sequence),
    padded with block 0, as the engine pads them to cdiv(max_model_len, block_size).
    """
    num_kv_heads = num_kv_heads or num_heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [cdiv(ctx, block_size) for ctx, _ in seq_shapes]
    width = width or max(num_blocks)
    total = sum(num_blocks) + 3  # a few blocks no sequence owns
    cache_shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    free = torch.randperm(total, generator=gen).tolist()  # non-contiguous, any order
    tables, slots, starts = [], [], [0]
    for (ctx, q_len), n in zip(seq_shapes, num_blocks):
        table, free = free[:n], free[n:]
        tables.append(table + [0] * (width - n))
        slots += [table[t // block_size] * block_size + t % block_size
                  for t in range(ctx - q_len, ctx)]
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor([ctx for ctx, _ in seq_shapes], dtype=torch.int32,
                                  device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(q for _, q in seq_shapes))
    # This step's K/V go in through store_kv, as in the model; q is a strided view, as there.
    qkv = torch.randn(starts[-1], num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("width", ["tight", "engine"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_kernel_matches_reference(block_size, head_dim, batch, width):
    width = cdiv(MAX_MODEL_LEN, block_size) if width == "engine" else None
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], block_size, head_dim, width=width)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # fp32 throughout; only the order of the sums differs from the reference.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# Grouped-query attention, (query heads, KV heads): G = 2, 4, 3 and 7 query heads a KV head.
# At G = 3 and 7 a 16-row tile ends inside a query's group of rows.
GROUPED_HEADS = [pytest.param(4, 2, id="G2"), pytest.param(8, 2, id="G4"),
                 pytest.param(6, 2, id="G3"), pytest.param(7, 1, id="G7")]


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("num_heads, num_kv_heads", GROUPED_HEADS)
def test_triton_kernel_matches_reference_with_grouped_query_heads(num_heads, num_kv_heads,
                                                                  head_dim, batch):
    """Each program serves the G query heads of one KV head, its (query, head) rows stacked
    query by query in a tile: a decode fills G rows, a chunk of L queries L * G."""
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], 16, head_dim, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads,
                                           width=cdiv(MAX_MODEL_LEN, 16))
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, scale),
                               atol=1e-5, rtol=1e-5)


def test_reference_attention_query_head_h_reads_kv_head_h_floordiv_g():
    """The specification's GQA mapping, head by head: of H = 6 query heads over Hkv = 2 KV
    heads (G = 3), head h attends KV head h // G alone (Hugging Face's repeat_kv: a KV head's
    query heads are contiguous). The other plausible mapping, h % Hkv, fails here."""
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 8, 16, device="cpu",
                                           num_heads=6, num_kv_heads=2)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    for head in range(6):
        kv = slice(head // 3, head // 3 + 1)
        alone = paged_attention_ref(q[:, head:head + 1], k_cache[:, :, kv], v_cache[:, :, kv],
                                    meta, 0.25)
        torch.testing.assert_close(out[:, head:head + 1], alone)


# More decodes than a DECODE_BATCH, of contexts that differ and tie, beside prefill chunks.
MANY_DECODES = [(5 + 23 * i % 97, 1) for i in range(19)] + [(40, 40), (70, 9)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [
    pytest.param(NUM_HEADS, NUM_HEADS, id="G1"), *GROUPED_HEADS])
@pytest.mark.parametrize("decode_bytes, num_batches", [(8 << 20, 3), (1, 19)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_cpu_attention_matches_reference_in_every_layer(block_size, decode_bytes, num_batches,
                                                        num_heads, num_kv_heads, monkeypatch):
    """paged_attention_cpu plans a step's decodes in its first layer and reuses the plan (and
    its buffers) in the others: each layer, its own caches, must still get the reference,
    whether the decodes go DECODE_BATCH together or one by one (K/V past DECODE_BYTES). With
    GQA the K/V it gathers are the cache's Hkv heads, never copied per query head."""
    monkeypatch.setattr("kernels.DECODE_BYTES", decode_bytes)
    q, k_cache, v_cache, meta = make_batch(MANY_DECODES, block_size, 32, device="cpu",
                                           num_heads=num_heads, num_kv_heads=num_kv_heads)
    layers = [(q, k_cache, v_cache), (q.flip(0), v_cache.flip(0), k_cache * 2)]
    for q, k_cache, v_cache in layers:
        out = paged_attention_cpu(q, k_cache, v_cache, meta, 0.2)
        # fp32; the order of the sums differs (G query rows a GEMM): up to 2e-6 seen
        torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.2),
                                   atol=1e-5, rtol=1e-5)
    assert len(meta.step_plan.batches) == num_batches
    assert all(b.shape[1:] == k_cache.shape[1:] for b in meta.step_plan.buffers)


# Tolerances: a few roundings of the type (p cast for the P @ V dot, the output), |out| < 4.
LOW_PRECISION = [pytest.param(torch.float16, 4e-3, id="fp16"),
                 pytest.param(torch.bfloat16, 3e-2, id="bf16")]


@pytest.mark.parametrize("dtype, tol", LOW_PRECISION)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_dim", [48, 64])
@pytest.mark.parametrize("num_heads, num_kv_heads", [
    pytest.param(NUM_HEADS, NUM_HEADS, id="G1"), pytest.param(8, 2, id="G4"),
    pytest.param(7, 1, id="G7")])
def test_triton_kernel_low_precision_matches_fp32_reference(num_heads, num_kv_heads, head_dim,
                                                            batch, dtype, tol):
    """fp16 and bf16 inputs, accumulated in fp32, against the fp32 reference (on CPU in the
    interpreter, on a GPU as launched), with one head a KV head and with grouped heads."""
    q, k_cache, v_cache, meta = make_batch(BATCHES[batch], 16, head_dim, dtype,
                                           width=cdiv(MAX_MODEL_LEN, 16), num_heads=num_heads,
                                           num_kv_heads=num_kv_heads)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    # The reference sees the same rounded inputs, in fp32.
    expected = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_cuda
def test_triton_launch_never_waits_for_the_gpu():
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 64, torch.bfloat16)
    paged_attention(q, k_cache, v_cache, meta, 0.125)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync now raises
    try:
        paged_attention(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_a_cuda_step_waits_for_the_device_only_to_read_its_results(monkeypatch):
    """Whole engine steps (a prompt chunk beside decodes; greedy, seeded and unseeded samples,
    top-k and top-p; log-probabilities) under set_sync_debug_mode("error"): any wait for the
    GPU raises, except in nanoserve.to_host, where the step reads its tokens on purpose. A
    step that fails fails its requests (finish_reason "error"), so none may."""
    engine = Engine(EngineConfig(preset="tiny", device="cuda", dtype="bfloat16",
                                 max_num_batched_tokens=32))
    kinds = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=20, logprobs=2),
             SamplingParams(top_p=0.9, prompt_logprobs=1)]

    def add_requests(prompt_len: int) -> None:
        for params in kinds:
            engine.add_request(list(range(1, prompt_len + 1)),
                               dataclasses.replace(params, max_tokens=8, ignore_eos=True))
    add_requests(4)
    outputs = engine.step() + engine.step()  # compiled and warmed: the next steps are steady
    add_requests(40)  # chunked over the next steps, beside the first three's decodes
    to_host = nanoserve.to_host
    reads = []

    def read_on_purpose(tensor: torch.Tensor) -> list:
        reads.append(tuple(tensor.shape))
        torch.cuda.set_sync_debug_mode("default")
        try:
            return to_host(tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    monkeypatch.setattr(nanoserve, "to_host", read_on_purpose)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            outputs += engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reads  # the steps read their tokens
    assert not [o for o in outputs if o.finished and o.outputs[0].finish_reason == "error"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_triton_kernel_runs_on_its_tensors_device():
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 64, torch.float16,
                                           device="cuda:1")
    with torch.cuda.device(0):  # the current device is not the tensors' one
        out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.125),
                               atol=4e-3, rtol=4e-3)


def test_triton_launcher_refuses_metadata_it_would_misread():
    """The kernel reads context_lens and query_start_loc as dense int32 arrays: a strided
    view would be read wrong, silently, so the launcher refuses it."""
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 32)
    lens = meta.context_lens
    meta.context_lens = torch.stack([lens, lens], dim=1)[:, 0]  # the same values, strided
    assert torch.equal(meta.context_lens, lens) and not meta.context_lens.is_contiguous()
    with pytest.raises(AssertionError, match="dense"):
        paged_attention(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu, paged_attention])
def test_attention_refuses_query_heads_the_kv_heads_do_not_divide(attention):
    """3 query heads over 2 KV heads have no head-to-KV-head mapping: refused, by count, before
    any K/V is read (the kernel would read the wrong KV heads)."""
    q, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 32, num_heads=4,
                                           num_kv_heads=2)
    with pytest.raises(ValueError, match="3 heads, not a multiple of the cache's 2 KV heads"):
        attention(q[:, :3], k_cache, v_cache, meta, 0.125)


COMPILE_CAPABILITIES = (80, 90)  # sm_80 (A100), sm_90 (H100)


# (dtype, head dim, query heads, KV heads). 128: Llama's and Qwen's head dim. Grouped (GQA):
# 14/2 (G = 7, not a power of 2) at 64 is Qwen2.5-0.5B, 32/8 at 64 Llama-3.2-1B, 16/8 at 128
# Qwen3-0.6B, 32/8 at 128 Llama-3.1-8B.
COMPILE_VARIANTS = [("float16", 64, 12, 12), ("float16", 48, 12, 12), ("bfloat16", 64, 12, 12),
                    ("float32", 64, 12, 12), ("float16", 128, 12, 12), ("bfloat16", 128, 12, 12),
                    ("float16", 64, 14, 2), ("bfloat16", 64, 32, 8),
                    ("float16", 128, 16, 8), ("bfloat16", 128, 16, 8), ("bfloat16", 128, 32, 8)]


# Batches unlike each other: one decode; 64 decodes and a 200-token chunk; two chunks.
VARIED_BATCHES = [((1, 1),), ((900, 1),) * 64 + ((200, 200),), ((16, 16), (1000, 512))]


class CompileOnlyDriver:
    """All that JITFunction.run asks of the driver before it compiles; there is no GPU to ask."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch  # one kernel cache per target

    def get_current_stream(self, device):
        return 0


def engine_args(dtype, head_dim, seq_shapes=((100, 1), (7, 1), (300, 1), (37, 37)),
                num_heads=12, num_kv_heads=None, block_size=16, width=64, num_blocks=512):
    """paged_attention's arguments as the engine passes them for sequences of
    (context_len, q_len), by default 3 decodes and a 37-token prefill chunk: q a view of the
    fused qkv projection, contiguous caches of num_kv_heads heads (default: num_heads, GPT-2's),
    int32 metadata, block tables cdiv(1024, 16) wide."""
    num_kv_heads = num_kv_heads or num_heads
    num_tokens = sum(q_len for _, q_len in seq_shapes)
    qkv = torch.zeros(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # rows qkv-strided
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    starts = [0]
    for _, q_len in seq_shapes:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.zeros(len(seq_shapes), width, dtype=torch.int32),
        context_lens=torch.tensor([ctx for ctx, _ in seq_shapes], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_len for _, q_len in seq_shapes))
    return q, k_cache, torch.zeros_like(k_cache), meta, head_dim ** -0.5


def launch_specialization(args) -> str:
    """paged_attention(*args) as on a GPU: JITFunction.run binds the arguments and hands its
    specialization to jit_cache_hook, whose True skips the compile and the launch. The launch
    must not read a tensor's value (on a GPU, a wait for the device)."""
    import triton  # here, not at the top: kernels.py chooses the interpreter before importing it
    seen = []

    def hook(*, compile, **_):
        seen.append(compile["specialization_data"])
        return True

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        with CountSyncs() as counter:
            paged_attention(*args)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert counter.syncs == [], counter.syncs
    assert len(seen) == 1, seen
    return seen[0]


def ptxas_counts(ptx: str, cc: int) -> tuple[int, int]:
    """Registers and spills as ptxas reports them; Triton only learns them when loading on a
    GPU."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        command = [get_ptxas(cc).path, "-v", "--regAllocOptLevel=2",  # flags as Triton's
                   f"--gpu-name={sm_arch_from_capability(cc)}", f.name, "-o", os.devnull]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(regs) == len(spills) == 1, log  # one kernel, one report
    return int(regs[0]), int(spills[0][0]) + int(spills[0][1])


def compile_as_launched(cc: int, dtype: str, head_dim: int, num_heads: int,
                        num_kv_heads: int) -> dict:
    """Compile the kernel exactly as paged_attention would launch it on compute capability cc,
    for q of num_heads heads over caches of num_kv_heads, and report what the compile gave:
    the specialization (which parameters are bound to 1, which pointers are 16-byte aligned),
    ptxas's registers and spills, shared memory, and whether K/V are loaded by cp.async with
    copies still in flight."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    fn = kernels._paged_attention_kernel
    data = launch_specialization(engine_args(getattr(torch, dtype), head_dim,
                                             num_heads=num_heads, num_kv_heads=num_kv_heads))
    compiled = fn.preload(data)  # Triton compiles exactly that specialization
    spec = json.loads(data)
    ptx = compiled.asm["ptx"]
    names = [p.name for p in fn.params]
    ones = [names[i] for (i,), v in zip(spec["constant_keys"], spec["constant_vals"])
            if v == 1 and not fn.params[i].is_constexpr]
    aligned = [names[i] for (i,), v in zip(spec["attrs_keys"], spec["attrs_vals"])
               if ["tt.divisibility", 16] in v]
    regs, spills = ptxas_counts(ptx, cc)
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return dict(cc=cc, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                num_kv_heads=num_kv_heads, regs=regs, spills=spills,
                smem=compiled.metadata.shared, cp_async="cp.async.cg.shared.global" in ptx,
                copies_in_flight=max(waits, default=0), ones=ones, aligned=aligned,
                target=f".target {sm_arch_from_capability(cc)}" in ptx,
                cubin=len(compiled.asm["cubin"]), stages=compiled.metadata.num_stages)


def print_compiled_variants() -> None:
    """Compile every variant for every capability; print one JSON line each, or "SKIP: why"
    when this Triton lacks an internal used here (triton is unpinned). Run it in a process of
    its own with TRITON_INTERPRET=0: the interpreter patches triton.language, and then
    triton.compile cannot run."""
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401 (ptxas_counts's)
        from triton.runtime.driver import driver
        assert hasattr(triton.knobs.runtime, "jit_cache_hook")
        assert hasattr(kernels._paged_attention_kernel, "preload")
    except (ImportError, AssertionError) as e:
        print(f"SKIP: Triton {triton.__version__} lacks an internal this test uses: {e!r}")
        return
    assert not triton.knobs.runtime.interpret
    # First, before anything is compiled (a compiled one would be launched, on no GPU): the
    # specialisations that varied batches ask for, with GPT-2's heads and grouped ones.
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", COMPILE_CAPABILITIES[0], 32)))
    keys = [{launch_specialization(engine_args(torch.float16, 64, shapes, *heads))
             for shapes in VARIED_BATCHES} for heads in [(12, 12), (14, 2)]]
    for cc in COMPILE_CAPABILITIES:
        driver.set_active(CompileOnlyDriver(GPUTarget("cuda", cc, 32)))
        for variant in COMPILE_VARIANTS:  # head dim 48 (padded to 64) once, in fp16
            print(json.dumps(compile_as_launched(cc, *variant)))
    print(json.dumps(dict(specializations=[len(k) for k in keys])))


def test_triton_kernel_as_launched_compiles_for_sm80_and_sm90_without_spills():
    """The kernel paged_attention would launch on sm_80 and sm_90, compiled without a GPU,
    with as many KV heads as query heads (GPT-2) and grouped (GQA).

    Triton's own JITFunction.run specialises the engine's real arguments (built on CPU); the
    compile of that specialisation must fit: ptxas's registers and spills, shared memory, and
    K/V loaded by cp.async, with the next tile's copies in flight during this tile's math.
    """
    env = dict(os.environ, TRITON_INTERPRET="0")  # kernels.py keeps an explicit 0
    run_it = "import test_kernels; test_kernels.print_compiled_variants()"
    result = subprocess.run([sys.executable, "-c", run_it], env=env, capture_output=True,
                            text=True, timeout=600, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("SKIP: "):
        pytest.skip(result.stdout[6:].strip())
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # Varied batches (sizes, decodes and chunks) launch one specialisation a model: one compile.
    assert rows.pop() == dict(specializations=[1, 1])
    assert [(r["cc"], r["dtype"], r["head_dim"], r["num_heads"], r["num_kv_heads"])
            for r in rows] == [(cc, *variant) for cc in COMPILE_CAPABILITIES
                               for variant in COMPILE_VARIANTS]
    for r in rows:
        assert r["target"] and r["cubin"] > 0, r
        # The launch binds unit strides as constants and every pointer as 16-byte aligned.
        assert set(r["ones"]) == {"stride_qd", "stride_kd", "stride_vd", "stride_od"}, r
        assert {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "block_tables_ptr",
                "context_lens_ptr", "query_start_loc_ptr"} <= set(r["aligned"]), r
        if r["dtype"] == "float32":  # fp32 (not the GPU default) only has to compile
            continue
        assert r["spills"] == 0 and r["cp_async"] and r["copies_in_flight"] > 0, r
        if r["head_dim"] <= 64:  # GPT-2's: room for 3 programs an SM (4 warps, 64 KB each)
            assert r["regs"] <= 128 and r["smem"] < 64 * 1024, r
        else:  # 128: it must launch at all (sm_80 lets a program have 163 KB); not tuned yet
            assert r["smem"] < 163 * 1024, r
    # A grouped program's K/V tiles serve its G heads: the shared memory of one head's.
    smem = {(r["cc"], r["dtype"], r["head_dim"]): r["smem"] for r in rows
            if r["num_heads"] == r["num_kv_heads"]}
    for r in rows:
        assert r["smem"] == smem[r["cc"], r["dtype"], r["head_dim"]], r
