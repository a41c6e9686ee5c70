"""Host work of a warm decode step, counted instead of timed (BENCHMARKS.md, section 16): on
this machine a step's time moves 15-20% from run to run, so a 5% cost cannot be timed; the
instructions it executes move by well under 0.1%.

    python .ci/host_instructions.py REPO [REPO ...]    (each a checkout: its own bench.py)

For each checkout: bench.py's stubbed engine (section 8's stub model, batch 256, context 256,
not streamed), sample() handed its result (bench.stub_sample, as --host-overhead's warm row),
then (1) the Python bytecodes of 4 steps (sys.settrace, opcode events) and (2) the machine
instructions of 100 steps under valgrind's cachegrind: one run with 4 steps, one with 104, the
difference / 100 (so imports and the engine's build cancel). Needs valgrind; PYTHONHASHSEED=0.
"""
import os
import re
import subprocess
import sys
from functools import partial
from unittest import mock

BATCH = 256    # sequences decoding
CONTEXT = 256  # their prompt tokens
STEPS = 100    # the steps counted under valgrind (104 run, less 4)


def warm_engine(repo: str):
    """The checkout's stubbed engine, its sample() stubbed, warmed by 3 steps."""
    sys.path.insert(0, repo)
    os.chdir(repo)
    import torch
    torch.set_num_threads(1)
    import bench
    import model_runner
    engine = bench.stubbed_engine(bench.BenchConfig(), BATCH, CONTEXT, bench.HOST_MAX_TOKENS,
                                  stream=False)
    mock.patch.object(model_runner, "sample", partial(bench.stub_sample, engine.model)).start()
    if hasattr(model_runner, "invalid_logits"):
        mock.patch.object(model_runner, "invalid_logits", bench.stub_invalid_logits).start()
    else:  # before the NaN check was renamed
        mock.patch.object(model_runner, "invalid_rows", bench.stub_invalid_rows).start()
    for _ in range(3):
        engine.step()
    return engine


def count_bytecodes(engine, steps: int = 4) -> float:
    """Python bytecodes a step."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return tracer
    sys.settrace(tracer)
    for _ in range(steps):
        engine.step()
    sys.settrace(None)
    return count / steps


def instructions(repo: str, steps: int) -> int:
    """Machine instructions of a whole run: the engine built, then `steps` steps."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
               "--cachegrind-out-file=/dev/null", sys.executable, __file__, "--steps", repo,
               str(steps)]
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return int(re.search(r"I\s+refs:\s+([\d,]+)", result.stderr).group(1).replace(",", ""))


def main(repos: list[str]) -> None:
    for repo in repos:
        bytecodes = subprocess.run([sys.executable, __file__, "--bytecodes", repo],
                                   capture_output=True, text=True, check=True).stdout.strip()
        per_step = (instructions(repo, 4 + STEPS) - instructions(repo, 4)) / STEPS
        print(f"{repo}: {float(bytecodes):,.0f} bytecodes, {per_step:,.0f} instructions a step")


if __name__ == "__main__":
    if sys.argv[1] == "--steps":
        engine = warm_engine(sys.argv[2])
        for _ in range(int(sys.argv[3])):
            engine.step()
    elif sys.argv[1] == "--bytecodes":
        print(count_bytecodes(warm_engine(sys.argv[2])))
    else:
        main([os.path.abspath(repo) for repo in sys.argv[1:]])
