"""gen-data --endpoint through a server that fails: every fault shape retried, outages waited out,
no answer bought twice after a stop (journal), load shed on 429/503. Each run is compared byte for
byte with a run against the same server answering cleanly (tests/helpers/fake_openai.py)."""

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import eagle3cli.data.answer_journal as answer_journal
import eagle3cli.data.endpoint_pacing as pacing
from eagle3cli.cli import app
from eagle3cli.config.options import GenDataOptions, parse_duration
from eagle3cli.core.errors import OptionError
from eagle3cli.data.answer_journal import AnswerJournal
from eagle3cli.data.endpoint import Endpoint, EndpointError, chat_reply_problem, regenerate_endpoint
from eagle3cli.data.regenerate import GenSettings
from tests.helpers.fake_openai import SHAPES, FakeOpenAI, conversation_of

REPO = Path(__file__).resolve().parents[2]
N_CONVS, SHARD = 24, 8  # three shards
N_ASKED = 35  # 24 first turns (conversation 5's refused) + 11 second turns (9's refused)


def rows():
    out = []
    for i in range(N_CONVS):
        first = "TOO LONG, refused" if i == 5 else f"Question {i}: what is {i} plus {i}?"
        turns = [{"from": "human", "value": first}, {"from": "gpt", "value": "dataset answer"}]
        if i % 2:
            turns += [{"from": "human", "value": "TOO LONG again" if i == 9 else "Explain why, briefly."},
                      {"from": "gpt", "value": "Addition."}]
        out.append({"conversations": turns})
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows()) + "\n")
    return p


@pytest.fixture(scope="module")
def server():
    fake = FakeOpenAI()
    yield fake
    fake.close()


@pytest.fixture()
def fake(server):
    """The module's server, answering cleanly and at once, its counters at zero."""
    server.plan, server.delay, server.busy_above, server.retry_after, server.outage_s = None, 0.0, None, "0", 1.0
    server.up()
    server.reset()
    yield server
    server.plan = None
    server.up()


@pytest.fixture()
def fast(monkeypatch):
    """Back-off and progress lines in tens of milliseconds instead of seconds."""
    monkeypatch.setattr(pacing, "BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(pacing, "BACKOFF_CAP", 0.05)
    monkeypatch.setattr(pacing, "SAY_EVERY", 0.3)


def args(smol_tiny_dir, data_file, out, url, *extra):
    return ["gen-data", "-m", str(smol_tiny_dir), "--dataset", str(data_file), "-o", str(out), "--endpoint", url,
            "--online", "--shard-size", str(SHARD), "--concurrency", "2", "--max-new-tokens", "6",
            "--max-length", "96", *extra]


def gen(smol_tiny_dir, data_file, out, url, *extra):
    return CliRunner().invoke(app, args(smol_tiny_dir, data_file, out, url, *extra), env={"COLUMNS": "500"})


def store_bytes(out) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def clean(server, smol_tiny_dir, data_file, tmp_path_factory):
    """(the store of a run against the clean server, the (conversation, turn) it asked, in order)."""
    server.plan = None
    server.up()
    server.reset()
    out = tmp_path_factory.mktemp("clean") / "store"
    res = gen(smol_tiny_dir, data_file, out, server.url)
    assert res.exit_code == 0, res.output
    man = json.loads((out / "manifest.json").read_text())
    assert man["complete"] and man["num_samples"] == N_CONVS - 1  # conversation 5 refused
    assert man["skipped"] == {"endpoint rejected the conversation": 1}
    stats = json.loads((out / "regenerated" / "part-00000.stats.json").read_text())
    assert list(stats["rejected"]) == ["5"] and "HTTP 400" in stats["rejected"]["5"]  # ids: the rows' numbers
    assert len(server.asked) == N_ASKED and len(set(server.asked)) == N_ASKED
    return store_bytes(out), list(server.asked)


def journal_lines(out) -> list[dict]:
    return [json.loads(line) for p in sorted((Path(out) / "regenerated").glob("*.journal"))
            for line in p.read_text().splitlines() if line.strip()]


def answered_on_disk(out) -> set[tuple[str, int]]:
    """The (conversation, turn) whose answer (or refusal) a stopped run left on disk: the journal's
    and those of the shards whose part file is written."""
    users = {str(i): [t["value"] for t in r["conversations"] if t["from"] == "human"] for i, r in enumerate(rows())}
    done = {(users[str(e["id"])][0], e["turn"]) for e in journal_lines(out)}
    for part in (Path(out) / "regenerated").glob("part-*.jsonl"):
        for line in part.read_text().splitlines():
            row = json.loads(line)
            asked = users[str(row["id"])]
            kept = 0 if row["messages"] is None else sum(m["role"] == "assistant" for m in row["messages"])
            done |= {(asked[0], k) for k in range(min(len(asked), kept + 1))}  # the refused step was asked too
    return done


# ---------------------------------------------------------------- reply shapes


def test_a_200_that_is_not_a_chat_completion_names_its_shape():
    msg = {"role": "assistant", "content": "hi"}
    assert chat_reply_problem({"choices": [{"message": msg}]}) is None
    assert chat_reply_problem({"choices": [{"message": {"role": "assistant", "content": None}}]}) is None
    assert chat_reply_problem({"error": {"message": "upstream\n timed out", "type": "server_error"}}) == \
        "an error object (upstream timed out)"
    assert chat_reply_problem({"error": "overloaded"}) == "an error object (overloaded)"
    assert chat_reply_problem({"object": "chat.completion"}) == "no 'choices'"
    assert chat_reply_problem({"choices": []}) == "empty 'choices'"
    assert chat_reply_problem({"choices": {}}) == "empty 'choices'"
    assert chat_reply_problem({"choices": [{"finish_reason": "stop"}]}) == "no 'message' in its first choice"
    assert chat_reply_problem({"choices": [{"message": {"content": ["a"]}}]}) == "a 'content' that is a list, not text"
    assert chat_reply_problem(["choices"]) == "a JSON list instead of an object"


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "down"])
def test_each_fault_shape_is_tried_again(fake, fast, shape):
    """Two faults of the shape, then the answer: the same answer a clean server gives."""
    fake.plan = lambda n, req: shape if n < 2 else None
    ep = Endpoint(fake.url, concurrency=1, seed=0)
    conv = [{"role": "user", "content": "hi"}]
    (out,), stats = regenerate_endpoint(ep, [conv], GenSettings(max_new_tokens=4))
    assert out == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "echo: hi (1)"}]
    assert stats.answers == 1 and not stats.rejected
    assert fake.shapes_sent == [shape, shape] and fake.asked == [("hi", 0)] * 3


