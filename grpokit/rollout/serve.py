"""`grpokit serve MODEL_DIR`: a vLLM rollout server in a process of its own, for rollout.vllm_mode=server.

    grpokit serve runs/sft/final --port 8000       # prints "listening on ...", then "ready" once vLLM is up
    grpokit train cfg.yaml rollout.engine=vllm rollout.vllm_mode=server rollout.vllm_server_url=http://127.0.0.1:8000

It hosts one VLLMEngine, the colocated engine's class (grpokit/rollout/vllm.py), and answers JSON over HTTP
(the client is grpokit/rollout/server.py; docs/rollout.md, "Server mode"):

    GET  /health          {"status": "loading" | "ok", "version", "samples"}: samples = completions served
    GET  /info            the served model (tensor names and shapes, dtype, EOS ids, architecture, vocab),
                          version
    POST /generate        {prompt_token_ids, n, sampling, seed} -> {token_ids, logprobs, finish_reasons,
                          versions}
    POST /update_weights  {path, aliases, version} -> {version}: loads the safetensors file the client wrote;
                          {broadcast: true, tensors, aliases, version}: receives them by the weight group's
                          broadcast instead (grpokit/rollout/fleet.py)
    POST /init_weight_group  {host, port, rank, world_size, timeout} -> {rank}: joins the trainer's process
                          group (a TCPStore at host:port), replacing the one before
    POST /score           {token_ids} -> {logprobs, version}: prompt log-probs, the client's check of each
                          push

The policy version starts at 0 (MODEL_DIR's weights); each push sets it to the version the request names, or
adds one. The main thread owns the engine and runs the requests one at a time, in order of arrival; the HTTP
threads only parse and wait, so /health answers during a long generate, and no push lands inside a generate:
every sample of a reply comes from the one version it reports.
"""

from __future__ import annotations

import json
import queue
import signal
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpokit.config import ConfigError


