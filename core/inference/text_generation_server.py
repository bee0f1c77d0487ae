"""Megatron's REST interface (``megatron/inference/text_generation_server.py``) over the standard
library's HTTP server.

``PUT /api`` (``POST`` too) with a JSON object: ``prompts`` (a non-empty list of strings, at
most :data:`MAX_PROMPTS`), and optionally ``tokens_to_generate`` (default 64; 0 scores the
prompts), ``temperature`` (default 1.0; 0 is greedy), ``top_k`` (0), ``top_p`` (0.0: no
nucleus filtering), ``logprobs`` (false), ``random_seed`` (0), ``add_BOS`` (false),
``stop_token`` (an id or a token's text, or a list of them; the end-of-document token always
stops). The answer: ``{"text": [...], "segments": [[...]], "logprobs": [[...]] or null}``. A bad
request gets HTTP 400 with ``{"error": "..."}``; the server keeps serving.

Rank 0 serves. Requests run one at a time: rank 0 validates and tokenizes a request, then sends
it to every other rank (``MPI_Bcast``), and every rank runs the engine on it together; the other
ranks wait for the next one (polling a non-blocking broadcast, so an idle rank takes no core).
SIGTERM or SIGINT on rank 0 ends the server: the other ranks are told, and every rank returns.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from core.inference.text_generation import (
    PreparedRequest,
    TextGenerationError,
    execute,
    megatron_response,
    prepare,
    text_results,
)

MAX_PROMPTS = 128
"""Prompts per request (Megatron's limit)."""
MAX_BODY_BYTES = 16 * 2**20
"""The largest request body read."""
DEFAULT_TOKENS_TO_GENERATE = 64
"""``tokens_to_generate`` when a request leaves it out (Megatron's default)."""
_POLL_S = 0.02


class RequestError(ValueError):
    """A request the server answers with 400."""


@dataclasses.dataclass
class GenerationService:
    """What a request needs: the engine, the tokenizer, the BOS id, the stop ids every request has."""

    engine: Any
    tokenizer: Any
    bos: int | None = None
    default_stop: tuple[int, ...] = ()

    def parse(self, body: bytes) -> PreparedRequest:
        """A request body as a :class:`PreparedRequest` (rank 0); :class:`RequestError` with one line."""
        try:
            request = json.loads(body.decode("utf-8") if body else "")
        except (UnicodeDecodeError, ValueError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None
        if not isinstance(request, dict):
            raise RequestError(f"the request must be a JSON object, got a {type(request).__name__}")
        if "prompts" not in request:
            raise RequestError("prompts argument required")
        prompts = request["prompts"]
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise RequestError("prompts must be a list of strings")
        if not prompts:
            raise RequestError("prompts is empty")
        if len(prompts) > MAX_PROMPTS:
            raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        tokens = _field(request, "tokens_to_generate", int, DEFAULT_TOKENS_TO_GENERATE)
        temperature = _field(request, "temperature", float, 1.0)
        if not 0.0 <= temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100] (0: greedy), got {temperature}")
        top_k = _field(request, "top_k", int, 0)
        if not 0 <= top_k <= 1000:
            raise RequestError(f"top_k must be in [0, 1000] (0: no top-k), got {top_k}")
        top_p = _field(request, "top_p", float, 0.0)
        if not 0.0 <= top_p <= 1.0:
            raise RequestError(f"top_p must be in [0, 1] (0: no nucleus filtering), got {top_p}")
        stops = request.get("stop_token", [])
        stops = stops if isinstance(stops, list) else [stops]
        engine = self.engine
        try:
            return prepare(self.tokenizer, prompts, tokens_to_generate=tokens, max_length=engine.max_sequence_length,
                           vocab_size=engine.config.vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=_field(request, "random_seed", int, 0), logprobs=_field(request, "logprobs", bool,
                                                                                         False),
                           add_bos=_field(request, "add_BOS", bool, False), bos=self.bos, stop_tokens=stops,
                           default_stop=self.default_stop)
        except TextGenerationError as e:
            raise RequestError(str(e)) from None

    def run(self, request: PreparedRequest) -> list:
        """The engine's results (every rank, together)."""
        return execute(self.engine, request)

    def respond(self, request: PreparedRequest, results: list) -> dict:
        """Megatron's answer (rank 0)."""
        return megatron_response(text_results(self.tokenizer, request, results), request.logprobs)


def _field(request: dict, name: str, kind: type, default: Any) -> Any:
    """``request[name]`` checked to be a ``kind`` (an int is a float; a bool is neither)."""
    if name not in request:
        return default
    value = request[name]
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, int | float) if kind is float else isinstance(value, int)) and not isinstance(value, bool)
    if not ok:
        what = {bool: "a boolean", int: "an integer", float: "a number"}[kind]
        raise RequestError(f"{name} must be {what}, got {json.dumps(value)}")
    return float(value) if kind is float else value