@pytest.mark.parametrize("shape, named", [
    ("error200", "a 200 reply that is not a chat completion: an error object (upstream timed out)"),
    ("empty_choices", "a 200 reply that is not a chat completion: empty 'choices'"),
    ("no_choices", "a 200 reply that is not a chat completion: no 'choices'"),
    ("no_message", "a 200 reply that is not a chat completion: no 'message' in its first choice"),
    ("not_json", "a 200 reply that is not JSON ('<html>gateway ok</html>')"),
    ("503html", "HTTP 503: <html><body><h1>503 Service Unavailable</h1></body></html>"),
])
def test_a_shape_that_persists_stops_in_one_line_naming_it(fake, fast, shape, named):
    fake.plan = lambda n, req: shape
    ep = Endpoint(fake.url, concurrency=1, patience=0.3, seed=0)
    with pytest.raises(EndpointError) as e:
        regenerate_endpoint(ep, [[{"role": "user", "content": "hi"}]], GenSettings())
    line = str(e.value)
    assert "\n" not in line and line.endswith(f"(--endpoint-patience 0.3 s): {named}")
    assert re.match(rf"{re.escape(fake.url)}/chat/completions failed after {len(fake.asked)} tries in [0-9.]+ s ", line)
    assert len(fake.asked) >= 3


def test_auth_and_wrong_url_stop_at_once_instead_of_skipping_every_conversation(fake):
    ep = Endpoint(fake.url.replace("/v1", "/nowhere"), model="fake-target")
    with pytest.raises(EndpointError, match=r"/nowhere/v1/chat/completions answers HTTP 404: .*check --endpoint"):
        ep.answer([{"role": "user", "content": "hi"}], GenSettings())
    with pytest.raises(EndpointError, match=r"/nowhere/v1/models answers HTTP 404.*--endpoint-model"):
        Endpoint(fake.url.replace("/v1", "/nowhere")).resolve_model()


