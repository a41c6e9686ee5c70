"""watch.py's and watch.html's guarantees: each step's frame says what the engine did and holds
(phases, blocks, queues); --trace-html writes a page replaying a run; the server streams frames
to a watching page, and builds none while no page watches; and in a real browser (headless
Chromium), the page draws what the engine did: every step, each preemption where it happened,
the blocks the prefix cache shares.
"""
import io
import json
import re
import shutil
import subprocess
import sys
import time
import types
import urllib.request

import pytest

import watch
from conftest import http, nanoserve_main, server_thread, tiny
from paged_cache import BlockPool
from sampling import SamplingParams
from server import Server, ServerConfig, Watcher

# The known run: six blocks of 8 tokens for four requests. 0 and 1 begin with the same two
# blocks (16 tokens), which 1 takes from the prefix cache at step 2; as the four grow, the
# cache runs out: 3 is preempted at step 6, 2 at step 8, and both come back at step 14,
# recomputing what they had.
KNOWN_RUN = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_cache_tokens": 48,
             "block_size": 8}
KNOWN_PROMPTS = ["The same prefix!abc", "The same prefix!xyz", "KING", "LEAR:"]
KNOWN_PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run_frames(engine, prompts: list[str], params: SamplingParams) -> list[dict]:
    """Serve prompts (request ids "0", "1", ...) to the end: the frames, one a step."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, str(i))
    frames = watch.FrameLog(engine)
    while engine.has_unfinished():
        engine.step()
        frames.add()
    return frames.frames


@pytest.fixture(scope="module")
def known_run() -> list[dict]:
    """The known run's frames, one a step."""
    return run_frames(tiny(**KNOWN_RUN).engine, KNOWN_PROMPTS, KNOWN_PARAMS)


def at_step(frames: list[dict], step: int) -> dict:
    return next(frame for frame in frames if frame["step"] == step)


def embedded_frames(html: str) -> list[dict]:
    """The frames a page holds in its frames element."""
    found = re.search(r'<script type="application/json" id="frames">(.*?)</script>', html,
                      re.DOTALL)
    return json.loads(found.group(1))


# ----------------------------------------------------------------------------- frames

def test_frames_give_each_scheduled_sequence_its_phase(known_run):
    assert at_step(known_run, 1)["record"]["phases"] == {"0": "prefill"}
    assert set(at_step(known_run, 3)["record"]["phases"].values()) == {"decode"}
    step_6 = at_step(known_run, 6)["record"]
    assert step_6["preempted"] == ["3"] and "3" not in step_6["phases"]
    assert at_step(known_run, 14)["record"]["phases"] == {"2": "recompute", "3": "recompute"}
    assert at_step(known_run, 15)["record"]["phases"] == {"2": "decode", "3": "recompute"}


def test_an_idle_step_adds_no_frame():
    """A frame is a step that made a record: steps with nothing to run add none, before a
    request and after it finished, and are not counted in the frames' step numbers (the
    engine's num_steps, as the trace and the command line's summary count)."""
    engine = tiny().engine
    frames = watch.FrameLog(engine)
    engine.step()
    frames.add()
    assert frames.frames == [] and not engine.step_recorded
    engine.add_request("ab", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        frames.add()
    engine.step()
    frames.add()
    assert [frame["step"] for frame in frames.frames] == [1, 2]  # the idle call not counted
    assert engine.stats.num_steps == 2


def test_frames_show_the_blocks_a_common_prefix_shares(known_run):
    frame = at_step(known_run, 2)
    first, second = frame["running"][:2]
    assert frame["record"]["num_cached_tokens"] == {"1": 16}
    assert first["blocks"][:2] == second["blocks"][:2]
    assert [frame["blocks"][b] for b in first["blocks"]] == ["2", "2", "1"]
    assert frame["blocks"].count("2") == 2


def test_frames_list_running_and_waiting_sequences_in_order(known_run):
    """After step 8: 0 and 1 run; 2, preempted last, waits before 3."""
    frame = at_step(known_run, 8)
    assert [(s["id"], s["computed"], s["tokens"]) for s in frame["running"]] == \
        [("0", 25, 26), ("1", 25, 26)]
    assert [(s["id"], s["computed"], s["blocks"]) for s in frame["waiting"]] == \
        [("2", 0, []), ("3", 0, [])]


def test_block_states_mark_free_cached_in_use_and_shared_blocks():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.touch([0])
    pool.cache_block(1, b"its hash")
    pool.free([1])
    assert watch.block_states(pool) == "2c1.."
    pool.ref_counts[0] = 300  # more than a byte holds
    assert watch.block_states(pool) == "9c1.."


def test_page_holds_frames_whatever_text_they_carry():
    frames = [{"step": 1, "record": {"scheduled": {"</script><!--": 1}}}]
    html = watch.page(frames)
    assert "</script><!--" not in html and embedded_frames(html) == frames


# ----------------------------------------------------------------------------- --trace-html

def test_trace_html_writes_a_page_replaying_every_step(capsys, tmp_path):
    path = tmp_path / "run.html"
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--prompt", "ROMEO:",
                                    "--prompt", "JULIET:", "--max-tokens", "5",
                                    "--trace-html", str(path))
    assert status == 0, err
    frames = embedded_frames(path.read_text(encoding="utf-8"))
    assert f" {len(frames)} steps," in err
    assert frames[-1]["record"]["finished"] and not frames[-1]["running"]
    assert path.read_text(encoding="utf-8") == watch.page(frames)


