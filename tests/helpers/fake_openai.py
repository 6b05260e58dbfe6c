"""A deterministic OpenAI-compatible server on 127.0.0.1 that fails on request, for gen-data --endpoint.

It answers every chat request with ``echo: <last user turn> (<messages in the request>)``, the
same on every run, so that a store regenerated through faults can be compared byte for byte
with one regenerated through a clean server. ``plan(n, request)`` (n counts the chat requests
from 0) picks what request n gets: None (the answer) or a fault shape of :data:`SHAPES`; the
shape ``down`` closes the listening socket (connection refused) for ``outage_s`` seconds, or
until :meth:`FakeOpenAI.up` with ``outage_s=None``. A user turn containing ``TOO LONG`` is
refused for good (HTTP 400). ``asked`` lists the (conversation, turn) of every chat request.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SHAPES = ("500", "429", "503html", "drop", "cut", "bad_json", "error200", "empty_choices", "no_choices",
          "no_message", "not_json", "down")


def conversation_of(request: dict) -> tuple[str, int]:
    """(the first user turn, the turn asked for from 0): what a chat request asks."""
    users = [m["content"] for m in request["messages"] if m["role"] == "user"]
    return users[0], len(users) - 1


class FakeOpenAI:
    def __init__(self):
        self.lock = threading.Lock()
        self.plan = None  # (n, request) -> a shape of SHAPES or None
        self.delay = 0.0  # seconds before each answer
        self.outage_s: float | None = 1.0
        self.retry_after: str | None = "0"  # the header of a 429
        self.busy_above: int | None = None  # 429 while more requests than this are in flight
        self.reset()
        self.port = 0
        self.server = None
        self.up()

    def reset(self):
        with self.lock:
            self.n = 0
            self.asked: list[tuple[str, int]] = []
            self.times: list[float] = []  # when each chat request arrived (time.monotonic)
            self.shapes_sent: list[str] = []
            self.in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def up(self):
        if self.server is not None:
            return
        owner = self

        class Handler(_Handler):
            fake = owner

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.server = server

    def down(self, seconds: float | None):
        """Close the listening socket (requests are refused); open it again after ``seconds``."""
        server, self.server = self.server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if seconds is not None:
            timer = threading.Timer(seconds, self.up)
            timer.daemon = True
            timer.start()

    def close(self):
        self.down(None)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAI
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json", headers: dict | None = None,
              length: int | None = None):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _json(self, code: int, obj, headers: dict | None = None):
        self._send(code, json.dumps(obj).encode(), headers=headers)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": "fake-target", "object": "model"}]})
        self._json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        fake = self.fake
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        with fake.lock:
            n = fake.n
            fake.n += 1
            fake.asked.append(conversation_of(req))
            fake.times.append(time.monotonic())
            fake.in_flight += 1
            busy = fake.busy_above is not None and fake.in_flight > fake.busy_above
        try:
            shape = "429" if busy else (fake.plan(n, req) if fake.plan else None)
            if fake.delay:
                time.sleep(fake.delay)
            if shape:
                with fake.lock:
                    fake.shapes_sent.append(shape)
                return self._fault(shape)
            last = req["messages"][-1]["content"]
            if "TOO LONG" in last:
                return self._json(400, {"error": {"message": "context length exceeded"}})
            self._json(200, {"id": f"chatcmpl-{n}", "object": "chat.completion", "model": req["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant",
                                                      "content": f"echo: {last} ({len(req['messages'])})"}}],
                             "usage": {"completion_tokens": 5}})
        finally:
            with fake.lock:
                fake.in_flight -= 1

    def _fault(self, shape: str):
        ok = json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}]})
        if shape == "500":
            self._json(500, {"error": {"message": "internal error"}})
        elif shape == "429":
            self._json(429, {"error": {"message": "rate limited"}},
                       headers={"Retry-After": self.fake.retry_after} if self.fake.retry_after else None)
        elif shape == "503html":
            self._send(503, b"<html><body><h1>503 Service Unavailable</h1></body></html>", "text/html")
        elif shape == "drop":  # the connection closes without a reply
            self.close_connection = True
        elif shape == "cut":  # the body ends before its Content-Length
            self._send(200, ok.encode()[:20], length=len(ok))
        elif shape == "bad_json":  # a body cut short and sent as whole
            self._send(200, ok.encode()[:20])
        elif shape == "error200":
            self._json(200, {"error": {"message": "upstream timed out", "type": "server_error", "code": 504}})
        elif shape == "empty_choices":
            self._json(200, {"id": "x", "object": "chat.completion", "choices": []})
        elif shape == "no_choices":
            self._json(200, {"id": "x", "object": "chat.completion"})
        elif shape == "no_message":
            self._json(200, {"id": "x", "choices": [{"index": 0, "finish_reason": "stop"}]})
        elif shape == "not_json":
            self._send(200, b"<html>gateway ok</html>", "text/html")
        elif shape == "down":  # the server goes away mid-request
            self.close_connection = True
            threading.Thread(target=self.fake.down, args=(self.fake.outage_s,), daemon=True).start()
        else:
            raise ValueError(shape)