class _Slot:
    """Where the main loop leaves one request's answer for the handler thread waiting on it."""

    def __init__(self):
        self.done = threading.Event()
        self.status, self.body = 500, {"error": "the server stopped before answering"}

    def answer(self, status: int, body: dict) -> None:
        self.status, self.body = status, body
        self.done.set()


class _Broadcast:
    """Rank 0's messages to the other ranks: a length through a non-blocking broadcast (the
    waiting ranks poll it and sleep), then the pickled message."""

    def __init__(self, comm: Any):
        self.comm = comm

    def send(self, message: Any) -> None:
        payload = np.frombuffer(pickle.dumps(message), np.uint8)
        self.comm.Ibcast(np.array([payload.size], np.int64), root=0).Wait()
        self.comm.Bcast(payload.copy(), root=0)

    def receive(self) -> Any:
        size = np.zeros(1, np.int64)
        pending = self.comm.Ibcast(size, root=0)
        while not pending.Test():
            time.sleep(_POLL_S)
        payload = np.empty(int(size[0]), np.uint8)
        self.comm.Bcast(payload, root=0)
        return pickle.loads(payload.tobytes())


def _handler(work: queue.Queue, service: GenerationService, log: Callable[[str], None]) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/api":
                self._send(404, {"error": f"no such endpoint {self.path}: PUT /api"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True
                self._send(400, {"error": f"Content-Length must be 0..{MAX_BODY_BYTES} bytes"})
                return
            body = self.rfile.read(length)
            try:
                request = service.parse(body)
            except RequestError as e:
                self._send(400, {"error": str(e)})
                return
            slot = _Slot()
            work.put((request, slot))
            slot.done.wait()
            self._send(slot.status, slot.body)

        do_POST = do_PUT  # noqa: N815

        def do_GET(self) -> None:  # noqa: N802
            self._send(405, {"error": "PUT /api with a JSON body (Megatron's text generation interface)"})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            log(f"> {self.address_string()} {format % args}")

    return Handler


def serve(service: GenerationService, port: int, host: str = "127.0.0.1", comm: Any = None,
          log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
          ready: Callable[[int], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT (rank 0); the other ranks (``comm``'s ranks but 0) run
    every request with it until rank 0 stops. ``ready(port)`` is called once listening (port
    0 picks a free one). Returns 0."""
    rank = 0 if comm is None else comm.Get_rank()
    channel = _Broadcast(comm) if comm is not None and comm.Get_size() > 1 else None
    if rank != 0:
        return _follow(service, channel)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    work: queue.Queue = queue.Queue()
    server = ThreadingHTTPServer((host, port), _handler(work, service, log))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="http-server", daemon=True)
    thread.start()
    try:
        if ready is not None:
            ready(server.server_address[1])
        while not stop.is_set():
            try:
                request, slot = work.get(timeout=0.2)
            except queue.Empty:
                continue
            if channel is not None:
                channel.send(("run", request))
            try:
                slot.answer(200, service.respond(request, service.run(request)))
            except (RequestError, ValueError) as e:  # the engine's one-line refusals, the same on every rank
                slot.answer(400, {"error": " ".join(str(e).split())})
            except Exception as e:  # noqa: BLE001 (an unexpected failure: answered, the server goes on)
                slot.answer(500, {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"})
    finally:
        server.shutdown()
        server.server_close()
        while not work.empty():
            work.get_nowait()[1].answer(503, {"error": "the server is shutting down"})
        if channel is not None:
            channel.send(("stop", None))
        for s, handler in previous.items():
            signal.signal(s, handler)
    log("> server stopped")
    return 0


def _follow(service: GenerationService, channel: _Broadcast) -> int:
    """A rank other than 0: run each request rank 0 sends until it says stop."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}  # rank 0 decides
    try:
        while True:
            kind, request = channel.receive()
            if kind == "stop":
                return 0
            try:
                service.run(request)
            except Exception:  # noqa: BLE001 (rank 0 meets the same error and answers it)
                pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = ["DEFAULT_TOKENS_TO_GENERATE", "MAX_PROMPTS", "GenerationService", "RequestError", "serve"]
