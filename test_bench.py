"""bench.py's guarantees: its modes run, its figures agree, and --url measures a server.
"""
import contextlib
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

import bench
import model as M
from conftest import GREEDY, HERE, CountSyncs, start_server, tiny
from nanoserve import LLM
from sampling import sample, sampling_tensors


# ----------------------------------------------------------------------------- bench.py

TINY = ("--num-requests 8 --prompt-len 16 --limits 8 16 --online-requests 6 --online-limit 12 "
        "--mean-output-len 6 --rates 40 inf --max-num-seqs 4 --max-num-batched-tokens 24 "
        "--kv-cache-tokens 64 --host-output-lens 4 40 --kv-budget 80").split()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, str]:
    out, threads = tmp_path_factory.mktemp("bench") / "bench.json", torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            bench.main(TINY + ["--hardware-preset", "tiny", "--out", str(out)])  # sets threads
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text()), printed.getvalue()


def check_recompute(computed: int, needed: int, preemptions: int, most_per_preemption: int):
    """Tokens computed = tokens needed + what each preemption threw away: at least one token
    (a running sequence has computed some) and at most the most a sequence can hold."""
    assert needed + preemptions <= computed <= needed + preemptions * most_per_preemption
    assert (preemptions == 0) == (computed == needed)


def test_bench_offline_and_online_figures_agree(bench_run):
    result, printed = bench_run
    cfg = result["config"]
    P = 16
    assert cfg["max_num_batched_tokens"] == 24 and cfg["host_output_lens"] == [4, 40]
    assert list(result["offline"]) == ["8", "16"] and cfg["modes"] == list(bench.MODES)[:-1]
    for limit, runs in result["offline"].items():
        lengths = runs["lengths"]
        assert len(lengths) == 8 and all(1 <= n <= int(limit) for n in lengths)
        assert list(runs["modes"]) == cfg["modes"]
        needed = sum(P + n - 1 for n in lengths)  # each prompt, and each output fed back
        for mode, r in runs["modes"].items():
            assert r["output_tokens"] == sum(lengths), (limit, mode)
            assert r["same_tokens"] == 1.0, (limit, mode)  # greedy: no mode changes a token
            assert 0 < r["kv_real_share"] <= 1 and 0 < r["seqs_per_step"] <= 4
            assert r["steps"] >= max(lengths)  # one token per request per step at most
            if mode == "naive":  # its step log is its own arithmetic: nothing to check there
                continue
            assert r["kv_slots_peak"] <= 64  # the cache's size
            check_recompute(r["tokens_computed"], needed, r["preemptions"], P + int(limit) - 2)
            if mode != "no-chunk":
                assert r["tokens_per_step"] <= 24
    assert list(result["online"]) == ["40.0", "inf"]
    for runs in result["online"].values():
        assert list(runs) == [m for m in cfg["modes"] if m != "naive"]
        for r in runs.values():
            assert r["requests"] == 6 and r["output_tokens"] == sum(result["online_lengths"])
            assert r["ttft"]["mean"] <= r["e2e"]["mean"]  # the first token, then the last
    for title in ("Offline", "Online", "Decode step, tiny, 1 threads"):
        assert title in printed


def test_bench_grouped_query_runs_more_sequences_in_the_same_kv_memory(bench_run):
    """llama-tiny's 2 K/V heads for 8 make a token's K/V a quarter of llama-tiny-mha's: in the
    memory of 80 tokens of the latter, 320 of the former, and more sequences a step."""
    result, printed = bench_run
    assert list(result["grouped_query"]) == ["8", "16"]
    for limit, runs in result["grouped_query"].items():
        mha, gqa = runs["llama-tiny-mha"], runs["llama-tiny"]
        assert (mha["kv_heads"], mha["kv_tokens"]) == (8, 80)
        assert (gqa["kv_heads"], gqa["kv_tokens"]) == (2, 320)
        assert gqa["output_tokens"] == mha["output_tokens"]  # the same requests, EOS ignored
        assert mha["kv_slots_peak"] <= 80 and gqa["kv_slots_peak"] <= 320
        assert gqa["seqs_peak"] > mha["seqs_peak"] and gqa["seqs_per_step"] > mha["seqs_per_step"]
        assert gqa["vs_mha"] == gqa["tok_s"] / mha["tok_s"]
    assert "Grouped-query attention at equal KV memory" in printed


def test_bench_naive_dense_baseline_equals_the_engine_on_a_grouped_query_model():
    """On llama-tiny the naive baseline (a dense cache, left-padded batches, RoPE from each
    row's shifted positions, grouped heads through SDPA) gives the paged engine's tokens."""
    status, result, _, _ = run_bench(TINY + ["--preset", "llama-tiny", "--modes", "naive", "fcfs",
                                             "--no-grouped-query", "--rates", "inf"])
    assert status == 0
    for experiment in ("offline", "equal_memory"):
        for runs in result[experiment].values():
            assert runs["modes"]["fcfs"]["same_tokens"] == 1.0  # fcfs against naive, token by token


