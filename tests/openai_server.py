"""A standard-library OpenAI-compatible server on loopback, for tests that run the real regeneration client.

Speaks the subset vLLM and SGLang serve: `GET /v1/models`, `POST /v1/completions` (prompt as token ids or
text) and `POST /v1/chat/completions`. Each prompt's answer is a fixed function of the prompt (`answer`), so
tests know what the client must write. A prompt is identified by its key: the token ids joined by commas
(completions) or the last message's content (chat).

Scripted failures: `plan[key]` is a list of actions, one consumed per request for that prompt, then "ok":
"429" (with `Retry-After: 0`), "500", "503", "400", "slow" (answers after `slow_seconds`, past the client's
timeout), "garbage" (200 with a body that is not JSON), "empty" (200 with no choices). `finish[key]` sets a
finish reason other than "stop". `delay` slows every answer (so a test can kill a client mid-run).
Every request is logged as (path, key); the last request body is kept.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer(key: str) -> str:
    """The completion text of a prompt: depends on the prompt only."""
    return "re " + key.replace(",", "")[::-1][:10]


class OpenAIServer:
    def __init__(self, models: tuple[str, ...] = ("tiny",), delay: float = 0.0, slow_seconds: float = 2.0):
        self.models, self.delay, self.slow_seconds = models, delay, slow_seconds
        self.plan: dict[str, list[str]] = {}
        self.finish: dict[str, str] = {}
        self.log: list[tuple[str, str]] = []
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"server_state": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> OpenAIServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def action(self, path: str, key: str, body: dict) -> str:
        with self.lock:
            self.log.append((path, key))
            self.bodies.append(body)
            todo = self.plan.get(key)
            return todo.pop(0) if todo else "ok"

    def requests_for(self, key: str) -> int:
        return sum(1 for _, k in self.log if k == key)


class _Handler(BaseHTTPRequestHandler):
    server_state: OpenAIServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - no stderr logging
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout): fine
            pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            return self._send(404, b'{"error": "not found"}')
        data = [{"id": m, "object": "model"} for m in self.server_state.models]
        self._send(200, json.dumps({"object": "list", "data": data}).encode())

    def do_POST(self) -> None:
        st = self.server_state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self._send(404, b'{"error": "not found"}')
        prompt = body.get("prompt")
        key = (
            body["messages"][-1]["content"]
            if chat
            else ",".join(map(str, prompt))
            if isinstance(prompt, list)
            else prompt
        )
        what = st.action(self.path, key, body)
        time.sleep(st.delay)
        if what == "slow":
            time.sleep(st.slow_seconds)
        elif what in ("429", "500", "503", "400"):
            return self._send(
                int(what), b'{"error": "scripted"}', {"Retry-After": "0"} if what == "429" else None
            )
        elif what == "garbage":
            return self._send(200, b"<html>oops</html>")
        elif what == "empty":
            return self._send(200, b'{"choices": []}')
        if body.get("model") not in st.models:
            return self._send(404, json.dumps({"error": f"model {body.get('model')} not served"}).encode())
        text, finish = answer(key), st.finish.get(key, "stop")
        choice = {"index": 0, "finish_reason": finish, "stop_reason": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        self._send(200, json.dumps({"id": "x", "object": "completion", "choices": [choice]}).encode())
