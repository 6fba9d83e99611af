"""The simulator's HTTP server and lifecycle: trio streams with h11 driven by hand.

Why not an ASGI stack: each streamed token here is one wait on the request's own parking lot,
unparked by the capacity model's step loop (:mod:`agent.engines.sim.engine`) when a step produced
its token, and one write of a pre-built chunk, and nothing else, which is what lets two cores
carry hundreds of concurrent streams for router benchmarks (about 70 us of CPU per token on the
development machine, most of it the write system call). HTTP/1.1 keep-alive comes with h11's
cycle (``start_next_cycle``).

Client disconnects are detected while a response is being produced, not only when a write fails:
a watcher reads the connection during generation and treats end-of-file as the client going away,
cancelling the generation at once (a real engine frees the sequence's KV blocks the same way). Such
a request counts in ``llmgw_sim_requests_cancelled_total``, so a test can check that a router's
client disconnect reached the engine.

Lifecycle (all printed to stdout, which the agent sends to the shard's log file): "loading model",
"ready on port N" once /health turns 200, and on SIGTERM: stop accepting, /health 503, let in-flight
requests finish for up to ``--shutdown-timeout`` seconds (vLLM's semantics: 0 aborts them), exit 0.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import attrs
import h11
import trio

from agent.engines.sim import generate
from agent.engines.sim.config import SimConfig
from agent.engines.sim.engine import EngineLoop, Ticket
from agent.engines.sim.scheduler import Request
from agent.engines.sim.tracing import EngineTracing
from telemetry.tracing import TracingSettingsError

MAX_BODY_BYTES = 16 * 1024 * 1024
RECEIVE_SIZE = 65536


@attrs.define
class Stats:
    """Counters for /metrics; one instance per server, mutated only from the server's tasks."""

    requests_total: dict[str, int] = attrs.Factory(dict)
    running: int = 0
    cancelled: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0

    def exposition(self, model: str, engine: list[str]) -> bytes:
        """Our counters, then vLLM's (``engine``: the capacity model's, from EngineLoop)."""
        label = json.dumps(model)
        lines = [
            "# HELP llmgw_sim_requests_total Completion requests received, by endpoint.",
            "# TYPE llmgw_sim_requests_total counter",
        ]
        for endpoint in ("/v1/chat/completions", "/v1/completions"):
            count = self.requests_total.get(endpoint, 0)
            lines.append(f'llmgw_sim_requests_total{{endpoint="{endpoint}"}} {count}')
        lines += [
            "# HELP llmgw_sim_requests_running Requests being generated now.",
            "# TYPE llmgw_sim_requests_running gauge",
            f"llmgw_sim_requests_running {self.running}",
            "# HELP llmgw_sim_requests_cancelled_total Requests whose client went away before the end.",
            "# TYPE llmgw_sim_requests_cancelled_total counter",
            f"llmgw_sim_requests_cancelled_total {self.cancelled}",
            "# HELP llmgw_sim_tokens_generated_total Completion tokens sent.",
            "# TYPE llmgw_sim_tokens_generated_total counter",
            f"llmgw_sim_tokens_generated_total {self.tokens_generated}",
            "# HELP llmgw_sim_prompt_tokens_total Prompt tokens received.",
            "# TYPE llmgw_sim_prompt_tokens_total counter",
            f"llmgw_sim_prompt_tokens_total {self.prompt_tokens}",
            # vLLM's names, so what reads vLLM's /metrics can read the simulator's.
            *engine,
            "# TYPE vllm:generation_tokens counter",
            f'vllm:generation_tokens_total{{model_name={label},engine="0"}} {self.tokens_generated}',
            "# TYPE vllm:prompt_tokens counter",
            f'vllm:prompt_tokens_total{{model_name={label},engine="0"}} {self.prompt_tokens}',
        ]
        return ("\n".join(lines) + "\n").encode()


class ClientGone(Exception):
    """The client closed the connection while its response was being produced."""


def _out(conn: h11.Connection, event: h11.Event) -> bytes:
    data = conn.send(event)
    assert data is not None  # only ConnectionClosed yields None, and we never send it
    return data