def test_bench_equal_memory_holds_every_mode_to_the_kv_budget(bench_run):
    """80 tokens of KV each: naive and static reserve prompt + limit a sequence (80 // 24 = 3 at
    limit 8, 80 // 32 = 2 at 16); the paged modes hold what fits, preempting if they must."""
    result, _ = bench_run
    P = 16
    budget = result["config"]["kv_budget"]
    assert budget == 80 and list(result["equal_memory"]) == ["8", "16"]
    for limit, runs in result["equal_memory"].items():
        assert runs["lengths"] == result["offline"][limit]["lengths"]  # the same requests
        contiguous = min(8, budget // (P + int(limit)))
        for mode, r in runs["modes"].items():
            assert r["kv_slots_peak"] <= budget, (limit, mode)
            assert r["same_tokens"] == 1.0, (limit, mode)  # greedy: no mode changes a token
            assert r["output_tokens"] == sum(runs["lengths"]), (limit, mode)
            if mode in ("naive", "static"):
                assert r["max_num_seqs"] == contiguous and r["seqs_peak"] <= contiguous
            else:
                assert r["max_num_seqs"] == 256
        assert runs["modes"]["naive"]["seqs_peak"] == contiguous  # every row, every step
    assert bench.parse_args(["--prompt-len", "100"]).kv_budget == 32 * (100 + 128)
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        bench.parse_args(["--kv-budget", "600"])  # 128 + 512 tokens do not fit
    assert "--kv-budget 600 holds no sequence" in err.getvalue()


def test_bench_shared_prefix_compares_the_prefix_cache_on_and_off(tmp_path):
    """Every prompt behind one 32-token prefix, two turns a conversation: the same tokens with
    the cache on (fcfs) and off (no-cache); only fcfs finds the prefix, and so computes fewer
    tokens for the same outputs."""
    out, threads = tmp_path / "bench.json", torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            bench.main(TINY + ["--shared-prefix-len", "32", "--modes", "fcfs", "no-cache",
                               "--limits", "8", "--turns", "2", "--kv-cache-tokens", "256",
                               "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    fcfs, off = (result["offline"]["8"]["modes"][m] for m in ("fcfs", "no-cache"))
    assert fcfs["same_tokens"] == off["same_tokens"] == 1.0
    assert fcfs["output_tokens"] == 2 * sum(result["offline"]["8"]["lengths"])  # both turns
    assert fcfs["prefix_hit_rate"] > 0
    assert off["prefix_hit_rate"] == 0
    assert fcfs["tokens_computed"] < off["tokens_computed"]  # the prefix's K/V, reused


def test_bench_hardware_view_figures_agree(bench_run):
    """Both views' decode rows: the forward (timed by hooks) and the host part inside the step,
    the roofline from the rates the table quotes; the batches, lengths, bytes and FLOPs the
    configuration implies; the host-cost rows at one context."""
    result, _ = bench_run
    hw = result["hardware"]
    big = result["hardware_big"]
    host = hw["host_cost"]
    for view in (hw, big):
        copy_rate = view["copy_gb_s"] * 1e9         # bytes/s
        matmul_rate = view["matmul_gflops"] * 1e9   # FLOP/s
        for d in view["decode"] + view["host_cost"]:
            # timed in separate rounds (no wait for the device inside a timed step), so the
            # split is a difference of medians: measured, not bounded here
            assert all(math.isfinite(d[k]) for k in ("paged_step_ms", "forward_ms", "host_ms"))
            # the bytes a step reads: the weights, and every sequence's K/V in every layer
            tiny_kv_bytes = 2 * 4 * M.GPTConfig().n_layer * M.GPTConfig().n_embd  # fp32, MHA
            assert d["kv_read_bytes"] == d["batch"] * d["context"] * tiny_kv_bytes
            bytes_read = d["weight_bytes"] + d["kv_read_bytes"]
            roofline = max(bytes_read / copy_rate, d["flops"] / matmul_rate) * 1e3
            assert d["roofline_ms"] == pytest.approx(roofline)
    assert [d["batch"] for d in hw["decode"]] == [1, 2, 4]  # the sequences the engine held
    assert [d["batch"] for d in big["decode"]] == [1, 8, 32, 64] and big["preset"] == "tiny"
    # 3 rounds of 2 x 16 steps (whole, then with the forward timed) from output 1
    assert all(d["output_len"] == 1 + 95 / 2 for d in hw["decode"])
    # FLOPs grow with the batch; the weights read do not (3.5M parameters less wpe, fp32)
    config = M.GPTConfig()
    params = sum(p.numel() for p in M.GPT(config).parameters())
    weights = params - config.n_positions * config.n_embd
    for d in hw["decode"] + big["decode"]:
        assert d["weight_bytes"] == 4 * weights
    one = big["decode"][0]
    many = big["decode"][-1]
    assert many["flops"] > 64 * 2 * weights > one["flops"]
    # Host cost rows: batch 4, the same context (40 + 16) for output lengths 4 and 40: the
    # engine stepped until every sequence had max(1, n - 20) output tokens, then 40 steps timed
    assert [(d["batch"], d["prompt_len"], d["output_len"]) for d in host] == [
        (4, 52, 1 + 39 / 2), (4, 16, 20 + 39 / 2)]
    sampling = hw["sampling"]
    assert set(sampling) == {"rows", "vocab", "tokens_per_row", "sample_ms",
                             "sample_with_penalties_ms"}
    assert (sampling["rows"], sampling["vocab"], sampling["tokens_per_row"]) == (64, 257, 16)


def test_bench_naive_baseline_pads_and_matches_the_engine():
    llm = LLM(preset="tiny", device="cpu", dtype="float32")
    prompts = [[5, 6, 7], list(range(40, 60)), [9] * 11]  # left-padded to 20 in one batch
    lengths = [7, 3, 12]
    outputs = llm.generate(prompts, [bench.greedy(n) for n in lengths])
    want = [o.outputs[0].token_ids for o in outputs]
    log = []
    assert bench.naive_batch(llm.engine.model, prompts, lengths, log) == want
    assert len(log) == max(lengths)  # every row runs until the longest finishes


def test_bench_refuses_a_limit_past_the_models_context(capsys):
    """gpt2's context is 1024 tokens: a 512-token prompt with a limit of 1536 would read the
    position table past its end (on CUDA, an assert that poisons the process), so bench.py
    refuses it before running anything."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "gpt2", "--prompt-len", "512", "--limits", "32", "1536"])
    assert "make 2048 tokens; the gpt2 preset's context is 1024" in capsys.readouterr().err
    bench.parse_args(["--preset", "gpt2", "--prompt-len", "512", "--limits", "32", "512"])


def test_bench_naive_baseline_reads_the_padding_once():
    """Whether a batch is padded is read from the device once, not at every decode step (on a
    GPU, a read is a wait)."""
    model = tiny().engine.model
    with CountSyncs() as counter:
        bench.naive_batch(model, [[1, 2, 3], [4, 5]], [6, 6], [])
    assert counter.syncs == ["is_nonzero"]  # bool(pads.any()), before the decode steps


def test_bench_forward_timer_leaves_no_hook_behind():
    """The forward is timed by hooks that wait for the device; a whole step is timed without
    them, so none may be left on the model once the timer closes."""
    engine = tiny().engine
    engine.add_request("hi", GREEDY)
    with bench.forward_timer(engine, "cpu") as spent:
        engine.step()
    assert len(spent) == 4  # the forward's and the logits' start and end
    assert not engine.model._forward_hooks and not engine.model._forward_pre_hooks
    assert not engine.model.lm_head._forward_hooks and not engine.model.lm_head._forward_pre_hooks


CI_GPU_PARTS = ("1-versions", "2-cuda-tests", "3-transformers", "4-attention", "5-decode-step",
                "6-lm-head-sampling")
CI_GPU_FILES = {"gpu.log", "status.txt", "1-versions.json", "4-attention.jsonl",
                "5-decode-step.jsonl", "6-lm-head-sampling.jsonl"}


def jsonl_rows(path) -> list[dict]:
    """A --jsonl file's rows: the versions first, then each row as it was measured."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["measurement"] == "versions"
    return rows[1:]


def test_ci_gpu_dry_run_checks_its_bench_flags_and_runs_them_on_the_cpu(tmp_path):
    """.ci/gpu runs where a failure is expensive (a lent GPU, for minutes): its bench flags
    and sizes are checked here, and each of its parts runs at a tiny scale on the CPU (the
    CUDA tests skip, saying so; graphed steps are skipped, saying so), writing what the device
    tool brings back: at most 8 plain files in $OUT itself, the rows as they are measured."""
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path))
    result = subprocess.run(["bash", ".ci/gpu"], cwd=HERE, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = (tmp_path / "status.txt").read_text().split("\n")
    assert status[0] == "part rc seconds limit"
    assert [line.split()[:2] for line in status[1:-1]] == [[name, "0"] for name in CI_GPU_PARTS]
    assert {p.name for p in tmp_path.iterdir()} == CI_GPU_FILES
    assert all(p.is_file() for p in tmp_path.iterdir()) and len(CI_GPU_FILES) <= 8
    log = (tmp_path / "gpu.log").read_text()
    assert "no CUDA GPU: these check" in log  # test_gpu.py's, collected and skipped
    assert "graphed steps skipped: CUDA graphs need CUDA" in log
    assert json.loads((tmp_path / "1-versions.json").read_text())["device"] == "cpu"
    kernel = jsonl_rows(tmp_path / "4-attention.jsonl")
    assert [(r["shape"], r["batch"], r["context"]) for r in kernel] == [
        ("qwen2.5-0.5b", 1, 300), ("qwen2.5-0.5b", 2, 300)]
    for row in kernel:  # the CPU runs Triton's interpreter, in fp32
        assert row["splits"] == 2 and row["split_max_abs_diff"] < 1e-4
        assert row["unsplit_max_abs_diff"] < 1e-4 and row["sdpa_of_peak"] is None
    step = jsonl_rows(tmp_path / "5-decode-step.jsonl")
    assert [(r["measurement"], r["model"], r["mode"], r["batch"]) for r in step] == [
        (measurement, "llama-tiny", "eager", batch)
        for measurement in ("step_gemms", "step_kernels") for batch in (1, 2)]
    assert all(r["aten_calls"] > 0 and r["graph_replays"] == 0 for r in step[2:])
    sampling = jsonl_rows(tmp_path / "6-lm-head-sampling.jsonl")
    assert [(r["batch"], r["what"]) for r in sampling] == [
        (batch, what) for batch in (2, 4)
        for what in ["lm_head"] + [f"sample {kind}" for kind in bench.SAMPLING_KINDS]]
    assert all(r["us"] > 0 and r["vocab"] == 1000 for r in sampling)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU passes part 1: the script would "
                    "run whole")
def test_ci_gpu_stops_when_part_1_finds_no_gpu(tmp_path):
    """Without a GPU (or with torch built without CUDA) part 1 fails, and the script stops
    there: the later parts would "pass" with every CUDA test skipped."""
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("DRY_RUN", None)
    result = subprocess.run(["bash", ".ci/gpu"], cwd=HERE, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:]
    status = (tmp_path / "status.txt").read_text().splitlines()
    assert [line.split()[0] for line in status[1:]] == ["1-versions"]
    assert status[1].split()[1] != "0"
    assert "torch sees no GPU" in (tmp_path / "gpu.log").read_text()
    assert "== stopped: part 1 failed" in result.stdout


def test_ci_gpu_runs_within_its_deadline():
    """The parts' limits fit the deadline the device tool's 7 minutes allow: the script cuts
    each to what is left, but a part given less than its own limit is a part cut short."""
    with open(os.path.join(HERE, ".ci", "gpu")) as f:
        script = f.read()
    deadline = int(re.search(r"^DEADLINE=(\d+)", script, re.M)[1])
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)", script, re.M)[1])
    limits = dict(re.findall(r"^part (\S+) (\d+) ", script, re.M))
    assert list(limits) == list(CI_GPU_PARTS)
    assert sum(map(int, limits.values())) <= deadline <= 390
    assert deadline + kill_after < 7 * 60
    for needed in ("PYTHONUNBUFFERED=1", "timeout -k"):
        assert needed in script


