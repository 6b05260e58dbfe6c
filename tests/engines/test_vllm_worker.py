"""The request loop both vLLM workers run (eagle3cli.engines.vllm_worker), with a stand-in engine."""

import io
import json

from eagle3cli.engines import vllm_worker


class Engine:
    """Just what the loop touches: llm.llm_engine.engine_core.shutdown()."""

    def __init__(self):
        self.stopped = 0
        self.llm_engine = self
        self.engine_core = self

    def shutdown(self):
        self.stopped += 1


def run(requests, start=None, handle=None):
    engine, reply = Engine(), io.StringIO()
    rc = vllm_worker.loop(reply, start or (lambda: (engine, {"dtype": "float32"})),
                          handle or (lambda llm, req: {"echo": req["x"] * 2}), requests=requests)
    return rc, [json.loads(line) for line in reply.getvalue().splitlines()], engine


def test_ready_then_one_reply_per_request_until_exit():
    reqs = ['{"op": "go", "x": 1}\n', "\n", '{"op": "go", "x": 5}\n', '{"op": "exit"}\n', '{"op": "go", "x": 9}\n']
    rc, replies, engine = run(reqs)
    assert rc == 0 and engine.stopped == 1
    assert replies[0]["ok"] and replies[0]["ready"] and replies[0]["dtype"] == "float32"
    assert isinstance(replies[0]["startup_s"], float)
    assert replies[1:] == [{"ok": True, "echo": 2}, {"ok": True, "echo": 10}]  # nothing after exit


def test_a_failed_request_is_one_line_and_the_next_is_served():
    def handle(llm, req):
        if req["x"] == 0:
            raise ValueError("bad\n  request\nspanning lines")
        return {"echo": req["x"]}

    rc, replies, _ = run(['{"x": 0}', '{"x": 3}'], handle=handle)
    assert rc == 0
    assert replies[1:] == [{"ok": False, "error": "ValueError: bad request spanning lines"}, {"ok": True, "echo": 3}]


def test_an_engine_that_does_not_start_is_reported_and_exits_2():
    def start():
        raise RuntimeError("Model does not support EAGLE3 interface " + "x" * 2000)

    rc, replies, _ = run(['{"x": 1}'], start=start)
    assert rc == 2 and len(replies) == 1 and replies[0]["ok"] is False
    assert replies[0]["error"].startswith("vLLM did not start: RuntimeError: Model does not support EAGLE3")
    assert len(replies[0]["error"]) <= len("vLLM did not start: ") + 600
