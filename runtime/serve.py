"""Server mode: a rollout engine behind an OpenAI-compatible endpoint, for agent harnesses.

Each trajectory gets a base URL of its own, ``http://127.0.0.1:PORT/t/TID/v1``, which any OpenAI
client takes (``OpenAI(base_url=…, api_key="flowc")``); ``POST …/chat/completions`` and
``POST …/completions`` are served by the engine of the replica, and every token served is recorded
for the trajectory, so flowc trains on exactly what the harness was given:

* the first request's prompt — chat ``messages`` rendered by the model's own chat template with
  the generation prompt, or a completions ``prompt`` (text, or token ids: token-in) — is the
  trajectory's prompt;
* each completion is the policy's tokens, as sampled;
* a later request must extend what was served so far: token ids that start with the trajectory's
  tokens, or a text (a chat rendered by the template, or a completions prompt) that starts with the
  text served so far; what it adds (a tool's answer, the next user message) is the environment's
  tokens, encoded once. A request that rewrites the past is refused (HTTP 400, the reason in the
  message): the tokens trained would not be the tokens served.

The run's sampling decides (temperature, top-p, …: the harness's own values are ignored — the
policy's log-probabilities must be of the distribution it sampled from); ``max_tokens`` /
``max_completion_tokens`` are honoured up to the turn's limit and the trajectory's budget.
Responses carry what vLLM's server carries beside OpenAI's fields: ``prompt_token_ids`` and, per
choice, ``token_ids``; ``logprobs`` when asked.

The HTTP threads only queue requests (:class:`Request`); the agent loop (:func:`flowc.runtime.agent.run_harnesses`)
takes them, runs them on the engine and answers, so the engine is driven from one thread.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = re.compile(r"^/t/(\d+)/v1/(chat/completions|completions)$")
REPLY_TIMEOUT_S = 3600.0


@dataclass
class Request:
    """One HTTP request waiting for the agent loop: its trajectory, endpoint, body, and the answer."""

    tid: int
    kind: str  # "chat/completions" or "completions"
    body: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    reply: dict[str, Any] | None = None

    def answer(self, status: int, reply: dict[str, Any]) -> None:
        self.status, self.reply = status, reply
        self.done.set()


class TrajectoryServer:
    """The HTTP endpoint of one rollout engine, on ``host`` (loopback unless asked), a free port."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: queue.Queue[Request] = queue.Queue()
        incoming = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                m = PATH.match(self.path.split("?")[0])
                if m is None:
                    return self._send(404, {"error": {"message": f"no endpoint {self.path}", "type": "not_found"}})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                except ValueError as e:
                    return self._send(400, {"error": {"message": f"the body is not JSON: {e}", "type": "invalid_request_error"}})
                req = Request(int(m.group(1)), m.group(2), body)
                incoming.put(req)
                if not req.done.wait(REPLY_TIMEOUT_S):
                    return self._send(504, {"error": {"message": "the engine did not answer", "type": "timeout"}})
                self._send(req.status, req.reply or {})

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/v1/models"):
                    return self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "flowc"}]})
                self._send(404, {"error": {"message": f"no endpoint {self.path}", "type": "not_found"}})

            def _send(self, status: int, doc: dict[str, Any]) -> None:
                blob = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(blob)))
                self.end_headers()
                self.wfile.write(blob)

            def log_message(self, *args: Any) -> None:  # the run's console is not an access log
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 4096  # every trajectory of a rollout may connect at once (the default backlog is 5)

        self.httpd = Server((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="flowc-serve", daemon=True)
        self.thread.start()

    def base_url(self, tid: int) -> str:
        return f"{self.url}/t/{tid}/v1"

    def take(self, wait_s: float = 0.0) -> list[Request]:
        """The requests that arrived (waiting up to ``wait_s`` for the first)."""
        out = []
        try:
            out.append(self.requests.get(timeout=wait_s) if wait_s > 0 else self.requests.get_nowait())
            while True:
                out.append(self.requests.get_nowait())
        except queue.Empty:
            return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Refused(Exception):
    """A request that cannot be served for its trajectory (answered 400 with this message)."""


def render(tok: Any, req: Request) -> tuple[str | None, list[int] | None]:
    """The request's prompt: (text, None), or (None, token ids) for a token-in completions request."""
    if req.kind == "chat/completions":
        messages = req.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused("chat/completions needs messages")
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), None
        except Exception as e:
            raise Refused(f"the model's chat template cannot render these messages: {type(e).__name__}: {e}") from None
    prompt = req.body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return None, list(prompt)
    if isinstance(prompt, str) and prompt:
        return prompt, None
    raise Refused("completions needs a prompt: a string or a list of token ids (one prompt per request)")


def max_tokens_of(req: Request) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = req.body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def completion(
    req: Request, tok: Any, prompt_ids: list[int], ids: list[int], lps: list[float], finish: str, eos: set[int]
) -> dict[str, Any]:
    """The OpenAI-format answer of a served turn (with vLLM's ``token_ids`` extras)."""
    text = tok.decode([i for i in ids if i not in eos], skip_special_tokens=False)
    want_lps = bool(req.body.get("logprobs"))
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids] if want_lps else []
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)}
    base = {"id": f"flowc-{req.tid}-{time.monotonic_ns()}", "created": int(time.time()), "model": req.body.get("model", "policy")}
    if req.kind == "chat/completions":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        if want_lps:
            choice["logprobs"] = {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, lps, strict=True)
                ]
            }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if want_lps:
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": []}
        obj = "text_completion"
    choice["token_ids"] = ids
    return {**base, "object": obj, "choices": [choice], "usage": usage, "prompt_token_ids": prompt_ids}


def error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}