def test_bench_flags_come_from_its_config():
    cfg = bench.parse_args(["--max-num-batched-tokens", "7", "--modes", "fcfs", "sjf",
                            "--rates", "1", "inf"])
    assert cfg.max_num_batched_tokens == 7
    assert (cfg.modes, cfg.rates) == (("fcfs", "sjf"), (1.0, math.inf))
    for bad in (["--token-budget", "7"], ["--modes", "fifo"], ["--preset", "huge"],
                ["--max-num-seqs", "0"], ["--kv-budget", "-5"], ["--threads", "-1"],
                ["--limits", "0"], ["--rates", "nan"], ["--mean-output-len", "inf"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            bench.parse_args(bad)


def run_single(tmp_path, argv: list[str]) -> tuple[dict, str]:
    """bench.main on argv (one measurement alone): its figures and what it printed."""
    out = tmp_path / "bench.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(argv + ["--threads", "1", "--out", str(out)])
    return json.loads(out.read_text()), printed.getvalue()


def test_bench_goodput_reports_each_class_against_the_targets_by_mode_and_rate(tmp_path):
    """A row per rate, mode and class; targets no request can miss: all meet them, and
    goodput is the class's requests over the run; the batch class waits for its long prompts."""
    found, printed = run_single(tmp_path, ["--goodput", "ttft:1e9", "tpot:1e9",
                                           "--slo-requests", "6", "--slo-rates", "50"])
    rows = found["goodput"]
    assert [(r["mode"], r["traffic"]) for r in rows] == [
        (mode, traffic) for mode in bench.SLO_MODES for traffic in bench.SLO_CLASSES]
    for row in rows:
        assert row["met"] == 1.0 and row["goodput"] > 0 and row["rate"] == 50.0
    by_class = {r["traffic"]: r for r in rows if r["mode"] == "fcfs"}
    assert by_class["interactive"]["requests"] + by_class["batch"]["requests"] == 6
    assert "| 50.00 | priority | interactive |" in printed


@pytest.mark.parametrize("targets, met", [(("ttft:1e9",), True), (("tpot:0.001",), False),
                                          (("ttft:0.001", "tpot:1e9"), False)])
def test_bench_goodput_counts_a_request_only_if_it_meets_every_target(targets, met):
    assert bench.meets_targets(bench.parse_goodput(targets), ttft=0.5, tpot=0.05) == met


@pytest.mark.parametrize("spec", ["ttft", "ttft:x", "tpot:-5", "e2e:100", "ttft:inf"])
def test_bench_goodput_refuses_a_bad_target(spec):
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        bench.parse_args(["--goodput", spec])
    assert f"--goodput {spec!r}" in err.getvalue()


def test_bench_swap_times_resuming_by_context_and_throughput_by_mode(tmp_path):
    """Resume rows for each context, recompute then swap (only swap swapped); throughput rows
    for each preemption mode, preempting, with the recompute run's tokens in every mode."""
    found, printed = run_single(tmp_path, ["--swap", "--swap-contexts", "20", "40",
                                           "--num-requests", "12", "--prompt-len", "16"])
    assert [(r["context"], r["mode"], r["swapped"]) for r in found["swap"]["resume"]] == [
        (20, "recompute", False), (20, "swap", True), (40, "recompute", False),
        (40, "swap", True)]
    assert all(r["resume_ms"] > 0 for r in found["swap"]["resume"])
    throughput = {r["mode"]: r for r in found["swap"]["throughput"]}
    assert list(throughput) == ["recompute", "swap", "auto"]
    assert all(r["same_tokens"] and r["preemptions"] > 0 for r in throughput.values())
    assert throughput["recompute"]["swapped_out"] == 0 < throughput["swap"]["swapped_out"]
    assert "Throughput under a cache that preempts often" in printed


def test_bench_disagg_compares_one_instance_with_a_prefill_and_a_decode_instance(tmp_path):
    """--disagg's quick form: the short stream alone and with long prompts, on one instance
    and through two; the decode instance loaded the prompts the prefill instance saved, and
    each run with long prompts is set against its own run without."""
    found, printed = run_single(tmp_path, ["--disagg", "--prompt-len", "16", "--disagg-rate",
                                           "16", "--disagg-duration", "0.25",
                                           "--disagg-long-len", "120", "--disagg-long-every",
                                           "0.125", "--disagg-short-output", "6"])
    rows = found["disagg"]["rows"]
    assert [(row["run"], row["threads"]) for row in rows] == [
        ("one instance, short requests alone", "1 x 2"),
        ("prefill + decode, short requests alone", "2 x 1"),
        ("one instance, long prompts arriving", "1 x 2"),
        ("prefill + decode, long prompts arriving", "2 x 1")]
    assert [row["long_ttft_ms"] is None for row in rows] == [True, True, False, False]
    assert all(row["itl_p99_vs_alone"] > 0 for row in rows[2:])
    transfer = found["disagg"]["transfer"]
    assert transfer["loaded_tokens"] == 2 * 112 and transfer["load_failures"] == 0
    assert transfer["transfer_s_per_token"] > 0 and transfer["prefill_s_per_token"] > 0
    assert "The transfer (one machine, a shared folder)" in printed


# ----------------------------------------------------------------------------- bench.py --url

URL_TINY = ("--online-requests 8 --online-limit 9 --mean-output-len 5 --prompt-len 12 "
            "--rates 25 inf --max-num-seqs 4").split()


def run_bench(argv: list[str]) -> tuple[int, dict | None, str, str]:
    """bench.main in this process: (exit status, its JSON, stdout, stderr); torch's threads put
    back after (bench sets them)."""
    threads, out, status = torch.get_num_threads(), io.StringIO(), 0
    err, path = io.StringIO(), os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                            f"bench_url_{os.getpid()}_{time.monotonic_ns()}.json")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            bench.main(argv + ["--out", path])
    except SystemExit as e:
        status = e.code
    finally:
        torch.set_num_threads(threads)
    result = None
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.remove(path)
    return status, result, out.getvalue(), err.getvalue()


class Stub(BaseHTTPRequestHandler):
    """GET /v1/models; POST /v1/completions streamed two tokens a chunk, then usage, [DONE]."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/v1/models":
            return self.answer(404, {"error": {"message": f"no {self.path}"}})
        self.answer(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((time.perf_counter(), body,
                                     self.headers.get("Content-Type")))
        if body.get("model") != "stub-model" or body["max_tokens"] > 100:
            return self.answer(400, {"error": {"message": "no such model, or too many tokens",
                                               "type": "invalid_request_error"}})
        if self.server.plain:  # a server that does not stream: one JSON answer
            return self.answer(200, {"object": "text_completion", "choices": [{"text": "ab"}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            self.wfile.flush()
        n = body["max_tokens"]
        for i in range(0, n, 2):  # a chunk of two tokens (one at the end of an odd n)
            time.sleep(0.002)
            event(json.dumps({"object": "text_completion", "choices": [{
                "index": 0, "text": "ab"[:min(2, n - i)],
                "finish_reason": "length" if i + 2 >= n else None}]}))
        event(json.dumps({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                   "completion_tokens": n}}))
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture()
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.daemon_threads, server.requests, server.plain = True, [], False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def check_online(result: dict, modes: list[str]) -> None:
    """Every request counted, every requested token counted, and the figures agree."""
    lengths, cfg = result["online_lengths"], result["config"]
    want = bench.make_workload(bench.parse_args(URL_TINY), 8, 9)[1]
    assert lengths == want and len(lengths) == 8 and cfg["online_limit"] == 9
    assert list(result["online"]) == ["25.0", "inf"] and not result["offline"]
    assert "hardware" not in result
    for rate, runs in result["online"].items():
        assert list(runs) == modes
        for mode, r in runs.items():
            assert r["requests"] == 8 and r["output_tokens"] == sum(lengths), (rate, mode)
            assert r["ttft"]["p50"] <= r["e2e"]["p50"] and r["ttft"]["mean"] <= r["e2e"]["mean"]
            assert r["ttft"]["p99"] <= r["e2e"]["p99"] <= r["duration_s"]
            assert r["tpot"]["mean"] is not None  # measured: requests of several tokens
            assert r["output_throughput"] == pytest.approx(sum(lengths) / r["duration_s"])
            assert r["request_throughput"] == pytest.approx(8 / r["duration_s"])
    # Poisson arrivals on the wall clock: the last request is sent no earlier than its arrival
    gaps = np.random.default_rng(cfg["seed"] + 1).exponential(1 / 25, 8)
    assert result["online"]["25.0"]["http"]["duration_s"] >= gaps[:-1].sum()


def test_bench_url_sends_the_workload_and_counts_usage_tokens(stub):
    server, url = stub
    status, result, printed, err = run_bench(URL_TINY + ["--url", url + "/"])
    assert status == 0, err
    check_online(result, ["http"])
    assert "Online, limit 9" in printed and "Offline" not in printed and "Decode" not in printed
    # 8 requests per rate, each exactly the workload's, as OpenAI's /v1/completions asks
    prompts, lengths = bench.make_workload(bench.parse_args(URL_TINY), 8, 9)
    bodies = [body for _, body, _ in server.requests]
    assert len(bodies) == 16 and all(kind == "application/json" for *_, kind in server.requests)
    want = [dict(model="stub-model", prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True,
                 stream=True, stream_options=dict(include_usage=True))
            for prompt, n in zip(prompts * 2, lengths * 2)]
    assert sorted(bodies, key=json.dumps) == sorted(want, key=json.dumps)  # in any order
    # chunks hold two tokens: ITL is per chunk, TPOT per token, so TPOT < ITL at the median
    r = result["online"]["inf"]["http"]
    assert r["tpot"]["p50"] < r["itl"]["p50"]


def test_bench_url_compares_with_the_engine_in_process():
    proc, url = start_server("--max-num-seqs", "4")
    try:
        status, result, printed, err = run_bench(URL_TINY + ["--url", url, "--compare"])
    finally:
        proc.kill()
        proc.wait()
    assert status == 0, err
    check_online(result, ["http", "fcfs"])  # the same tokens counted over HTTP and in process
    assert "| 25.0 | http |" in printed and "| 25.0 | fcfs |" in printed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:{port}", "error: cannot reach http://127.0.0.1:{port}: "),
    ("127.0.0.1:{port}", "error: cannot reach 127.0.0.1:{port}: "),
    ("http://127.0.0.1:{port}x", "error: cannot reach http://127.0.0.1:{port}x: ")])
def test_bench_url_unreachable_is_one_line_and_exit_2(url, message):
    port = free_port()
    status, result, printed, err = run_bench(URL_TINY + ["--url", url.format(port=port)])
    assert status == 2 and result is None and printed == ""
    assert err.startswith(message.format(port=port)) and err.count("\n") == 1, err


def test_bench_url_reports_the_servers_error(stub):
    server, url = stub
    status, result, printed, err = run_bench(URL_TINY + ["--url", url, "--online-limit", "200",
                                                         "--mean-output-len", "500"])
    assert status == 2 and result is None and err.count("\n") == 1, err
    assert err.startswith(f"error: {url}/v1/completions answered 400: ")
    assert "no such model, or too many tokens" in err
    status, _, _, err = run_bench(URL_TINY + ["--url", url + "/nowhere"])
    assert status == 2 and err.startswith(f"error: {url}/nowhere/v1/models answered 404: ")


def test_bench_url_needs_a_stream(stub):
    server, url = stub
    server.plain = True
    status, result, printed, err = run_bench(URL_TINY + ["--url", url])
    assert status == 2 and result is None and err.count("\n") == 1, err
    assert err == f"error: {url}/v1/completions streamed no choices\n"


def test_bench_host_overhead_times_each_phase_of_a_stubbed_decode_step(tmp_path):
    """--host-overhead: rows per context and batch (plain, penalised, plain not streamed),
    each with every phase's ms; the phases fit in the step, and only the penalised rows spend
    time on penalty state."""
    out = tmp_path / "host.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--host-overhead", "--host-batches", "2", "4", "--host-contexts", "16",
                    "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["host_overhead"]
    assert [(r["batch"], r["context"], r["repetition_penalty"], r["stream"]) for r in rows] == [
        (2, 16, False, True), (2, 16, True, True), (2, 16, False, False),
        (4, 16, False, True), (4, 16, True, True), (4, 16, False, False)]
    for row in rows:
        phases = sum(row[f"{phase}_ms"] for phase in bench.HOST_PHASES if phase != "penalty_rows")
        assert 0 < phases <= row["step_ms"] * 1.01
        assert (row["penalties_ms"] > 0) == row["repetition_penalty"]
        assert (row["host_warm_ms"] is None) == row["repetition_penalty"]
    assert "| 4 | 16 | True | True |" in printed.getvalue()


def test_bench_stub_sample_gives_what_sample_gives_on_the_stubbed_engine():
    """host_warm_ms hands sample() its result rather than computing it: the stub's greedy
    tokens must be sample()'s, or the warm steps would run another engine's work."""
    cfg = bench.parse_args(["--threads", "1"])
    engine = bench.stubbed_engine(cfg, 3, 8, 4)
    seqs = engine.scheduler.running
    logits = engine.model.compute_logits(torch.zeros(len(seqs), 1))
    tensors = sampling_tensors(seqs, engine.vocab_size, engine.eos_token_ids, "cpu")
    given = bench.stub_sample(engine.model, logits, tensors, None)
    assert torch.equal(given, sample(logits, tensors, engine.model_runner.generator))
    assert len(set(given.tolist())) == 3  # each row its own token: a real check


def calls_in_a_decode_step(batch: int) -> int:
    """The function calls, Python's and builtins', of one decode step of a stubbed engine of
    `batch` plain greedy sequences (no feature in use)."""
    engine = bench.stubbed_engine(bench.parse_args(["--threads", "1"]), batch, 8, 6)
    calls = []

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls.append(event)
    sys.setprofile(count)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return len(calls)


def test_a_plain_decode_step_makes_no_more_calls_a_sequence_than_before_the_features():
    """Issue 47: with no request using them, speculation, structured output, beam search,
    copy-on-write, log-probabilities, LoRA and the KV connector cost a decode step nothing a
    sequence: each hook is a check once a step. 60 calls a sequence is the step's count at
    350d11f, before them (BENCHMARKS.md, section 16); a call a sequence more is a hook that
    runs for everyone. A count, not a time: it does not depend on the machine."""
    per_sequence = (calls_in_a_decode_step(4) - calls_in_a_decode_step(2)) / 2
    assert per_sequence <= 60, per_sequence


def test_bench_detokenizer_times_a_token_at_each_length_of_unreturned_text(tmp_path):
    """--detokenizer: a row per length of text not yet returned, without and with a stop
    string, each with the microseconds a token took."""
    out = tmp_path / "detokenizer.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--detokenizer", "--out", str(out)])
    rows = json.loads(out.read_text())["detokenizer"]
    assert [(row["chars"], row["stop_strings"]) for row in rows] == [
        (chars, stops) for stops in (0, 1) for chars in bench.DETOKENIZER_CHARS]
    assert all(row["us_per_token"] > 0 for row in rows)
    assert "| 64000 | 1 |" in printed.getvalue()


def test_bench_structured_output_times_the_masks_at_each_batch(tmp_path):
    """--structured-output on the tiny preset: the schema's compile times, then a row per
    batch with the unconstrained and constrained decode step and the masks' part of it."""
    out = tmp_path / "structured.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--structured-output", "--structured-batches", "1", "3", "--prompt-len", "8",
                    "--structured-steps", "4", "--out", str(out)])
    figures = json.loads(out.read_text())["structured_output"]
    assert figures["vocab"] == 257 and figures["compile_ms"] > 0
    assert [row["batch"] for row in figures["steps"]] == [1, 3]
    for row in figures["steps"]:
        assert 0 < row["mask_ms"] < row["constrained_step_ms"] and row["step_ms"] > 0
    assert "the schema's first compile" in printed.getvalue()


