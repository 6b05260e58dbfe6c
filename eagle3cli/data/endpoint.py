"""Regeneration through an OpenAI-compatible server (vLLM, SGLang, llama-server, behind a proxy or not).

Many conversations are in flight at once, each answering its user turns in order. A server that
fails is waited out: every try that fails for a reason worth another (the network, 429, 5xx, a
200 whose body is not a chat completion) is tried again with back-off for ``--endpoint-patience``
(endpoint_pacing), and 429/503 lower the number of requests in flight. Every answer is journaled
the moment it arrives (answer_journal), so a stop of any kind loses none of them. A request the
server refuses for good (a 4xx other than 429) skips its conversation, counted. Only the standard
library is used.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable

from ..core.errors import Eagle3Error
from . import endpoint_pacing as pacing
from .answer_journal import AnswerJournal, request_key
from .regenerate import GenSettings, RegenStats, prompt_turns, strip_meta


class EndpointError(Eagle3Error, RuntimeError):
    """The server failed for longer than the patience, or refuses every request (the run stops;
    a rerun resumes without asking again for the answers received)."""


class EndpointRejected(ValueError):
    """The server refused one request for good (a 4xx other than 401, 403, 404, 408, 425 and
    429): its conversation is skipped and counted."""


class Fault(Exception):
    """A failed try worth another: the server down, failing, overloaded or answering in a shape
    that is not a chat completion. ``retry_after``: the server's own wait, in seconds."""

    def __init__(self, what: str, retry_after: float | None = None, overloaded: bool = False):
        super().__init__(what)
        self.what, self.retry_after, self.overloaded = what, retry_after, overloaded


TRANSIENT_4XX = (408, 425, 429)  # request timeout, too early, too many requests: try again
FATAL_4XX = {401: "check --api-key (or OPENAI_API_KEY)", 403: "check --api-key (or OPENAI_API_KEY)",
             404: "check --endpoint (the server's URL up to /v1) and --endpoint-model"}


def chat_reply_problem(reply) -> str | None:
    """What makes a 200 reply not a chat completion (an error object, no or empty ``choices``, no
    ``message``), or None. Proxies and servers send these with a 200; they are retried like a 500."""
    if not isinstance(reply, dict):
        return f"a JSON {type(reply).__name__} instead of an object"
    err = reply.get("error")
    if err:
        msg = err.get("message") or err.get("type") or err if isinstance(err, dict) else err
        return f"an error object ({' '.join(str(msg).split())[:160]})"
    choices = reply.get("choices")
    if choices is None:
        return "no 'choices'"
    if not isinstance(choices, list) or not choices:
        return "empty 'choices'"
    first = choices[0]
    if not isinstance(first, dict) or not isinstance(first.get("message"), dict):
        return "no 'message' in its first choice"
    content = first["message"].get("content")
    if content is not None and not isinstance(content, str):
        return f"a 'content' that is a {type(content).__name__}, not text"
    return None


def models_reply_problem(reply) -> str | None:
    if not isinstance(reply, dict) or not isinstance(reply.get("data"), list):
        return "no 'data' list of models"
    return None


REPLY_CHECKS = {"/chat/completions": chat_reply_problem, "/models": models_reply_problem}