def test_trace_html_records_piped_lines_too(capsys, monkeypatch, tmp_path):
    path = tmp_path / "run.html"
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "KING:", "max_tokens": 3}\n'))
    status, _, err = nanoserve_main(capsys, "--preset", "tiny", "--jsonl",
                                    "--trace-html", str(path))
    assert status == 0, err
    assert len(embedded_frames(path.read_text(encoding="utf-8"))) == 3


def test_trace_html_needs_an_input_to_record_and_a_path_it_can_write(capsys, tmp_path):
    status, _, err = nanoserve_main(capsys, "--serve", "--trace-html", str(tmp_path / "a"))
    assert status == 2 and err == ("error: --trace-html needs --prompt, piped input or --jsonl "
                                   "(a server's live page is at /)\n")
    path = tmp_path / "no such dir" / "a.html"
    status, _, err = nanoserve_main(capsys, "--prompt", "a", "--trace-html", str(path))
    assert status == 2 and err == (f"error: cannot write --trace-html {path}: No such file or "
                                   "directory\n")


# ----------------------------------------------------------------------------- the server

def test_server_builds_no_frame_while_no_page_watches(monkeypatch):
    built = []
    monkeypatch.setattr(watch, "frame", built.append)
    with server_thread(tiny().engine) as server:
        status, _ = http(server.url, "/v1/completions", {"prompt": "A", "max_tokens": 5})
    assert status == 200 and built == []


def test_watch_events_stream_the_state_then_a_frame_per_step():
    engine = tiny().engine
    engine.step_records = []
    with server_thread(engine) as server:
        events = stream(server.url, "/watch/events")
        first = next(events)
        assert first["step"] == 0 and first["record"] is None and first["blocks"] == "." * 256
        status, _ = http(server.url, "/v1/completions",
                         {"prompt": "ROMEO:", "max_tokens": 4, "ignore_eos": True})
        frames = [next(events) for _ in engine.step_records]
    assert status == 200
    assert [frame["record"] for frame in frames] == [vars(r) for r in engine.step_records]
    assert frames[-1]["record"]["finished"] == ["0"]


def stream(url: str, path: str):
    """The server-sent events of a GET, parsed, as they come."""
    with urllib.request.urlopen(url + path, timeout=60) as response:
        for line in response:
            if line.startswith(b"data: "):
                yield json.loads(line[len(b"data: "):])


def test_the_page_is_at_root_and_open_without_the_api_key():
    config = ServerConfig(port=0, api_key="sk-test")
    with server_thread(tiny().engine, config) as server:
        status, page = http(server.url, "/")
        assert http(server.url, "/v1/models")[0] == 401
    assert status == 200 and page == watch.page()  # live: no frames of its own