def test_bench_step_gemms_times_a_decode_step_against_its_linears_alone(tmp_path):
    """--step-gemms on a CPU: a row per batch for eager steps (graphed ones need CUDA, and are
    skipped, saying so): the step, every nn.Linear of the model (the LM head too) alone,
    attention's share of the step, which the step's time bounds, and SDPA's within it, the
    bytes it reads; then, after every timing, what each step runs. Each row reaches --jsonl
    as it is measured."""
    out, rows = tmp_path / "step.json", tmp_path / "step.jsonl"
    with contextlib.redirect_stdout(io.StringIO()) as printed, \
            contextlib.redirect_stderr(io.StringIO()) as err:
        bench.main(["--step-gemms", "--step-batches", "1", "2", "--prompt-len", "8", "--reps",
                    "5", "--threads", "1", "--out", str(out), "--jsonl", str(rows)])
    found = json.loads(out.read_text())["step_gemms"]
    steps, kernels = found["step_gemms"], found["step_kernels"]
    assert jsonl_rows(rows) == [dict(measurement="step_gemms") | row for row in steps] + [
        dict(measurement="step_kernels") | row for row in kernels]
    assert [(r["model"], r["mode"], r["batch"]) for r in steps + kernels] == 2 * [
        ("tiny", "eager", 1), ("tiny", "eager", 2)]
    config = M.GPTConfig()
    for figures in steps:
        assert figures["linears"] == 4 * config.n_layer + 1  # qkv o up down, LM head
        assert 0 < figures["attention_share"] < 1 and figures["step_ms"] > 0
        assert 0 < figures["sdpa_share"] < figures["attention_share"]
        assert figures["step_over_gemms"] == pytest.approx(figures["step_ms"] / figures["gemm_ms"])
        assert figures["floor_ms"] is None  # no HBM peak on a CPU
        # 8 prompt tokens and the first output, 3 warm-up steps, then 5 rounds of a step timed
        # whole and one for attention's share: the mean context over the timed steps
        assert figures["context"] == (12 + 22) / 2
        kv_bytes = figures["batch"] * figures["context"] * 2 * 4 * config.n_layer * config.n_embd
        assert figures["kv_mb"] == pytest.approx(kv_bytes / 1e6)
    params = sum(p.numel() for p in M.GPT(config).parameters())
    weights = params - config.n_positions * config.n_embd  # the position table: a row read
    assert steps[0]["weight_mb"] == 4 * weights / 1e6  # fp32
    assert all(r["graph_replays"] == 0 and r["aten_calls"] > 0 for r in kernels)
    assert "| tiny | eager | 2 |" in printed.getvalue()
    assert "graphed steps skipped: CUDA graphs need CUDA, this is cpu" in err.getvalue()