@dataclass
class Endpoint:
    """An OpenAI-compatible server, asked from many threads at once (``regenerate_endpoint``).

    A failed try (network error, 429, 5xx, 408, a 200 that is not a chat completion) is tried
    again after a back-off (endpoint_pacing) for ``patience`` seconds from the request's first
    fault, ``retries`` more times at most when given; then EndpointError. ``say`` prints the
    lines about an outage and about load shedding. ``concurrency`` is the ceiling of requests in
    flight; 429 and 503 lower the limit, answers raise it back (endpoint_pacing.Throttle).
    """

    url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 16
    retries: int | None = None
    timeout: float = 600.0
    patience: float = field(default_factory=lambda: pacing.DEFAULT_PATIENCE)
    say: Callable[[str], None] | None = field(default=None, repr=False)
    seed: int | None = field(default=None, repr=False)  # of the back-off jitter (tests)

    def __post_init__(self):
        self.throttle = pacing.Throttle(self.concurrency, self.say)
        self.health = pacing.Health(self.base, self.patience, self.say)
        self.stop = threading.Event()  # set when one request gave up: the others stop too
        self._rng = random.Random(self.seed)
        self._rng_lock = threading.Lock()

    @property
    def base(self) -> str:
        u = self.url.rstrip("/")
        for tail in ("/chat/completions", "/completions"):
            if u.endswith(tail):
                u = u[: -len(tail)]
        return u if u.endswith("/v1") else u + "/v1"

    def _once(self, url: str, data: bytes | None, headers: dict, check) -> dict:
        """One try: the reply, or Fault (worth another try), EndpointRejected or EndpointError."""
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            try:
                body = " ".join(e.read().decode("utf-8", "replace").split())[:200]
            except (OSError, http.client.HTTPException):
                body = ""
            what = f"HTTP {e.code}" + (f": {body}" if body else "")
            wait = pacing.retry_after(e.headers.get("Retry-After") if e.headers else None)
            if e.code in FATAL_4XX:
                raise EndpointError(f"{url} answers {what}: {FATAL_4XX[e.code]}") from None
            if 400 <= e.code < 500 and e.code not in TRANSIENT_4XX:
                raise EndpointRejected(what) from None
            raise Fault(what, wait, overloaded=e.code in (429, 503)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut
            reason = getattr(e, "reason", None) or e
            raise Fault(f"{type(e).__name__}: {reason}") from None
        try:
            reply = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            head = " ".join(raw[:80].decode("utf-8", "replace").split())
            raise Fault(f"a 200 reply that is not JSON ({head!r}{'...' if len(raw) > 80 else ''})") from None
        problem = check(reply) if check else None
        if problem:
            raise Fault(f"a 200 reply that is not {'a chat completion' if data is not None else 'a model list'}: "
                         f"{problem}")
        return reply

    def _request(self, path: str, payload: dict | None = None) -> dict:
        """The reply to one request, after as many tries as the patience allows (see the class)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode() if payload is not None else None
        url, check = self.base + path, REPLY_CHECKS.get(path)
        first_fault, tries = None, 0
        while True:
            if self.stop.is_set():
                raise pacing.Stopped
            sent_in = self.throttle.acquire(self.stop)
            tries += 1
            try:
                reply = self._once(url, data, headers, check)
            except Fault as fault:
                self.throttle.release()
                if fault.overloaded:
                    self.throttle.overloaded(sent_in, fault.what)
                self.health.fault(fault.what)
                now = time.monotonic()
                first_fault = now if first_fault is None else first_fault
                left = self.patience - (now - first_fault)
                if left <= 0 or (self.retries is not None and tries > self.retries):
                    raise EndpointError(f"{url} failed after {tries} tries in {pacing.duration(now - first_fault)}"
                                        f" (--endpoint-patience {pacing.duration(self.patience)}): "
                                        f"{fault.what}") from None
                with self._rng_lock:
                    wait = pacing.backoff_delay(tries - 1, self._rng)
                wait = min(max(wait, fault.retry_after or 0.0), left)
                if self.stop.wait(wait):
                    raise pacing.Stopped from None
                continue
            except BaseException:
                self.throttle.release()
                raise
            self.throttle.release()
            self.throttle.answered()
            self.health.ok()
            return reply

    def resolve_model(self) -> str:
        """The served model's name: given, or the first one the server lists."""
        if self.model:
            return self.model
        try:
            models = self._request("/models").get("data") or []
        except EndpointRejected as e:
            raise EndpointError(f"{self.base}/models answers {e}: check --endpoint, or name the model with "
                                "--endpoint-model") from None
        if not models or not isinstance(models[0], dict) or not models[0].get("id"):
            raise EndpointError(f"{self.base}/models lists no model; pass --endpoint-model")
        self.model = models[0]["id"]
        return self.model

    def chat_payload(self, messages: list[dict], settings: GenSettings, tools: list | None = None,
                     template_kwargs: dict | None = None) -> dict:
        """The request for one answer. ``template_kwargs`` go as ``chat_template_kwargs`` (vLLM and
        SGLang pass them to the chat template)."""
        payload = {"model": self.resolve_model(), "messages": messages, "max_tokens": settings.max_new_tokens,
                   "temperature": settings.temperature, "top_p": settings.top_p, "n": 1}
        if tools:
            payload["tools"] = tools
        if template_kwargs:
            payload["chat_template_kwargs"] = template_kwargs
        return payload

    def complete(self, payload: dict) -> tuple[str, bool, int]:
        """(answer, turn ended normally, completion tokens) for one chat request."""
        out = self._request("/chat/completions", payload)
        choice = out["choices"][0]
        msg = choice.get("message") or {}
        content = msg.get("content") or ""
        # Reasoning servers return the think block separately; put it back where the template expects it.
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        try:
            tokens = int((out.get("usage") or {}).get("completion_tokens") or 0)
        except (TypeError, ValueError, AttributeError):
            tokens = 0
        ended = choice.get("finish_reason") != "length"
        # A cut answer keeps its trailing whitespace: its last tokens are learned as they came.
        return (content.strip() if ended else content.lstrip()), ended, tokens

    def answer(self, messages: list[dict], settings: GenSettings, tools: list | None = None,
               template_kwargs: dict | None = None) -> tuple[str, bool, int]:
        """(answer, turn ended normally, completion tokens) for one chat turn."""
        return self.complete(self.chat_payload(messages, settings, tools, template_kwargs))


def regenerate_endpoint(endpoint: Endpoint, conversations: list[list[dict]], settings: GenSettings,
                        on_done: Callable[[int], None] | None = None, tools: list | None = None,
                        template_kwargs: dict | None = None, journal: AnswerJournal | None = None,
                        ids: list | None = None) -> tuple[list[list[dict] | None], RegenStats]:
    """Answer every user turn through the server, up to ``endpoint.concurrency`` conversations at once.

    A conversation the server refuses (a 4xx other than 429) comes back as None and is counted;
    a server that fails past the patience raises EndpointError. With a ``journal`` each answer and
    refusal is on disk as it arrives, and a request the journal already answered is not sent
    (``ids``: the conversations' ids, written beside the answers for a person reading it).
    ``on_done(i)``: conversation i is finished.
    """
    endpoint.resolve_model()
    tools = tools or [None] * len(conversations)

    def ask(i: int, k: int, payload: dict) -> tuple[str, bool, int]:
        """One answer: from the journal, else from the server (then journaled). EndpointRejected
        when the server refused it (now or in the run that journaled it)."""
        key = request_key(payload) if journal is not None else None
        entry = journal.get(key) if journal is not None else None
        if entry is None:
            where = {"id": ids[i] if ids else i, "turn": k}
            try:
                answer = endpoint.complete(payload)
            except EndpointRejected as e:
                if journal is not None:
                    journal.add(key, {**where, "rejected": str(e)})
                raise
            if journal is not None:
                journal.add(key, {**where, "content": answer[0], "ended": answer[1], "tokens": answer[2]})
            return answer
        if "rejected" in entry:
            raise EndpointRejected(entry["rejected"])
        return entry["content"], entry["ended"], entry["tokens"]

    def one(i: int):
        stats = RegenStats()
        system, users = prompt_turns(conversations[i])
        ctx = list(system)
        try:
            for k, u in enumerate(users):
                ctx.extend(u)
                payload = endpoint.chat_payload(strip_meta(ctx), settings, tools[i], template_kwargs)
                answer, ended, ntok = ask(i, k, payload)
                ctx.append({"role": "assistant", "content": answer} if ended else
                           {"role": "assistant", "content": answer, "finished": False})
                stats.answers += 1
                stats.generated_tokens += ntok
                if not ended:  # a cut answer ends the conversation (see regenerate_local)
                    stats.cut += 1
                    stats.dropped_turns += len(users) - k - 1
                    break
        except EndpointRejected as e:
            if not any(m["role"] == "assistant" for m in ctx):
                stats.rejected[i] = str(e)
                return None, stats
            del ctx[len(ctx) - len(users[k]):]  # keep the answered turns, drop the refused step
            stats.dropped_turns += len(users) - stats.answers
        if on_done:
            on_done(i)
        return ctx, stats

    results = run_all(endpoint, one, len(conversations))
    total = RegenStats()
    for _, s in results:
        total.add(s)
    return [r for r, _ in results], total


def run_all(endpoint: Endpoint, one: Callable[[int], object], n: int) -> list:
    """[one(0), ..., one(n - 1)], up to ``endpoint.concurrency`` at once. The first failure stops
    the others (their requests in flight end and are journaled) and is raised."""
    results: list = [None] * n
    failure: BaseException | None = None
    endpoint.stop.clear()
    pool = ThreadPoolExecutor(max_workers=max(1, min(endpoint.concurrency, n)))
    try:
        futures = {pool.submit(one, i): i for i in range(n)}
        for fut in as_completed(futures):
            try:
                results[futures[fut]] = fut.result()
            except pacing.Stopped:
                pass
            except BaseException as e:  # the first failure stops the others; their answers are journaled
                if failure is None:
                    failure = e
                    endpoint.stop.set()
                    for other in futures:
                        other.cancel()
    except BaseException:  # Ctrl-C: let the requests in flight end, keep what they bring
        endpoint.stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if failure is not None:
        raise failure
    return results