def test_a_page_that_reads_slowly_misses_frames_and_holds_no_one():
    """A page with more than --max-write-buffer bytes unread gets no frame; the others do."""
    server = Server(tiny().engine, ServerConfig(port=0, max_write_buffer=100))
    slow, quick = FakeExchange(unsent=101), FakeExchange(unsent=100)
    server.watchers = {Watcher(slow), Watcher(quick)}
    server.show({"step": 1})
    assert slow.events == [] and quick.events == ['{"step":1}']


class FakeExchange:
    """An Exchange as show() sees it: what it has unsent, the events written."""

    def __init__(self, unsent: int):
        self.client = types.SimpleNamespace(gone=False)
        self.unsent = unsent
        self.events = []

    def unsent_bytes(self) -> int:
        return self.unsent

    def event(self, text: str) -> None:
        self.events.append(text)


# ----------------------------------------------------------------------------- in Chromium

CHROMIUM = shutil.which("chromium")


def chromium(url: str, profile, *flags) -> list[str]:
    """The command that opens url in headless Chromium (its profile in directory `profile`);
    the test skips where Chromium is missing."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed: the browser tests need it (Debian: apt-get "
                    "install chromium; .ci/run installs it)")
    return [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={profile}", *flags, url]


def dump_dom(url: str, profile) -> str:
    """The page's DOM once its script has run (2 s of the page's time, none of it waited)."""
    run = subprocess.run(chromium(url, profile, "--dump-dom", "--virtual-time-budget=2000"),
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def columns(dom: str) -> dict[int, str]:
    """The step diagram as drawn: each column's markup, by its step."""
    drawn = re.findall(r'<g class="col[^"]*" data-step="(\d+)"[^>]*>(.*?)</g>', dom, re.DOTALL)
    return {int(step): markup for step, markup in drawn}


def marked(markup: str, mark: str) -> set[str]:
    """The sequences a column marks so ("preempted", "finished", "admitted")."""
    return set(re.findall(rf'class="mark {mark}" data-seq="([^"]*)"', markup))


def pool(dom: str) -> list[str]:
    """Each block's classes as the KV cache panel draws it."""
    return re.findall(r'<i class="b ([^"]*)" data-block', dom)


@pytest.fixture(scope="module")
def replay_dom(known_run, tmp_path_factory) -> str:
    """The known run's page, opened at step 2 (where blocks are shared), as Chromium drew it."""
    directory = tmp_path_factory.mktemp("replay")
    path = directory / "known.html"
    watch.write_page(str(path), known_run)
    return dump_dom(path.as_uri() + "#step=2", directory / "profile")


def test_replay_page_draws_every_step(replay_dom, known_run):
    assert list(columns(replay_dom)) == [frame["step"] for frame in known_run]


def test_replay_page_marks_each_preemption_at_its_step(replay_dom, known_run):
    drawn = {step: marked(markup, "preempted") for step, markup in columns(replay_dom).items()}
    assert drawn == {f["step"]: set(f["record"]["preempted"]) for f in known_run}
    assert drawn[6] == {"3"} and drawn[8] == {"2"}


def test_replay_page_shows_the_blocks_the_prefix_cache_shares(replay_dom, known_run):
    blocks = pool(replay_dom)
    shared = [b for b, classes in enumerate(blocks) if classes.split()[0] == "shared"]
    taken = [b for b, classes in enumerate(blocks) if "hit" in classes.split()]
    second = at_step(known_run, 2)["running"][1]
    assert len(blocks) == 6 and shared == taken == second["blocks"][:2]
    assert "prefix cache hits 1 (1: 16 tokens)" in replay_dom