def test_bench_shapes_have_the_real_models_parameters():
    """--step-shapes' random models are the size of the real ones (their published counts,
    tied embeddings counted once), built on the meta device: no memory taken."""
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in M.GPT(config).parameters())
                  for name, config in bench.SHAPES.items()}
    assert counts == {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400}


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 3350.0),
                                        ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H200", 4800.0),
                                        ("NVIDIA A100-SXM4-80GB", 2039.0),
                                        ("NVIDIA A100-SXM4-40GB", 1555.0),
                                        ("NVIDIA L40S", 864.0), ("NVIDIA L4", 300.0),
                                        ("NVIDIA GeForce RTX 3090", None)])
def test_bench_hbm_peak_by_the_gpus_name(name, peak, monkeypatch):
    """A GPU's HBM peak from its name (the first entry that matches: H100 PCIe before H100,
    L40 before L4); a GPU not listed gets GB/s alone, and a CPU no peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bench.hbm_peak_gb_s("cuda") == peak
    assert bench.hbm_peak_gb_s("cpu") is None


def test_bench_emit_appends_each_row_as_one_json_line(tmp_path):
    """--jsonl: each row a line the moment it is measured, NumPy and torch scalars as their
    values; without --jsonl, nothing written."""
    path = tmp_path / "rows.jsonl"
    cfg = bench.parse_args(["--jsonl", str(path)])
    first = dict(batch=1, ms=np.float64(0.5), n=np.int64(3))
    assert bench.emit(cfg, "kernel", first) is first
    bench.emit(cfg, "kernel", dict(batch=2, ms=torch.tensor(0.25)))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        dict(measurement="kernel", batch=1, ms=0.5, n=3),
        dict(measurement="kernel", batch=2, ms=0.25)]
    bench.emit(bench.parse_args([]), "kernel", first)
    assert len(path.read_text().splitlines()) == 2


def test_bench_single_measurements_check_their_lists_and_not_the_limits():
    """Each choice of a list flag is checked (--kernel-shapes, --kernel-paths, --step-shapes,
    --step-modes), and every size; a measurement alone uses no generation limit, so a prompt
    past the preset's context minus the largest limit is refused only for the experiments."""
    cfg = bench.parse_args(["--kernel", "--kernel-shapes", "qwen2.5-0.5b", "llama-8b",
                            "--kernel-paths", "split", "sdpa", "--prompt-len", "1024"])
    assert cfg.kernel_shapes == ("qwen2.5-0.5b", "llama-8b") and cfg.kernel_paths == ("split",
                                                                                     "sdpa")
    assert bench.parse_args(["--step-gemms", "--step-shapes", "qwen2.5-0.5b", "llama-tiny",
                             "--step-batches", "1", "64"]).step_batches == (1, 64)
    for bad in (["--kernel-shapes", "gpt3"], ["--kernel-paths", "flash"],
                ["--step-shapes", "llama-70b"], ["--step-modes", "compiled"],
                ["--step-batches", "0"], ["--kernel-contexts", "0"],
                ["--sampling-batches", "0"], ["--prompt-len", "1024"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            bench.parse_args(bad)


def test_bench_count_ops_counts_each_layers_aten_calls_in_a_decode_step(tmp_path):
    """--count-ops on a CPU: llama-tiny's layers in one decode step of 4 sequences make 59
    ATen calls each (views included): 42 of the model's (two norms with their residual adds,
    9 each; the qkv GEMM, its split and views 5; RoPE on q's and k's heads at once 7;
    store_kv's 4; o_proj and its flatten 2; gate_up, SwiGLU and down 6) and 17 of the CPU's
    paged attention (kernels.py); the first adds no residual but plans the step's attention
    (82). They made 70 (94) before q, k, v and gate, up were stacked and the adds fused."""
    out = tmp_path / "ops.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--count-ops", "--preset", "llama-tiny", "--max-num-seqs", "4",
                    "--prompt-len", "16", "--threads", "1", "--out", str(out)])
    figures = json.loads(out.read_text())["count_ops"]
    assert (figures["counted"], figures["dtype"], figures["batch"]) == ("aten_calls", "float32", 4)
    assert figures["per_layer"] == [82, 59, 59, 59]
    assert figures["ops"]["linear.default"] == 4  # qkv, o, gate_up, down
    assert "| 3 | 59 |" in printed.getvalue()