def test_mixed_faults_end_rc_0_byte_identical(fake, fast, clean, smol_tiny_dir, data_file, tmp_path):
    """About one request in three gets a fault, every shape in turn (outages of 0.3 s included)."""
    shapes = iter(SHAPES * 4)
    fake.outage_s = 0.3
    fake.plan = lambda n, req: next(shapes, None) if n % 3 == 1 else None
    res = gen(smol_tiny_dir, data_file, tmp_path / "s", fake.url)
    assert res.exit_code == 0, res.output
    assert sorted(set(fake.shapes_sent)) == sorted(SHAPES)
    assert store_bytes(tmp_path / "s") == clean[0]
    # Each conversation's turn was answered once: the other requests are the faults' tries.
    assert len(fake.asked) - len(fake.shapes_sent) == N_ASKED and set(fake.asked) == set(clean[1])


# ---------------------------------------------------------------- outages


def test_an_outage_longer_than_the_backoff_cap_is_waited_out(fake, fast, clean, smol_tiny_dir, data_file, tmp_path):
    """The server goes away in the middle of shard 1 for 1.5 s (30 back-off caps) and comes back:
    rc 0, a line about the outage while it lasts and one when it ends, a store byte-identical."""
    fake.outage_s = 1.5
    fake.plan = lambda n, req: "down" if n == 16 else None
    t0 = time.monotonic()
    res = gen(smol_tiny_dir, data_file, tmp_path / "s", fake.url, "--endpoint-patience", "30s")
    assert res.exit_code == 0, res.output
    assert time.monotonic() - t0 >= 1.5
    waiting = [ln for ln in res.output.splitlines() if "no answer for" in ln]
    assert waiting and all(ln.startswith(f"{fake.url}: no answer for ") and "stops after 30 s without one "
                           "(--endpoint-patience)" in ln for ln in waiting), res.output
    assert "ConnectionRefusedError" in waiting[-1] or "Connection refused" in waiting[-1]
    assert any(ln.startswith(f"{fake.url}: answering again after ") for ln in res.output.splitlines())
    assert store_bytes(tmp_path / "s") == clean[0]
    assert set(fake.asked) == set(clean[1])


def test_an_outage_past_the_patience_stops_in_one_line_and_the_rerun_asks_only_for_the_rest(
        fake, fast, clean, smol_tiny_dir, data_file, tmp_path):
    out = tmp_path / "s"
    fake.outage_s = None  # down until told
    fake.plan = lambda n, req: "down" if n == 16 else None
    res = gen(smol_tiny_dir, data_file, out, fake.url, "--endpoint-patience", "1")
    assert res.exit_code == 1, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.output
    assert f"error: {fake.url}/chat/completions failed after " in errors[0]
    assert "(--endpoint-patience 1 s): URLError: " in errors[0]
    assert "answers of shard 1 received so far are kept in " in errors[0]
    assert errors[0].endswith("run the same command again to resume (only the unanswered turns are sent)")
    kept = answered_on_disk(out)
    assert (out / "regenerated" / "part-00001.journal").is_file() and journal_lines(out)
    assert len(kept) >= 12  # shard 0 and some of shard 1
    fake.up()
    fake.reset()
    fake.plan = None
    res = gen(smol_tiny_dir, data_file, out, fake.url)
    assert res.exit_code == 0, res.output
    assert "shard 1: " in res.output and "answers kept from an earlier run (part-00001.journal)" in res.output
    assert sorted(fake.asked) == sorted(set(clean[1]) - kept)  # nothing answered is asked again
    assert store_bytes(out) == clean[0]  # the journal folded into the part file, and gone


def test_a_full_disk_while_journaling_stops_in_one_line_and_the_rerun_resumes(
        fake, clean, smol_tiny_dir, data_file, tmp_path, monkeypatch):
    out = tmp_path / "s"
    real, calls = os.fsync, []

    def fsync(fd):  # the fifth answer of shard 1 meets a full disk
        if os.readlink(f"/proc/self/fd/{fd}").endswith("part-00001.journal"):
            calls.append(fd)
            if len(calls) == 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(answer_journal.os, "fsync", fsync)
    res = gen(smol_tiny_dir, data_file, out, fake.url)
    assert res.exit_code == 1, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: no space left on the device writing {out}/regenerated/part-00001.journal: free some "
                      "space (or choose another --out) and run the same command again; finished shards and "
                      "checkpoints are kept"], res.output
    monkeypatch.setattr(answer_journal.os, "fsync", real)
    kept = answered_on_disk(out)
    fake.reset()
    res = gen(smol_tiny_dir, data_file, out, fake.url)
    assert res.exit_code == 0, res.output
    assert sorted(fake.asked) == sorted(set(clean[1]) - kept)
    assert store_bytes(out) == clean[0]