async def _write(stream: trio.SocketStream, data: bytes) -> None:
    """``send_all`` without its two scheduler round trips when the kernel takes the bytes at once,
    which it does for small SSE events on a healthy connection; the rest goes through send_all.
    The caller supplies the cancellation checkpoint (the wait for the token)."""
    try:
        sent = os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:  # EPIPE, ECONNRESET, EBADF after close
        raise trio.BrokenResourceError(f"client connection lost: {exc}") from exc
    if sent < len(data):
        await stream.send_all(data[sent:])


class Log:
    """Lines to stdout, which the agent points at the shard's log file."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} sim: {message}", file=self._out, flush=True)


class SimServer:
    """One simulated engine: its state ("loading", "ready", "draining"), its counters, its HTTP."""

    def __init__(self, config: SimConfig, log: Log, environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.log = log
        self.stats = Stats()
        self.state = "loading"
        self.port = 0
        self.started = int(time.time())
        self._inflight = 0
        self._idle = trio.Event()
        self._idle.set()
        self.engine = EngineLoop(config, log, os.environ if environ is None else environ)
        #: vLLM's request spans (--otlp-traces-endpoint); None: not traced.
        self.tracing: EngineTracing | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def load(self, stop: trio.CancelScope, outcome: list[int]) -> None:
        """Pretend to load the model; fail or hang there if a knob says so."""
        c = self.config
        self.log(
            f"loading model {c.model} (served as {', '.join(c.served_model_names)}; "
            f"tp={c.tensor_parallel_size} pp={c.pipeline_parallel_size} dtype={c.dtype}"
            f"{' quantization=' + c.quantization if c.quantization else ''} "
            f"max_model_len={c.max_model_len}; simulated, {c.load_seconds:g}s)"
        )
        if c.fail_loading:
            await trio.sleep(c.load_seconds / 2)
            self.log(f"loading weights for {c.model}: 50% ...")
            print(f"ERROR {c.fail_loading}", file=sys.stderr, flush=True)
            self.log(f"engine failed to start: {c.fail_loading}")
            outcome.append(1)
            stop.cancel()
            return
        if "loading" in c.hang:
            self.log("hanging while loading (LLMGW_SIM_HANG=loading): /health stays 503")
            await trio.sleep_forever()
        await trio.sleep(c.load_seconds)
        if self.state == "loading":
            self.state = "ready"
            if c.headless:
                self.log(
                    f"headless worker rank {c.node_rank} of {c.nnodes} joined "
                    f"{c.master_addr}:{c.master_port}; no API server on this rank"
                )
            else:
                self.log(f"ready on port {self.port}")

    async def crash_after(self, stop: trio.CancelScope, outcome: list[int]) -> None:
        await trio.sleep(self.config.exit_after)
        self.log(
            f"simulated crash after {self.config.exit_after:g}s "
            f"(LLMGW_SIM_EXIT_AFTER), exit code {self.config.exit_code}"
        )
        outcome.append(self.config.exit_code)
        stop.cancel()

    async def drain(self, grace: float) -> None:
        """Stop taking requests and wait up to ``grace`` seconds for in-flight ones."""
        self.state = "draining"
        if self._inflight:
            self.log(f"draining {self._inflight} in-flight request(s) for up to {grace:g}s")
            with trio.move_on_after(grace):
                await self._idle.wait()
            if self._inflight:
                self.log(f"aborting {self._inflight} request(s) still running")

    # -- connections ---------------------------------------------------------------------------

    async def serve_listeners(self, listeners: list[trio.SocketListener], connections: trio.Nursery) -> None:
        """Accept until cancelled. Connections live in ``connections``, not under this task, so
        that closing the listeners on SIGTERM leaves in-flight requests running to drain."""
        await trio.serve_listeners(self.handle_connection, listeners, handler_nursery=connections)

    async def handle_connection(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
            client = f"{peer[0]}:{peer[1]}"
        except OSError:
            client = "?"
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._read_request(conn, stream)
                if request is None:
                    return
                head, body = request
                await self._respond(conn, stream, client, head, body)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, ClientGone):
            return
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _read_request(
        self, conn: h11.Connection, stream: trio.SocketStream
    ) -> tuple[h11.Request, bytes] | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(RECEIVE_SIZE)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                head = event
                if conn.they_are_waiting_for_100_continue:
                    # curl asks before sending a body over 1 KiB; unanswered, it waits a second.
                    interim = h11.InformationalResponse(status_code=100, headers=[])
                    await stream.send_all(_out(conn, interim))
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise h11.RemoteProtocolError("request body too large")
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None
            else:  # PAUSED can only follow a complete request, which returned above
                return None

    async def _send_simple(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        close: bool = False,
    ) -> None:
        headers = [
            ("content-type", content_type),
            ("content-length", str(len(body))),
            ("server", "llmgw-sim"),
        ]
        if close:
            headers.append(("connection", "close"))
        data = _out(conn, h11.Response(status_code=status, headers=headers))
        data += _out(conn, h11.Data(data=body)) + _out(conn, h11.EndOfMessage())
        await stream.send_all(data)

    async def _send_json(
        self, conn: h11.Connection, stream: trio.SocketStream, status: int, doc: Any
    ) -> None:
        await self._send_simple(conn, stream, status, json.dumps(doc).encode())

    async def _respond(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        client: str,
        head: h11.Request,
        body: bytes,
    ) -> None:
        method = head.method.decode()
        path = head.target.decode().split("?", 1)[0]
        start = time.monotonic()
        line = f'{client} "{method} {path} HTTP/{head.http_version.decode()}"'
        try:
            status = await self._route(conn, stream, method, path, body, head.headers)
        except ClientGone:
            elapsed = (time.monotonic() - start) * 1000
            self.log(f"{line} 499 client closed the connection {elapsed:.0f}ms")
            raise
        elapsed = (time.monotonic() - start) * 1000
        self.log(f"{line} {status} {elapsed:.0f}ms")

    def _authorized(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """vLLM's --api-key rule: every /v1 path needs ``Authorization: Bearer <key>`` for one of
        its keys (OPTIONS, a CORS preflight, excepted); /health and /metrics stay open."""
        if not self.config.api_keys or not path.startswith("/v1") or method == "OPTIONS":
            return True
        given = [value for name, value in headers if name == b"authorization"]
        expected = {f"Bearer {key}".encode() for key in self.config.api_keys}
        return len(given) == 1 and any(hmac.compare_digest(given[0], e) for e in expected)

    async def _route(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        method: str,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> int:
        if not self._authorized(method, path, headers):
            await self._send_json(conn, stream, 401, {"error": "Unauthorized"})
            return 401
        routes = {
            "/health": ("GET",),
            "/v1/models": ("GET",),
            "/metrics": ("GET",),
            "/v1/chat/completions": ("POST",),
            "/v1/completions": ("POST",),
        }
        if path not in routes:
            await self._send_json(conn, stream, 404, {"detail": "Not Found"})
            return 404
        if method not in routes[path]:
            await self._send_json(conn, stream, 405, {"detail": "Method Not Allowed"})
            return 405
        if path == "/metrics":
            if "metrics" in self.config.hang:
                await trio.sleep_forever()
            await self._send_simple(
                conn,
                stream,
                200,
                self.stats.exposition(
                    self.config.served_model_name, self.engine.metrics(self.config.served_model_name)
                ),
                content_type="text/plain; version=0.0.4; charset=utf-8",
            )
            return 200
        if self.state != "ready":
            message = "model is loading" if self.state == "loading" else "server is shutting down"
            doc = generate.error_body(message, 503)
            await self._send_simple(
                conn, stream, 503, json.dumps(doc).encode(), close=self.state == "draining"
            )
            return 503
        if path == "/health":
            await self._send_simple(conn, stream, 200, b"")
            return 200
        if path == "/v1/models":
            c = self.config
            doc = generate.models_list(c.served_model_names, c.model, self.started, c.max_model_len)
            await self._send_json(conn, stream, 200, doc)
            return 200
        return await self._complete(conn, stream, path, body, headers)

    # -- completions ---------------------------------------------------------------------------

    async def _complete(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        path: str,
        raw: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> int:
        chat = path == "/v1/chat/completions"
        arrival = time.time()
        self.stats.requests_total[path] = self.stats.requests_total.get(path, 0) + 1
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise generate.BadRequest("the request body must be a JSON object")
            model = body.get("model")
            if model not in self.config.served_model_names:
                await self._send_json(
                    conn,
                    stream,
                    404,
                    generate.error_body(f"The model `{model}` does not exist.", 404, "model"),
                )
                return 404
            prompt = generate.chat_prompt(body) if chat else generate.completion_prompt(body)
            plan = generate.plan(
                prompt,
                generate.requested_max_tokens(body),
                self.config.default_max_tokens,
                self.config.max_model_len,
            )
            needed = plan.prompt_tokens + plan.completion_tokens
            if needed > self.engine.capacity_tokens:
                # vLLM refuses at startup a max_model_len its KV cache cannot hold; a smaller
                # cache (--num-gpu-blocks-override) still must not take a request it can never fit.
                raise generate.BadRequest(
                    f"the request needs {needed} tokens of KV cache and the engine holds "
                    f"{self.engine.capacity_tokens} ({self.config.num_gpu_blocks} blocks of "
                    f"{self.config.block_size})",
                    "max_tokens",
                )
        except ValueError as exc:  # JSONDecodeError and BadRequest are ValueErrors
            param = exc.param if isinstance(exc, generate.BadRequest) else None
            await self._send_json(conn, stream, 400, generate.error_body(str(exc), 400, param))
            return 400

        prefix = "chatcmpl" if chat else "cmpl"
        shape = generate.Shape(
            chat=chat,
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.config.served_model_name,
        )
        streaming = bool(body.get("stream"))
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

        self.stats.prompt_tokens += plan.prompt_tokens
        progress = _Progress()
        span = self.tracing.begin(headers, arrival) if self.tracing is not None else None
        generation = trio.CancelScope()
        watcher = _Watcher(generation)
        request = Request(shape.request_id, prompt.ids, plan.token_ids)
        arrived = trio.current_time()
        ticket: Ticket | None = None
        self._begin()
        try:
            with generation:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watcher.watch, conn, stream)
                    try:
                        # The frontend's share of the TTFT (HTTP, tokenization), then the queue.
                        frontend = self.config.ttft_ms * self.config.time_scale / 1000
                        if frontend > 0:
                            await trio.sleep(frontend)
                        if "requests" in self.config.hang:
                            # Hung before the engine: the request takes no batch slot or blocks.
                            ticket = Ticket(request, arrived)
                        else:
                            ticket = self.engine.submit(request, arrived)
                        if streaming:
                            events = shape.stream(plan, include_usage)
                            await self._stream(conn, stream, events, progress, ticket)
                        else:
                            # The first token's time for the span, then the rest.
                            await self._wait_tokens(ticket, min(1, plan.completion_tokens))
                            progress.first_token = time.time()
                            await self._wait_tokens(ticket, plan.completion_tokens)
                            doc = json.dumps(shape.full_response(plan)).encode()
                            self.stats.tokens_generated += plan.completion_tokens
                            await self._send_simple(conn, stream, 200, doc)
                            progress.completed = True
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        watcher.gone = True
                    nursery.cancel_scope.cancel()
        finally:
            if ticket is not None:
                self.engine.release(ticket)
            self._end()
            if span is not None and self.tracing is not None:
                self.tracing.end(
                    span,
                    model=shape.model,
                    request_id=shape.request_id,
                    body=body,
                    prompt_tokens=plan.prompt_tokens,
                    completion_tokens=plan.completion_tokens if progress.completed else progress.tokens,
                    arrival=arrival,
                    first_token=progress.first_token,
                )
        if watcher.gone and not progress.completed:
            self.stats.cancelled += 1
            raise ClientGone()
        # A client that left after its last event got its whole answer: nothing was cancelled,
        # and the next read on the connection sees the same end-of-file and closes it.
        return 200

    async def _wait_tokens(self, ticket: Ticket, count: int) -> None:
        """A non-streamed response waits for the engine to produce all its tokens."""
        if "requests" in self.config.hang:
            await trio.sleep_forever()
        await ticket.wait(count)

    async def _stream(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        events: Iterator[tuple[bytes, bool]],
        progress: _Progress,
        ticket: Ticket,
    ) -> None:
        """Send SSE events, each token as soon as the engine's step produced it; the role chunk,
        the final chunk, usage and ``[DONE]`` go out without delay, as vLLM sends them."""
        headers = [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("server", "llmgw-sim"),
        ]
        await stream.send_all(_out(conn, h11.Response(status_code=200, headers=headers)))
        if "requests" in self.config.hang:
            await trio.sleep_forever()
        sent = 0
        for event, is_token in events:
            if is_token:
                sent += 1
                await ticket.wait(sent)
            else:
                await trio.lowlevel.checkpoint()
            await _write(stream, _out(conn, h11.Data(data=event)))
            if is_token:
                self.stats.tokens_generated += 1
                progress.tokens += 1
                if not progress.first_token:
                    progress.first_token = time.time()
        progress.completed = True
        await stream.send_all(_out(conn, h11.EndOfMessage()))

    def _begin(self) -> None:
        self._inflight += 1
        self.stats.running += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def _end(self) -> None:
        self._inflight -= 1
        self.stats.running -= 1
        if self._inflight == 0:
            self._idle.set()


@attrs.define
class _Progress:
    """Whether a response's last event has gone out; the tokens sent and when the first went
    (``time.time()``), for the request's trace span."""

    completed: bool = False
    tokens: int = 0
    first_token: float = 0.0


