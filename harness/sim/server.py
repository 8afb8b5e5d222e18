"""The simulated engine's process: startup phases, HTTP routes, faults, logging and shutdown.

Phases, as the real engines go through them: "loading" (port closed: connection refused) for
HARNESS_SIM_STARTUP_S, then SGLang answers 503 on /health while "starting" (its warm-up generation)
for half as long again and prints "The server is fired up and ready to roll!"; vLLM is up as soon as
it listens. On several hosts (`--nnodes`, harness.sim.rendezvous) every node first meets node 0;
SGLang nodes of rank >= 1 then serve only a dummy health endpoint that always says 200 (and, as 0.5.23
does, ignore SIGTERM: node 0's shutdown stops them), vLLM's (`--headless`) serve no HTTP at all.

With `--api-key` (vLLM: or VLLM_API_KEY) a request must carry `Authorization: Bearer KEY`, or it is
answered 401 `{"error": "Unauthorized"}`, on the paths the real engine guards (`guarded`).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import sys
import sysconfig
import time
from argparse import Namespace
from typing import Any, Union

from harness.sim import flags, http, rendezvous
from harness.sim.engine import EmitLog, Scheduler, new_generation, tokenize
from harness.sim.knobs import Knobs
from harness.sim.model import LatencyModel
from harness.sim.profiler import Reply, SglangProfiler, VllmProfiler, sglang_rank_names, vllm_worker_names
from harness.sim.trace import Step

Profiler = Union[SglangProfiler, VllmProfiler]
NOT_FOUND = {"detail": "Not Found"}
KV_POOL_TOKENS = 495616
"""The KV pool the simulator's startup log reports (both engines), which its KV use is a share of."""
VLLM_GUARDED = ("/v1", "/v2", "/inference")
"""vLLM 0.26 (entrypoints/serve/utils/server_utils.py GUARDED_PREFIX): only these paths need the key;
/health, /ping, /metrics and the profiler endpoints do not."""
SGLANG_OPEN = ("/health", "/ready", "/metrics")
"""SGLang 0.5.23 (srt/utils/auth.py decide_request_auth): every path needs the key but these prefixes
(for probes and scrapers); the profiler endpoints too, being admin-optional with no admin key set."""


def guarded(engine: str, method: str, path: str) -> bool:
    """Whether the engine asks for its API key on this request (OPTIONS never: CORS preflights)."""
    if method == "OPTIONS":
        return False
    if engine == "sglang":
        return not path.startswith(SGLANG_OPEN)
    return path.startswith(VLLM_GUARDED)


def authorized(keys: tuple[str, ...], header: str) -> bool:
    """`Authorization: Bearer KEY` (the scheme in any case) naming one of `keys`, compared in
    constant time as both engines do."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


class Log:
    """Lines in the engine's own format on stderr (the harness redirects it to server.log)."""

    def __init__(self, engine: str):
        self.engine = engine

    def __call__(self, msg: str, source: str = "api_server.py:1870", rank: bool = False) -> None:
        now = time.localtime()
        if self.engine == "sglang":
            head = time.strftime("[%Y-%m-%d %H:%M:%S", now) + (" TP0] " if rank else "] ")
        else:
            head = time.strftime("INFO %m-%d %H:%M:%S ", now) + f"[{source}] "
        sys.stderr.write(head + msg + "\n")

    def uvicorn(self, msg: str) -> None:
        """uvicorn's own lines, which SGLang's logging setup also stamps with the time."""
        stamp = time.strftime("[%Y-%m-%d %H:%M:%S] ") if self.engine == "sglang" else ""
        sys.stderr.write(f"{stamp}INFO:     {msg}\n")

    def access(self, peer: Any, req: http.Request, status: int) -> None:
        host, port = (peer[0], peer[1]) if isinstance(peer, tuple) else ("127.0.0.1", 0)
        self.uvicorn(f'{host}:{port} - "{req.method} {req.path} HTTP/1.1" {status} {http.REASONS.get(status, "")}')