def test_kill_9_mid_shard_then_the_rerun_buys_no_answer_twice(fake, clean, smol_tiny_dir, data_file, tmp_path):
    """gen-data in its own process is killed (SIGKILL) once shard 1's journal holds 3 answers; the
    rerun sends no request for a conversation turn answered before the kill and ends byte-identical."""
    out = tmp_path / "s"
    fake.delay = 0.05
    cmd = [sys.executable, "-m", "eagle3cli.cli", *args(smol_tiny_dir, data_file, out, fake.url)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    journal = out / "regenerated" / "part-00001.journal"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if journal.is_file() and journal.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (out / "regenerated" / "part-00000.jsonl").is_file() and journal.is_file()
    assert not (out / "regenerated" / "part-00001.jsonl").exists(), "the kill should land inside shard 1"
    kept = answered_on_disk(out)
    asked_before = set(fake.asked)
    fake.reset()
    fake.delay = 0.0
    res = gen(smol_tiny_dir, data_file, out, fake.url)
    assert res.exit_code == 0, res.output
    again = set(fake.asked) & kept
    assert not again, f"asked again after the kill: {sorted(again)}"
    assert sorted(fake.asked) == sorted(set(clean[1]) - kept)
    assert kept <= asked_before
    assert store_bytes(out) == clean[0]


# ---------------------------------------------------------------- load shedding


def test_429_and_503_lower_the_requests_in_flight_and_answers_raise_them_again(monkeypatch):
    monkeypatch.setattr(pacing, "SAY_EVERY", 0.0)
    said = []
    t = pacing.Throttle(8, say=said.append)
    stop = threading.Event()
    rounds = [t.acquire(stop) for _ in range(8)]
    assert t.in_flight == 8 and t.allowed == 8
    for r in rounds:  # the whole round refused: one halving, not eight
        t.release()
        t.overloaded(r, "HTTP 429")
    assert t.allowed == 4 and said == ["server busy (HTTP 429): 4 requests in flight now (--concurrency 8 again "
                                       "as it recovers)"]
    t.overloaded(t.acquire(stop), "HTTP 503")  # a request of the new round: halved again
    t.release()
    assert t.allowed == 2
    for _ in range(3):
        t.overloaded(t.acquire(stop), "HTTP 503")
        t.release()
    assert t.allowed == 1  # never below one
    grown = []
    for _ in range(40):
        t.acquire(stop)
        t.release()
        t.answered()
        grown.append(t.allowed)
    assert grown[0] == 2 and grown == sorted(grown) and grown[-1] == 8 and max(grown) == 8
    assert grown.index(8) == 27  # one more per round of answers: 1+2+...+7 answers to climb from 1 to 8
    busy = [t.acquire(stop) for _ in range(8)]
    assert t.in_flight == 8 == len(busy)
    blocked = threading.Thread(target=t.acquire, args=(stop,))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a ninth request waits for a slot"
    t.release()
    blocked.join(5)
    assert not blocked.is_alive()


def test_a_server_that_sheds_load_gets_fewer_requests_in_flight(fake, fast):
    """The server answers 429 whenever more than 2 requests are in flight; with --concurrency 8
    every conversation is still answered, and the limit came down."""
    fake.busy_above, fake.delay = 2, 0.02
    said = []
    ep = Endpoint(fake.url, concurrency=8, seed=0, say=said.append)
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(40)]
    results, stats = regenerate_endpoint(ep, convs, GenSettings())
    assert [r[-1]["content"] for r in results] == [f"echo: q{i} (1)" for i in range(40)]
    assert stats.answers == 40
    assert "429" in fake.shapes_sent and len(fake.asked) == 40 + len(fake.shapes_sent)
    assert [s for s in said if s.startswith("server busy (HTTP 429")][0].startswith(
        "server busy (HTTP 429: {\"error\": {\"message\": \"rate limited\"}}): 4 requests in flight now")