def test_bench_speculative_compares_tokens_per_s_with_and_without_drafts(tmp_path):
    """--speculative on the tiny preset: each workload at each batch size, without drafts and
    with the n-gram proposer, on the same prompts; greedy, so the tokens are the same, and
    the drafting run's counters are there."""
    out = tmp_path / "spec.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--speculative", "--spec-batches", "1", "2", "--spec-max-tokens", "8",
                    "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["speculative"]
    assert [(r["workload"], r["batch"], r["speculative_config"]) for r in rows] == [
        (workload, batch, config) for workload in ("copy", "free") for batch in (1, 2)
        for config in ("none", bench.SPEC_NGRAM)]
    assert all(r["same_tokens"] for r in rows)
    assert all(r["draft_tokens"] == 0 and r["speedup"] == 1 for r in rows[::2])
    assert any(r["draft_tokens"] > 0 for r in rows[1::2])
    assert "speculative decoding" in printed.getvalue()


def test_bench_lora_serves_requests_over_k_adapters_three_ways(tmp_path):
    """--lora on the tiny preset, CI's quick form: the base model's row, then for each K the
    multi-adapter rows (max_loras K and K/2) and one adapter at a time; the load times."""
    out = tmp_path / "lora.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--lora", "--num-requests", "8", "--prompt-len", "8", "--lora-adapters",
                    "1", "4", "--lora-max-tokens", "4", "--lora-rank", "8", "--out", str(out)])
    figures = json.loads(out.read_text())["lora"]
    assert [(row["adapters"], row["max_loras"], row["mode"]) for row in figures["rows"]] == [
        (0, 0, "base"), (1, 1, "multi-lora"), (1, 1, "one adapter at a time"),
        (4, 4, "multi-lora"), (4, 2, "multi-lora"), (4, 1, "one adapter at a time")]
    assert all(row["vs_base"] > 0 for row in figures["rows"][1:])  # each against a base run
    assert all(row["output_throughput"] > 0 and row["mean_e2e_ms"] > 0
               for row in figures["rows"])
    assert figures["load"]["disk_ms"] > 0 and figures["load"]["slot_ms"] > 0
    assert "Loading an adapter of rank 8" in printed.getvalue()