def test_live_page_draws_each_step_as_the_engine_runs(tmp_path):
    """The page at / follows the engine: a request served while it is open is drawn, a column
    a step. (Chromium gives the DOM once the stream ends: when the server stops.)"""
    engine = tiny().engine
    engine.step_records = []
    with server_thread(engine) as server:
        browser = subprocess.Popen(chromium(server.url + "/", tmp_path, "--dump-dom",
                                            "--virtual-time-budget=2000"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(server.watchers.__len__, browser)
            status, _ = http(server.url, "/v1/completions",
                             {"prompt": "ROMEO:", "max_tokens": 6, "ignore_eos": True})
        except BaseException:
            browser.kill()
            raise
    assert status == 200
    dom, err = browser.communicate(timeout=120)
    assert browser.returncode == 0, err[-2000:]
    drawn = list(columns(dom).values())
    assert len(drawn) == len(engine.step_records) == 6  # its prompt's step, then 5 decodes
    assert marked(drawn[-1], "finished") == {"0"}


def wait_for(condition, browser: subprocess.Popen, seconds: float = 60) -> None:
    """Poll until condition() holds; fail if the browser exits or time runs out."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert browser.poll() is None, browser.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the page never connected"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- swapping

# The known run again, swapping: 3 is swapped out at step 6 and 2 at step 8 (their K/V to
# host blocks), and both come back at step 14 by copies, not recomputation.
@pytest.fixture(scope="module")
def swapping_run() -> list[dict]:
    engine = tiny(**KNOWN_RUN, preemption_mode="swap").engine
    return run_frames(engine, KNOWN_PROMPTS, KNOWN_PARAMS)


def test_frames_mark_swapped_out_sequences_and_the_host_pool(swapping_run):
    """3 (8 tokens computed: 1 host block) goes at step 6, 2 (9: 2 host blocks) at step 8;
    the queue shows their host blocks, the pool its 3 used; step 14 copies both back in."""
    steps = {f["step"]: f for f in swapping_run}
    assert [s for s, f in steps.items() if f["record"]["swapped_out"]] == [6, 8]
    assert steps[8]["record"]["swapped_out"] == ["2"] == steps[8]["record"]["preempted"]
    assert [(seq["id"], seq["blocks"], seq["host_blocks"]) for seq in steps[8]["waiting"]] == [
        ("2", [], [1, 2]), ("3", [], [0])]
    assert [f["swap_space"]["used"] for f in swapping_run[4:9]] == [0, 1, 1, 3, 3]
    assert steps[14]["record"]["swapped_in"] == ["2", "3"]
    assert steps[14]["swap_space"]["used"] == 0 and steps[14]["waiting"] == []


def test_replay_page_marks_swaps_and_the_host_pool(swapping_run, tmp_path):
    path = tmp_path / "swapping.html"
    watch.write_page(str(path), swapping_run)
    dom = dump_dom(path.as_uri() + "#step=6", tmp_path / "profile")
    drawn = columns(dom)
    assert marked(drawn[6], "swapped-out") == {"3"} and marked(drawn[6], "preempted") == set()
    swapped_in = {step for step, markup in drawn.items() if marked(markup, "swapped-in")}
    assert swapped_in == {f["step"] for f in swapping_run if f["record"]["swapped_in"]}
    assert re.search(r"Host memory \(swap space\): 1 of \d+ blocks", dom)
    assert re.search(r'<li data-seq="3" class="swapped">3: 8 of \d+ tokens computed '
                     r'\(prompt \d+\), swapped out: 1 host block</li>', dom)


# ----------------------------------------------------------------------------- speculative decoding

@pytest.fixture(scope="module")
def drafting_run() -> list[dict]:
    """Two prompts that repeat themselves, n-gram drafts of 4: some accepted, some not."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    engine = tiny(speculative_config=spec).engine
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return run_frames(engine, ["ab" * 20, "the cat, the cat, the cat"], params)


def test_replay_page_marks_each_steps_rejected_drafts(drafting_run, tmp_path):
    """A decode that verified k drafts and accepted a of them has its cell's right part red
    (class rejected) exactly where a < k; the frames carry both counts."""
    with_rejections = {(f["step"], seq_id) for f in drafting_run for seq_id, k
                       in f["record"]["num_draft_tokens"].items()
                       if f["record"]["num_accepted_tokens"][seq_id] < k}
    assert with_rejections
    path = tmp_path / "drafting.html"
    watch.write_page(str(path), drafting_run)
    dom = dump_dom(path.as_uri(), tmp_path / "profile")
    drawn = {(step, seq_id) for step, markup in columns(dom).items()
             for seq_id in re.findall(r'class="rejected" data-seq="([^"]*)"', markup)}
    assert drawn == with_rejections