def test_retry_after_is_honoured(fake, fast):
    fake.retry_after = "1"
    fake.plan = lambda n, req: "429" if n == 0 else None
    ep = Endpoint(fake.url, concurrency=1, seed=0)
    regenerate_endpoint(ep, [[{"role": "user", "content": "hi"}]], GenSettings())
    assert len(fake.times) == 2 and fake.times[1] - fake.times[0] >= 0.95  # the cap alone is 0.05 s
    assert pacing.retry_after("120") == 120.0 and pacing.retry_after("soon") is None
    assert pacing.retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date past: no wait


def test_backoff_doubles_up_to_the_cap_with_jitter():
    rng = random.Random(0)
    waits = [pacing.backoff_delay(a, rng, first=0.5, cap=15.0) for a in range(12)]
    tops = [min(15.0, 0.5 * 2 ** a) for a in range(12)]
    assert all(t / 2 <= w <= t for w, t in zip(waits, tops))
    assert max(waits) <= 15.0 and len(set(waits)) == 12


# ---------------------------------------------------------------- the journal and the flag


def test_a_torn_last_line_is_cut_off_and_later_answers_append_cleanly(tmp_path):
    p = tmp_path / "part-00000.journal"
    j = AnswerJournal(p)
    j.add("k1", {"id": "c0", "turn": 0, "content": "a", "ended": True, "tokens": 1})
    j.close()
    with open(p, "ab") as f:
        f.write(b'{"key": "k2", "id": "c1", "tu')  # a kill in the middle of a write
    j = AnswerJournal(p)
    assert j.kept == 1 and j.get("k1")["content"] == "a" and j.get("k2") is None
    j.add("k3", {"id": "c2", "turn": 0, "rejected": "HTTP 400"})
    j.close()
    assert AnswerJournal(p).entries == {"k1": {"id": "c0", "turn": 0, "content": "a", "ended": True, "tokens": 1},
                                        "k3": {"id": "c2", "turn": 0, "rejected": "HTTP 400"}}
    AnswerJournal(p).remove()
    assert not p.exists()


def test_the_journal_answers_a_request_it_holds_without_the_server(fake, tmp_path):
    j = AnswerJournal(tmp_path / "part-00000.journal")
    ep = Endpoint(fake.url, concurrency=2)
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
              {"role": "user", "content": "more"}], [{"role": "user", "content": "TOO LONG"}]]
    first, stats = regenerate_endpoint(ep, convs, GenSettings(), journal=j, ids=["a", "b"])
    assert len(fake.asked) == 3 and len(j) == 3
    assert sorted((e["id"], e["turn"]) for e in j.entries.values()) == [("a", 0), ("a", 1), ("b", 0)]
    fake.reset()
    again, stats2 = regenerate_endpoint(ep, convs, GenSettings(), journal=AnswerJournal(j.path), ids=["a", "b"])
    assert fake.asked == [] and again == first and stats2 == stats
    # Another setting is another request: the journal does not answer it.
    regenerate_endpoint(ep, convs[:1], GenSettings(max_new_tokens=7), journal=AnswerJournal(j.path))
    assert fake.asked == [("hi", 0), ("hi", 1)]


def test_endpoint_patience_takes_seconds_or_minutes(tmp_path):
    assert [parse_duration(t, "--endpoint-patience") for t in ("90s", "10m", "10min", "1h", "45", " 2.5 M", 0)] == \
        [90.0, 600.0, 600.0, 3600.0, 45.0, 150.0, 0.0]
    for bad in ("soon", "-5s", "nan", "10 days"):
        with pytest.raises(OptionError, match=r"^--endpoint-patience (takes a duration|must be a duration)"):
            parse_duration(bad, "--endpoint-patience")
    o = GenDataOptions(out=tmp_path / "o", data="x.jsonl", endpoint="http://h/v1", endpoint_patience="2m")
    o.validate()
    assert o.endpoint_patience == 120.0 and GenDataOptions(data="x").endpoint_patience == 600.0
    res = CliRunner().invoke(app, ["gen-data", "-m", "x", "--dataset", "x.jsonl", "--endpoint", "http://h/v1",
                                   "--endpoint-patience", "soon", "--dry-run"], env={"COLUMNS": "500"})
    assert res.exit_code != 0 and "--endpoint-patience takes a duration such as 90s, 10m or 1h, got 'soon'" in \
        res.output


def test_conversation_of_reads_the_first_turn_and_the_turn_asked():
    assert conversation_of({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                                         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}) \
        == ("a", 1)