def test_bench_quantization_compares_each_scheme_with_the_unquantized_model(tmp_path):
    """--quantization's quick form on the shipped model: a row per scheme; 8-bit projections
    at most 0.55x their bf16 bytes, an FP8 cache a quarter of fp32's bytes a token (4x the
    tokens a GiB), the unquantized row agreeing with itself, every figure measured."""
    found, printed = run_single(tmp_path, ["--quantization", "--quant-prompts", "2",
                                           "--quant-tokens", "4", "--quant-batches", "1",
                                           "--quant-eval-bytes", "600"])
    rows = {row["scheme"]: row for row in found["quantization"]["rows"]}
    assert list(rows) == list(bench.QUANT_SCHEMES)
    reference = rows["unquantized"]
    assert reference["greedy_identical"] == 2 and reference["max_abs_delta_logprob"] == 0
    assert all(rows[s]["projection_vs_bf16"] <= 0.55 for s in ("int8", "fp8", "fp8 + fp8 KV"))
    assert rows["fp8 KV"]["projection_vs_bf16"] == reference["projection_vs_bf16"] == 2.0
    assert rows["fp8 KV"]["kv_capacity_vs_unquantized"] == 4.0
    assert rows["int8"]["kv_bytes_per_token"] == reference["kv_bytes_per_token"]
    assert all(row["decode_tok_s_b1"] > 0 and 1 < row["perplexity"] for row in rows.values())
    assert "Quantization on shipped" in printed