class SimServer:
    def __init__(self, engine: str, ns: Namespace, knobs: Knobs):
        self.engine, self.ns, self.knobs = engine, ns, knobs
        self.model = LatencyModel(flags.sim_config(engine, ns))
        self.names = flags.served_names(engine, ns)
        self.api_keys = flags.api_keys(engine, ns, os.environ)
        self.log = Log(engine)
        self.state = "loading"
        self.started_wall = time.time()
        self.completed = 0
        self.hung = asyncio.Event()
        self.emit = EmitLog(knobs.emit_log) if knobs.emit_log else None
        cfg = self.model.config
        self.scheduler = Scheduler(
            self.model, engine=engine, time_scale=knobs.time_scale, stream_interval=ns.stream_interval,
            max_running=ns.max_running_requests if engine == "sglang" else ns.max_num_seqs, emit=self.emit,
            log=lambda m: self.log(m, "loggers.py:248", rank=True),
            log_interval=ns.decode_log_interval if engine == "sglang" else 400,
            empty_text_every=knobs.empty_text_every)
        fail = knobs.faults.profile_500
        self.profiler: Profiler
        if engine == "sglang":
            attn_dp, replicas = flags.sglang_dp(ns)
            self.profiler = SglangProfiler(
                model=self.model, world_size=cfg.tp * cfg.pp * replicas, trace_mb=knobs.trace_mb, fail=fail,
                ranks=sglang_rank_names(tp=cfg.tp, dp=attn_dp, pp=cfg.pp, ep=cfg.ep, replicas=replicas,
                                        nnodes=ns.nnodes, node_rank=ns.node_rank),
                log=lambda m: self.log(m, rank=True))
        else:
            self.profiler = VllmProfiler(
                config=ns.profiler_config, model=self.model, world_size=cfg.tp * cfg.pp * cfg.dp,
                trace_mb=knobs.trace_mb, fail=fail,
                workers=vllm_worker_names(tp=cfg.tp, dp=cfg.dp, pp=cfg.pp, expert_parallel=ns.enable_expert_parallel,
                                          nnodes=ns.nnodes, node_rank=ns.node_rank),
                log=lambda m: self.log(m, "gpu_worker.py:412"))
        self.scheduler.hooks.append(self.profiler.on_step)
        self.head: rendezvous.Head | None = None        # node 0 of several: relays to the others
        self.link: asyncio.StreamWriter | None = None   # another node's: its connection to node 0
        if isinstance(self.profiler, VllmProfiler) and ns.node_rank > 0:
            self.profiler.frontend = False               # a headless node has no API front end

    async def _relay_step(self, step: Any) -> None:
        if self.head is not None:
            self.head.send({"op": "step", "step": [step.prefill, step.prefill_tokens, step.decode]})

    async def _relayed(self, message: dict[str, Any]) -> None:
        """A node of rank >= 1: what node 0 relays, as this node's ranks would see it."""
        op = message.get("op")
        if op == "step":
            prefill, tokens, decode = message["step"]
            await self.profiler.on_step(Step(prefill=prefill, prefill_tokens=tokens, decode=decode))
        elif op == "start":
            status, answer = await self.profiler.start(message.get("body") or {})
            if status != 200:
                self.log(f"profiler start on node {self.ns.node_rank} failed: {answer}")
        elif op == "stop":
            await self.profiler.stop()
        elif op == "completed":
            self._on_completed()

    async def _rendezvous(self) -> tuple[bool, Any]:
        """Meet the other nodes; (False, _) when the flags name no rendezvous. Node 0 returns once
        every node joined; another node returns the task that follows node 0."""
        where = rendezvous.endpoint(self.engine, self.ns)
        if where is None:
            self.log("ERROR: --nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
            return False, None
        if self.ns.node_rank == 0:
            self.head = rendezvous.Head(where[1], self.ns.nnodes - 1, lambda m: self.log(m, rank=True))
            self.scheduler.hooks.append(self._relay_step)
            await self.head.gather()
            return True, None
        if self.engine == "vllm":
            self.log(f"Launching vLLM (v{flags.VLLM_VERSION}) headless multiproc executor, with head node "
                     f"address {where[0]}:{where[1]} for torch.distributed process group.", "serve.py:212")
        timeout = float(getattr(self.ns, "dist_timeout", None) or 1800)
        reader, self.link = await rendezvous.join(where[0], where[1], self.ns.node_rank, timeout,
                                                  lambda m: self.log(m, rank=True))   # kept: dropped, it closes
        return True, asyncio.create_task(rendezvous.follow(reader, self.ns.node_rank, self._relayed))

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None
        peer = self.ns.nnodes > 1 and self.ns.node_rank > 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGTERM and peer and self.engine == "sglang":   # 0.5.23: node 0's shutdown stops it
                loop.add_signal_handler(sig, lambda: self.log(
                    f"SIGTERM received on node_rank {self.ns.node_rank}; waiting for the rank-0 ShutdownReq "
                    "broadcast to stop the schedulers."))
                continue
            loop.add_signal_handler(sig, main.cancel)
        server = None
        tasks = []
        try:
            self._log_args()
            if self.ns.nnodes > 1:
                joined, following = await self._rendezvous()
                if not joined:
                    return 1
                if following is not None:
                    tasks.append(following)
            if self.knobs.faults.oom_at_start:
                await asyncio.sleep(self.knobs.startup_s / 2)
                self._log_oom()
                return 1
            await asyncio.sleep(self.knobs.startup_s)
            self._log_loaded()
            if self.knobs.faults.no_kv_cache:
                self._log_no_kv_cache()
                return 1
            if peer and self.engine == "vllm":   # headless: workers only, no API server
                tasks.append(asyncio.create_task(self.scheduler.run()))
                await asyncio.gather(*tasks)   # until node 0 goes (then this process exits) or SIGTERM
                return 0
            dummy = self.engine == "sglang" and self.ns.node_rank > 0
            handler = self._dummy_health if dummy else self._connection
            try:
                server = await asyncio.start_server(handler, self.ns.host or None, self.ns.port,
                                                    limit=1 << 20, backlog=1024)
            except OSError as e:
                self.log(f"ERROR: [Errno {e.errno}] error while attempting to bind on address "
                         f"('{self.ns.host}', {self.ns.port}): {e.strerror}")
                return 1
            self._log_listening()
            tasks.insert(0, asyncio.create_task(self.scheduler.run()))
            if self.emit is not None:
                tasks.append(asyncio.create_task(self._flush_emit_log()))
            if not dummy:
                await self._warm_up()
            await tasks[0]  # the decode loop runs until shutdown; a crash in it ends the process
        except asyncio.CancelledError:
            self.log("Shutting down", rank=False)
            return 0
        finally:
            for t in tasks:
                t.cancel()
            if server is not None:
                server.close()
            if self.head is not None:
                self.head.close()
            if self.emit is not None:
                self.emit.flush()
        return 0

    async def _warm_up(self) -> None:
        if self.engine == "vllm":
            self.state = "up" if not self.knobs.faults.never_healthy else "starting"
            return
        self.state = "starting"
        if self.knobs.faults.never_healthy:
            return  # the warm-up generation never returns
        await asyncio.sleep(self.knobs.starting_s)
        self.log.uvicorn('127.0.0.1:0 - "POST /generate HTTP/1.1" 200 OK')
        self.state = "up"
        self.log("The server is fired up and ready to roll!")

    async def _flush_emit_log(self) -> None:
        assert self.emit is not None
        while True:
            await asyncio.sleep(1.0)
            self.emit.flush()

    def _on_completed(self) -> None:
        self.completed += 1
        if self.head is not None:
            self.head.send({"op": "completed"})
        faults = self.knobs.faults
        if faults.crash_after is not None and self.completed >= faults.crash_after:
            error = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
            if self.engine == "sglang":
                self.log("Scheduler hit an exception: Traceback (most recent call last):\n"
                         f'  File "{_site()}/sglang/srt/managers/scheduler.py", line 1021, in event_loop_overlap\n'
                         f"    self.process_batch_result(tmp_batch, tmp_result)\n{error}", rank=True)
            else:
                self.log(f"EngineCore encountered a fatal error.\n{error}", "core.py:854")
            if self.emit is not None:
                self.emit.flush()
            sys.stderr.flush()
            os._exit(1)
        if faults.hang_after is not None and self.completed >= faults.hang_after:
            self.hung.set()
            self.scheduler.freeze()

    # ---- HTTP ------------------------------------------------------------------------------

    async def _dummy_health(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await http.read_request(reader) is not None:
                writer.write(http.response(200))
        except (http.BadRequest, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            while True:
                if self.hung.is_set():
                    await asyncio.Event().wait()
                try:
                    req = await http.read_request(reader)
                except (http.BadRequest, asyncio.IncompleteReadError):
                    writer.write(http.json_response(400, {"detail": "Bad Request"}, keep_alive=False))
                    break
                if req is None:
                    break
                if self.hung.is_set():
                    await asyncio.Event().wait()
                status, keep = await self._dispatch(req, writer)
                self.log.access(peer, req, status)
                await writer.drain()
                if status == 200 and req.path in ("/v1/completions", "/v1/chat/completions"):
                    self._on_completed()
                if not keep:
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _dispatch(self, req: http.Request, writer: asyncio.StreamWriter) -> tuple[int, bool]:
        """Answer one request; return its status and whether the connection stays open."""
        keep = req.keep_alive
        route = (req.method, req.path)
        sglang = self.engine == "sglang"
        if self.api_keys and guarded(self.engine, req.method, req.path) \
                and not authorized(self.api_keys, req.headers.get("authorization", "")):
            return self._send(writer, 401, {"error": "Unauthorized"}, keep)
        if req.path in ("/v1/completions", "/v1/chat/completions"):
            if req.method != "POST":
                return self._send(writer, 405, {"detail": "Method Not Allowed"}, keep)
            return await self._generate(req, writer, chat=req.path.endswith("chat/completions"))
        # SGLang's profiler is always there (self.profiler is an SglangProfiler exactly when sglang)
        if req.path in ("/start_profile", "/stop_profile") and (isinstance(self.profiler, SglangProfiler)
                                                                 or self.profiler.enabled):
            if req.method not in (("GET", "POST") if sglang else ("POST",)):
                return self._send(writer, 405, {"detail": "Method Not Allowed"}, keep)
            status, answer = await self._profile(req)
            writer.write(http.json_response(status, answer, keep) if isinstance(answer, dict)
                         else http.text_response(status, answer, keep))
            return status, keep
        if req.path == "/tokenize" or (sglang and req.path == "/v1/tokenize"):
            if req.method != "POST":
                return self._send(writer, 405, {"detail": "Method Not Allowed"}, keep)
            return self._send(writer, *self._tokenize(req), keep)
        if req.method not in ("GET", "POST"):
            return self._send(writer, 405, {"detail": "Method Not Allowed"}, keep)
        health = ("/health", "/health_generate") if sglang else ("/health", "/ping")
        if req.path in health and (req.method == "GET" or req.path == "/ping"):
            status = 200 if self.state == "up" else 503
            writer.write(http.response(status, b"", keep_alive=keep))
            return status, keep
        if route == ("GET", "/v1/models"):
            return self._send(writer, 200, self._models(), keep)
        if route == ("GET", "/metrics") and (not sglang or self.ns.enable_metrics):
            writer.write(http.response(200, self._metrics().encode(), "text/plain; version=0.0.4", keep))
            return 200, keep
        if sglang and route in (("GET", "/server_info"), ("GET", "/get_server_info")):
            info = dict(vars(self.ns))
            info.update(version=flags.SGLANG_VERSION, status="Up" if self.state == "up" else "Starting",
                        internal_states=[{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}])
            return self._send(writer, 200, info, keep)
        if sglang and route in (("GET", "/model_info"), ("GET", "/get_model_info")):
            return self._send(writer, 200, {"model_path": self.ns.model_path,
                                            "tokenizer_path": self.ns.tokenizer_path or self.ns.model_path,
                                            "is_generation": True, "preferred_sampling_params": None,
                                            "weight_version": "default", "has_image_understanding": False,
                                            "has_audio_understanding": False}, keep)
        if not sglang and route == ("GET", "/version"):
            return self._send(writer, 200, {"version": flags.VLLM_VERSION}, keep)
        return self._send(writer, 404, NOT_FOUND, keep)

    def _send(self, writer: asyncio.StreamWriter, status: int, value: Any, keep: bool) -> tuple[int, bool]:
        writer.write(http.json_response(status, value, keep))
        return status, keep

    async def _profile(self, req: http.Request) -> Reply:
        """Both engines read a JSON body on /start_profile (vLLM since 0.32); /stop_profile takes none."""
        if req.path != "/start_profile":
            reply = await self.profiler.stop()
            if self.head is not None and reply[0] == 200:
                self.head.send({"op": "stop"})
            return reply
        try:
            body = req.json()
        except ValueError:
            return 400, "invalid JSON body"
        body = body if isinstance(body, dict) else {}
        reply = await self.profiler.start(body)
        if self.head is not None and reply[0] == 200:   # every rank of every node starts with it
            self.head.send({"op": "start", "body": body})
        return reply

    async def _generate(self, req: http.Request, writer: asyncio.StreamWriter, chat: bool) -> tuple[int, bool]:
        keep = req.keep_alive
        if self.state != "up":
            return self._send(writer, 503, {"object": "error", "message": "The server is not ready yet.",
                                            "type": "ServiceUnavailableError", "code": 503}, keep)
        try:
            body = req.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            model = body.get("model") or self.names[0]
            if self.engine == "vllm" and model not in self.names:
                return self._send(writer, 404, {"error": {"message": f"The model `{model}` does not exist.",
                                                          "type": "NotFoundError", "param": "model", "code": 404}},
                                  keep)
            g = new_generation(self.engine, model, chat, body, writer, asyncio.get_running_loop())
        except (ValueError, AttributeError, TypeError) as e:
            return self._send(writer, 400, {"object": "error", "message": str(e), "type": "BadRequestError",
                                            "param": None, "code": 400}, keep)
        if g.stream:
            writer.write(http.stream_head(keep))
        self.scheduler.submit(g)
        await g.done
        if not g.stream:
            writer.write(http.response(200, g.body(), keep_alive=keep))
        return 200, keep and g.finish_reason != "abort"

    def _tokenize(self, req: http.Request) -> tuple[int, dict[str, Any]]:
        """The engines' tokenizer endpoint, in each one's answer (field order included): vLLM 0.32
        (entrypoints/serve/tokenize: POST /tokenize, TokenizeResponse {count, max_model_len, tokens,
        token_strs}, an unknown model answered 404), SGLang 0.5.23 (entrypoints/http_server.py: POST
        /tokenize and /v1/tokenize, TokenizeResponse {tokens, count, max_model_len}, any model name)."""
        try:
            body = req.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            model = body.get("model")
            if self.engine == "vllm" and model is not None and model not in self.names:
                return 404, {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                       "param": "model", "code": 404}}
            ids = tokenize(body)
        except (ValueError, AttributeError, TypeError) as e:
            return 400, {"object": "error", "message": str(e), "type": "BadRequestError", "param": None, "code": 400}
        if self.engine == "sglang":
            return 200, {"tokens": ids, "count": len(ids), "max_model_len": self._context_length()}
        return 200, {"count": len(ids), "max_model_len": self._context_length(), "tokens": ids, "token_strs": None}

    def _models(self) -> dict[str, Any]:
        owner = "sglang" if self.engine == "sglang" else "vllm"
        root = flags.model_path(self.engine, self.ns)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()), "owned_by": owner,
                                            "root": root, "max_model_len": self._context_length()}
                                           for n in self.names]}

    def _context_length(self) -> int:
        value = self.ns.context_length if self.engine == "sglang" else self.ns.max_model_len
        return value or 202752

    def _metrics(self) -> str:
        """/metrics as the imitated engine writes it (prometheus_client's text format: a counter as
        NAME_total with NAME_created beside it), with its family names, labels and meanings: vLLM 0.26.0
        and 0.32.0 `v1/metrics/loggers.py`, SGLang 0.5.23 `srt/observability/metrics_collector.py`. KV
        use is the running requests' tokens over the KV pool the log reports; the simulator has no
        prefix cache, so every prompt token is queried and none is a hit."""
        s, name = self.scheduler, self.names[0]
        held = sum(g.prompt_tokens + g.tokens for g in s.running)
        usage = min(1.0, held / KV_POOL_TOKENS)
        created = self.started_wall
        if self.engine == "sglang":
            sched = f'{{engine_type="unified",model_name="{name}",moe_ep_rank="0",pp_rank="0",tp_rank="0"}}'
            tok = f'{{engine_type="unified",is_streaming="true",model_name="{name}"}}'
            cached = f'{{cache_source="device",engine_type="unified",model_name="{name}"}}'
            rows = [("sglang:num_running_reqs", "gauge", "The number of running requests.", sched, len(s.running)),
                    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", sched,
                     len(s.waiting)),
                    ("sglang:token_usage", "gauge", "The token usage.", sched, usage),
                    ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", sched, 0.0),
                    ("sglang:prompt_tokens", "counter", "Number of prefill tokens processed.", tok,
                     s.prompt_tokens_total),
                    ("sglang:generation_tokens", "counter", "Number of generation tokens processed.", tok,
                     s.generation_tokens_total),
                    ("sglang:cached_tokens", "counter", "Number of cached prompt tokens by source "
                     "(device/host/storage).", cached, 0),
                    ("sglang:num_requests", "counter", "Number of requests processed.", tok, self.completed)]
        else:
            label = f'{{engine="0",model_name="{name}"}}'
            rows = [("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", label,
                     len(s.running)),
                    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", label,
                     len(s.waiting)),
                    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", label, usage),
                    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried "
                     "tokens.", label, s.prompt_tokens_total),
                    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
                     label, 0),
                    ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", label, 0),
                    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", label,
                     s.prompt_tokens_total),
                    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", label,
                     s.generation_tokens_total)]
        out = []
        for family, kind, doc, labels, value in rows:
            sample = f"{family}_total" if kind == "counter" else family
            out.append(f"# HELP {sample} {doc}\n# TYPE {sample} {kind}\n{sample}{labels} {float(value)!r}\n")
            if kind == "counter":
                out.append(f"# HELP {family}_created {doc}\n# TYPE {family}_created gauge\n"
                           f"{family}_created{labels} {created!r}\n")
        return "".join(out)

    # ---- log lines -------------------------------------------------------------------------

    def _log_args(self) -> None:
        if self.engine == "sglang":
            args = ", ".join(f"{k}={v!r}" for k, v in vars(self.ns).items())
            self.log(f"server_args=ServerArgs({args})")
            self.log("Init torch distributed begin.", rank=True)
            self.log("Load weight begin. avail mem=94.43 GB", rank=True)
        else:
            defaults = vars(flags.vllm_parser().parse_args([]))
            changed = {k: v for k, v in vars(self.ns).items() if k in defaults and defaults[k] != v}
            self.log(f"vLLM API server version {flags.VLLM_VERSION}", "api_server.py:1885")
            self.log(f"non-default args: {changed}", "utils.py:253")
            self.log(f"Starting to load model {self.ns.model}...", "gpu_model_runner.py:2602")

    def _log_loaded(self) -> None:
        graphs = self.model.config.cuda_graphs
        if self.engine == "sglang":
            self.log("Load weight end. type=GlmMoeDsaForCausalLM, dtype=torch.bfloat16, avail mem=43.05 GB, "
                     "mem usage=51.38 GB.", rank=True)
            self.log(f"KV Cache is allocated. #tokens: {KV_POOL_TOKENS}, KV size: 29.13 GB ({self.ns.kv_cache_dtype})",
                     rank=True)
            if graphs:
                self.log("Capture cuda graph begin. This can take up to several minutes. avail mem=13.20 GB", rank=True)
                self.log("Capture cuda graph end. Time elapsed: 12.34 s. mem usage=1.20 GiB. avail mem=12.00 GB.",
                         rank=True)
        else:
            self.log(f"Loading weights took {self.knobs.startup_s:.2f} seconds", "default_loader.py:267")
            self.log(f"GPU KV cache size: {KV_POOL_TOKENS:,} tokens", "kv_cache_utils.py:1087")
            if graphs:
                self.log("Graph capturing finished in 12 secs, took 1.20 GiB", "gpu_model_runner.py:3480")

    def _log_listening(self) -> None:
        host = self.ns.host or "0.0.0.0"
        if self.engine == "vllm":
            self.log(f"Starting vLLM API server 0 on http://{host}:{self.ns.port}", "api_server.py:1634")
        for line in (f"Started server process [{os.getpid()}]", "Waiting for application startup.",
                     "Application startup complete."):
            self.log.uvicorn(line)
        if self.engine == "sglang":
            self.log.uvicorn(f"Uvicorn running on http://{host}:{self.ns.port} (Press CTRL+C to quit)")

    def _log_no_kv_cache(self) -> None:
        """The weights fit, the KV cache does not: each engine's own words, with no "out of memory" in
        them (SGLang 0.5.23 mem_cache/kv_cache_configurator.py; vLLM 0.26.0 and 0.32.0
        v1/core/kv_cache_utils.py)."""
        if self.engine == "sglang":
            self.log("Scheduler hit an exception: ValueError: Loaded weights leave no GPU memory for the KV "
                     "cache under --mem-fraction-static=0.5. Raise --mem-fraction-static above 0.812 "
                     "(minimum viable = 1 - available/pre = 0.812).", rank=True)
            self.log("Received sigquit from a child process. It usually means the child failed.")
        else:
            self.log("EngineCore failed to start.\nValueError: No available memory for the cache blocks. Try "
                     "increasing `gpu_memory_utilization` when initializing the engine (this flag also "
                     "controls CPU memory reservation on the CPU backend, despite its name). See "
                     "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
                     "core.py:708")

    def _log_oom(self) -> None:
        runner = f"{_site()}/{'sglang/srt/model_executor' if self.engine == 'sglang' else 'vllm/v1/worker'}"
        lines = [
            "Traceback (most recent call last):",
            f'  File "{runner}/model_runner.py", line 853, in load_model',
            "    self.model = get_model(",
            f'  File "{_site()}/torch/nn/modules/module.py", line 1355, in to',
            "    return self._apply(convert)",
            f'  File "{_site()}/torch/nn/modules/module.py", line 1341, in convert',
            "    return t.to(device, dtype if t.is_floating_point() or t.is_complex() else None, non_blocking)",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total capacity of "
            "94.97 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 93.84 GiB memory in "
            "use. Of the allocated memory 91.20 GiB is allocated by PyTorch, and 1.31 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        ]
        if self.engine == "sglang":
            self.log("Scheduler hit an exception: " + "\n".join(lines), rank=True)
            self.log("Received sigquit from a child process. It usually means the child failed.")
        else:
            self.log("EngineCore failed to start.\n" + "\n".join(lines), "core.py:708")
            sys.stderr.write("RuntimeError: Engine core initialization failed. See root cause above. "
                             "Failed core proc(s): {}\n")


def _site() -> str:
    """Where the engine's package would live in this environment (tracebacks name real paths)."""
    return sysconfig.get_paths()["purelib"]


def serve(engine: str, ns: Namespace, knobs: Knobs) -> int:
    return asyncio.run(SimServer(engine, ns, knobs).run())
