"""What the engine does differently on CUDA, in one place: whether a device is a CUDA GPU, and
every call into the CUDA runtime the engine makes, one small function each.

The CPU suite replaces these functions (conftest's fake_cuda: a "GPU" whose tensors are the
CPU's, with a fixed memory, graphs replayed eagerly through the padded path, pinned copies as
plain ones, torch.compile's eager form), so every CUDA branch of the engine (the KV cache's
sizing, the draft's, graph capture's bookkeeping, pinned uploads) runs on every CI before a
GPU sees it. The bodies below are the lines a CPU never runs (.ci/cuda_lines.py lists every
CUDA line the suite leaves unrun; BENCHMARKS.md, why each)."""
import torch


def is_cuda(device) -> bool:
    """Whether `device` (a torch.device or its name: cuda, cuda:1) is a CUDA GPU."""
    if isinstance(device, str):  # most calls, several a step: no torch.device made (2 us)
        return device == "cuda" or device.startswith("cuda:")
    return torch.device(device).type == "cuda"


def pinned(host: torch.Tensor) -> torch.Tensor:
    """host copied to pinned (page-locked) memory, from torch's caching host allocator: the
    only host memory a copy to the GPU can be non-blocking from."""
    return host.pin_memory()


def pinned_empty(shape: tuple, *, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized pinned host tensor (the swap space's)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def synchronize(device) -> None:
    """Wait for everything queued on the device."""
    torch.cuda.synchronize(device)


def num_sms(device) -> int:
    """The device's streaming multiprocessors."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def compile_fused(fn):
    """fn compiled by torch.compile (model.fused_on_cuda says why these options)."""
    return torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})


def profile_memory(device, run) -> tuple[int, int, int]:
    """(free, total, peak) bytes: the device's free and total memory before run(), and the
    most that run() allocated at once beyond what was allocated before it."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return free, total, peak


def capture_graph(run, pool) -> tuple:
    """run() captured in a CUDA graph, after a warm-up outside it (Triton compiles and cuBLAS
    picks its kernels there, not in the capture): (the graph's replay, its memory pool, for
    the next capture to share; pool None: a new one)."""
    graph = torch.cuda.CUDAGraph()
    run()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph.replay, graph.pool()


def device_capability(device) -> tuple[int, int]:
    """The device's compute capability (major, minor): (8, 9) Ada, (9, 0) Hopper."""
    return torch.cuda.get_device_capability(device)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias in out_dtype, a (N, I) and b (I, O) float8_e4m3fn,
    scale_a (N, 1) and scale_b (1, O) fp32: FP8 tensor cores, fp32 sums (linear.py)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                            out_dtype=out_dtype)