class _Watcher:
    """Reads the connection while a response is produced: end-of-file means the client left.
    Bytes that do arrive (a pipelined next request) go to h11, which keeps them for the next cycle."""

    def __init__(self, generation: trio.CancelScope) -> None:
        self.generation = generation
        self.gone = False

    async def watch(self, conn: h11.Connection, stream: trio.SocketStream) -> None:
        while True:
            try:
                data = await stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.gone = True
                self.generation.cancel()
                return
            conn.receive_data(data)


async def run(config: SimConfig, out: TextIO = sys.stdout) -> int:
    """The whole simulator process, as a trio main: returns the exit code."""
    log = Log(out)
    log(
        f"command line parsed as vLLM {config.vllm_version} parses it"
        + ("; /v1 requires the API key" if config.api_keys else "")
    )
    if config.ignored:
        print(
            "sim: ignoring vLLM arguments it does not simulate: " + " ".join(config.ignored),
            file=sys.stderr,
            flush=True,
        )
    tracing: EngineTracing | None = None
    if config.otlp_traces_endpoint:
        try:
            tracing = EngineTracing(config.otlp_traces_endpoint, os.environ)
        except TracingSettingsError as exc:
            print(f"ValueError: {exc}", file=sys.stderr, flush=True)
            return 1
        log(f"tracing requests to {config.otlp_traces_endpoint}")
    try:
        return await _serve(config, log, tracing)
    finally:
        if tracing is not None:
            await trio.to_thread.run_sync(tracing.shutdown)