def test_bench_beam_search_compares_blocks_with_independent_sequences_and_times_it(tmp_path):
    """A blocks row and a throughput row for each beam width; W beams of a request hold no more
    blocks than W independent sequences, and copied blocks on write to do it."""
    found, printed = run_single(tmp_path, ["--beam-search", "--beam-widths", "2", "4",
                                           "--beam-max-tokens", "6", "--prompt-len", "20",
                                           "--beam-requests", "2", "--block-size", "4",
                                           "--kv-cache-tokens", "512", "--max-num-seqs", "8"])
    blocks = found["beam_search"]["blocks"]
    assert [row["beam_width"] for row in blocks] == [2, 4]
    assert all(0 < row["beam_blocks"] < row["independent_blocks"] for row in blocks)
    assert all(row["block_copies"] > 0 for row in blocks)
    throughput = found["beam_search"]["throughput"]
    assert [(row["beam_width"], row["requests"]) for row in throughput] == [(2, 2), (4, 2)]
    assert all(row["beam_tokens_per_s"] > 0 for row in throughput)
    assert "independent sequences" in printed

def test_bench_tensor_parallel_counts_each_steps_all_reduces(tmp_path):
    """--tensor-parallel, CI's quick form on the tiny preset (4 layers, C = 256): N = 1 has no
    all-reduce; N = 2 has the embedding's and two a layer, 9 a decode step, each a token's C
    fp32 values (1 KiB) a sequence, and one gather of logits, after the broadcast of the 2
    rows (2 KiB): 2 ranks' 2 x 129 fp32 logits (rank 1's 128 padded); the same tokens."""
    out = tmp_path / "tp.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(["--tensor-parallel", "--tp-batches", "2", "--tp-steps", "2",
                    "--prompt-len", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["tensor_parallel"]
    assert [(r["tensor_parallel_size"], r["all_reduces_a_step"], r["all_reduce_kib_a_step"])
            for r in rows] == [(1, 0, 0), (2, 9, 18)]
    assert [(r["logits_gathers_a_step"], r["logits_kib_a_step"]) for r in rows] == \
        [(0, 0), (1, 2 + 2 * 2 * 129 * 4 / 1024)]
    assert all(r["same_tokens"] and r["step_ms"] > 0 for r in rows)
    assert rows[1]["channel_ms_a_step"] > 0
    assert "tensor parallelism" in printed.getvalue()


def test_help_lists_every_flag_and_its_percent_signs(capsys):
    """bench.py --help prints (a % in a help text once made argparse raise instead)."""
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--quant-eval-bytes" in text and "last 10%, as train.py splits it" in text