class _Served:
    """The engine and what the server knows about it; used by the main thread only."""

    def __init__(self, model_dir: str, tokenizer: str | None, dtype: str, **engine_kwargs):
        import torch

        from grpokit.policy import load_model, load_tokenizer
        from grpokit.rollout.server import model_info
        from grpokit.rollout.vllm import VLLMEngine

        tok = load_tokenizer(tokenizer or model_dir)
        model = load_model(model_dir, dtype=dtype).eval()
        if torch.cuda.is_available():
            model = model.cuda()
        self.info = {"model": model_dir, **model_info(model, tok)}
        self.engine = VLLMEngine(
            model, tok, **engine_kwargs
        )  # pushes MODEL_DIR's weights (checked); then not needed
        self.version = 0
        self.samples = 0  # completions served so far (GET /health)
        self.group = None  # the trainer's weight group (POST /init_weight_group), None until it asks
        self.group_timeout = 240.0  # seconds each of its collectives may wait (the trainer's timeout)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def init_weight_group(self, body: dict) -> dict:
        """Join the trainer's weight group (in the main thread: the one that takes part in its broadcasts)."""
        from grpokit.rollout.fleet import join_group

        self.group = None  # a group the trainer rebuilt (a server of the fleet went) replaces the old one
        self.group_timeout = float(body["timeout"])
        self.group = join_group(
            body["host"],
            int(body["port"]),
            int(body["rank"]),
            int(body["world_size"]),
            self.group_timeout,
            self.device,
        )
        return {"rank": int(body["rank"])}

    def generate(self, body: dict) -> dict:
        from grpokit.rollout.server import sampling_from_wire

        comps = self.engine.generate_seeded(
            body["prompt_token_ids"], body["n"], sampling_from_wire(body["sampling"]), body["seed"]
        )
        self.samples += len(comps)
        return {
            "token_ids": comps.token_ids,
            "logprobs": comps.logprobs,
            "finish_reasons": comps.finish_reasons,
            "versions": [self.version] * len(comps),
        }

    def update_weights(self, body: dict) -> dict:
        named = self._broadcast_push(body) if body.get("broadcast") else self._file_push(body)
        unknown = sorted(set(name for name, _ in named) - set(self.info["tensors"]))
        if unknown:  # vLLM would skip or fail on them deep inside its reload
            raise ValueError(f"the push names tensors this model has not got: {unknown[:3]}")
        self.engine.push(named)
        self.version = self.version + 1 if body.get("version") is None else int(body["version"])
        return {"version": self.version, "tensors": len(named)}

    def _broadcast_push(self, body: dict) -> list:
        from grpokit.rollout.fleet import receive

        if self.group is None:
            raise ValueError(
                "a broadcast push before POST /init_weight_group: the trainer must build the group"
            )
        named = receive(self.group, body["tensors"], self.device, self.group_timeout)
        got = dict(named)
        return [*named, *((alias, got[name]) for alias, name in (body.get("aliases") or {}).items())]

    def _file_push(self, body: dict) -> list:
        from grpokit.rollout.weights import read_push

        try:
            return read_push(body["path"], body.get("aliases") or {})
        except FileNotFoundError:
            raise ValueError(
                f"cannot read {body['path']}: weights come through a file in the trainer's /dev/shm, so the "
                "server must run on the trainer's machine (rollout.vllm_weight_sync=broadcast reaches a "
                "server elsewhere; docs/rollout.md)"
            ) from None

    def score(self, body: dict) -> dict:
        return {"logprobs": self.engine.prompt_logprobs(body["token_ids"]), "version": self.version}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self):  # http.server's name
        if self.path == "/health":
            served = self.server.served
            return self._reply(
                200,
                {
                    "status": "ok" if served else "loading",
                    "version": served.version if served else None,
                    "samples": served.samples if served else 0,
                },
            )
        if self.path == "/info":
            return self._run(lambda s, _: {**s.info, "version": s.version}, None)
        self._reply(404, {"error": f"no GET {self.path}; GET /health, /info"})

    def do_POST(self):  # http.server's name
        routes = {
            "/generate": _Served.generate,
            "/update_weights": _Served.update_weights,
            "/score": _Served.score,
            "/init_weight_group": _Served.init_weight_group,
        }
        if self.path not in routes:
            return self._reply(404, {"error": f"no POST {self.path}; POST {', '.join(routes)}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as exc:
            return self._reply(400, {"error": f"the body is not JSON: {exc}"})
        self._run(routes[self.path], body)

    def _run(self, fn, body) -> None:
        """Queue fn(served, body) for the main thread and reply with its result (or its error, status 500)."""
        if self.server.served is None:
            return self._reply(503, {"error": "the server is still loading; wait for GET /health to say ok"})
        job: Future = Future()
        self.server.jobs.put((fn, body, job))
        try:
            self._reply(200, job.result())
        except Exception as exc:  # the request's fault or vLLM's: the server goes on
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

    def _reply(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # one line per request on stderr is noise at a request per rollout
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    served: _Served | None = None
    jobs: queue.Queue


def _say(line: str) -> None:
    print(line, flush=True)  # a line a script or test waits for, through a pipe


def serve(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    tokenizer: str | None = None,
    dtype: str = "float32",
    echo=_say,
    **engine_kwargs,
) -> None:
    """Listen at host:port (0 = a free port), start vLLM on MODEL_DIR, then run requests until SIGTERM /
    Ctrl-C. engine_kwargs: VLLMEngine's (max_model_len, max_seqs, kv_cache_mb, gpu_memory_utilization)."""
    try:
        httpd = _Server((host, port), _Handler)
    except OSError as exc:
        raise ConfigError(
            f"grpokit serve cannot listen on {host}:{port} ({exc.strerror}): pick another --port "
            "(0 = any free one) or stop what uses it"
        ) from None
    httpd.jobs = queue.Queue()
    threading.Thread(target=httpd.serve_forever, name="grpokit-serve-http", daemon=True).start()
    url = f"http://{host}:{httpd.server_address[1]}"
    echo(f"grpokit serve: listening on {url} (loading {model_dir})")

    stopping = threading.Event()

    def stop(signum, _frame):
        if httpd.served is None:  # still loading: stop there
            raise SystemExit(128 + signum)
        # after the request that runs now (an exception raised inside vLLM could be swallowed there)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        httpd.served = _Served(model_dir, tokenizer, dtype, **engine_kwargs)
        echo(
            f"grpokit serve: ready on {url}: train with rollout.engine=vllm rollout.vllm_mode=server "
            f"rollout.vllm_server_url={url}"
        )
        while not stopping.is_set():
            try:
                fn, body, job = httpd.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                job.set_result(fn(httpd.served, body))
            except Exception as exc:
                job.set_exception(exc)
        echo("grpokit serve: stopped")
    finally:
        httpd.shutdown()
        if httpd.served is not None:
            httpd.served.engine.close()