async def _serve(config: SimConfig, log: Log, tracing: EngineTracing | None) -> int:
    stop_signals = [signal.SIGTERM, signal.SIGINT]
    if "sigterm" in config.hang:
        # Deliberately unkillable by SIGTERM: tests the supervisor's SIGKILL escalation.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_signals.remove(signal.SIGTERM)
        log("ignoring SIGTERM (LLMGW_SIM_HANG=sigterm)")
    try:
        server = SimServer(config, log)
    except OSError as exc:  # the KV events endpoints could not be opened
        log(str(exc))
        return 1
    server.tracing = tracing
    outcome: list[int] = []
    with trio.open_signal_receiver(*stop_signals) as signals:
        async with trio.open_nursery() as nursery:
            listeners_scope = trio.CancelScope()
            listeners: list[trio.SocketListener] = []
            if not config.headless:
                # One listener, so that --port 0 means one port (per-family listeners would each
                # get their own); no --host means every IPv4 interface.
                host = config.host or "0.0.0.0"
                try:
                    listeners = await trio.open_tcp_listeners(config.port, host=host)
                except OSError as exc:
                    log(f"cannot listen on {host}:{config.port}: {exc}")
                    return 1
                server.port = listeners[0].socket.getsockname()[1]
                log(f"listening on {host}:{server.port} (pid {os.getpid()})")

                async def accept() -> None:
                    with listeners_scope:
                        await server.serve_listeners(listeners, nursery)

                nursery.start_soon(accept)
            nursery.start_soon(server.engine.run)
            nursery.start_soon(server.load, nursery.cancel_scope, outcome)
            if config.exit_after > 0:
                nursery.start_soon(server.crash_after, nursery.cancel_scope, outcome)
            async for signum in signals:
                name = signal.Signals(signum).name
                # Close the port now, not when the accept task next runs: from this line on a
                # new connection is refused, which is what a draining engine must guarantee.
                listeners_scope.cancel()
                for listener in listeners:
                    await listener.aclose()
                log(f"received {name}: port closed, no new requests")
                await server.drain(config.shutdown_timeout)
                log("shutting down")
                nursery.cancel_scope.cancel()
                break
    return outcome[0] if outcome else 0
