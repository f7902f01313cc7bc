"""rollout.vllm_mode=server: the trainer's side of a `grpokit serve` rollout server
(grpokit/rollout/serve.py).

    grpokit serve MODEL_DIR --port 8000                                        # a terminal of its own
    grpokit train cfg.yaml rollout.engine=vllm rollout.vllm_mode=server rollout.vllm_server_url=http://127.0.0.1:8000

    # waits for the server, checks its model
    engine = VLLMServerEngine(model, tokenizer, url="http://127.0.0.1:8000")
    # comps.versions from the server
    comps = engine.generate(prompt_ids, n=8, sampling=SamplingParams(max_tokens=16))
    # push through /dev/shm, checked
    engine.sync_weights(model, version=step)

The same contract as the colocated engine (grpokit/rollout/vllm.py), whose class the server hosts:
- Samples: the client draws the base seed from sampling.generator or torch's global generator (draw_seed) and
  sends it, so the run's seed decides the server's samples exactly as it decides the colocated engine's.
- Weights: the trainable tensors (tied names included; for a LoRA policy the adapted layers with the adapters
  merged in, as the colocated engine pushes them: weights.pushed_tensors) are written to a safetensors file in
  /dev/shm (memory, not disk); /update_weights names it and the server loads it through the colocated engine's
  reload path; the client deletes the file. The server must therefore share this machine's /dev/shm.
  Or (rollout.vllm_weight_sync=broadcast, and auto for several servers or one elsewhere) a torch.distributed
  broadcast in a process group of the trainer and the servers (grpokit/rollout/fleet.py), to servers anywhere.
- A fleet: rollout.vllm_server_url lists several servers; each generate call spreads its prompts over them in
  order (prompt i still samples with base seed + i * n), every push goes to all and is checked on each, and a
  server that stops answering is named in a warning, dropped, and its prompts retried on the others; with none
  left, a ServerError.
- Every push is checked: the server scores a probe sequence (/score) and the client compares with the
  trainer's own log-probs (weights.check_push, max |diff| <= PUSH_TOLERANCE); a push that did not take is a
  RolloutError.
- Versions: the server counts the pushes it took (or records the version a push names) and returns it with
  every sample (Completions.versions).
- Under torchrun every rank is a client and samples its share of the prompts on the server; rank 0 alone
  pushes and checks (sync_ranks: FSDP2's tensors gathered one at a time with every rank), and every rank
  waits for that push before it samples again.
Errors a user can fix (no server at the URL, a server on another model, a request past
rollout.vllm_server_timeout) are ServerError, one line naming the fix. HTTP goes straight to the server, never
through an http_proxy.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.fleet import WeightGroup, facing_address, split_prompts, tensor_specs
from grpokit.rollout.hf import eos_token_ids
from grpokit.rollout.vllm import draw_seed, several_ranks
from grpokit.rollout.weights import (
    RolloutError,
    base_model,
    check_push,
    gathered,
    model_prompt_logprobs,
    probe_ids,
    push_dir,
    pushed_shapes,
    pushed_tensors,
    unique_tensors,
    write_push,
)

logger = logging.getLogger("grpokit.rollout")


class ServerError(RolloutError):
    """The rollout server cannot be reached, serves another model, or did not answer in time (a user's
    fix). problem: the message without its fix, for a line about several servers that gives one fix."""

    def __init__(self, message: str, problem: str | None = None):
        super().__init__(message)
        self.problem = problem or message


class ServerDown(ServerError):
    """Nothing accepts connections at the URL (yet): the one error waiting for the server retries."""


def sampling_to_wire(sampling: SamplingParams) -> dict:
    """SamplingParams as JSON, without the generator (the client draws the seed from it: draw_seed)."""
    return dict(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        greedy=sampling.greedy,
        stop_token_ids=[list(s) for s in sampling.stop_token_ids],
    )


def sampling_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**{**d, "stop_token_ids": tuple(tuple(s) for s in d.get("stop_token_ids", ()))})


def model_info(model, tokenizer) -> dict:
    """What the client and the server compare before the first push: the tensors a push sends and their
    shapes, the weights' dtype, the EOS ids (they decide finish reasons), the architecture and the vocabulary
    size."""
    cfg = base_model(model).config
    return {
        "architectures": list(getattr(cfg, "architectures", None) or [type(base_model(model)).__name__]),
        "vocab_size": cfg.get_text_config(decoder=True).vocab_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "eos_ids": sorted(eos_token_ids(model, tokenizer)),
        "tensors": pushed_shapes(model),
    }


def model_difference(theirs: dict, ours: dict) -> str | None:
    """The first way the server's model_info differs from the trainer's, in words; None when they agree."""
    if theirs["architectures"] != ours["architectures"]:
        return (
            f"it serves {'/'.join(theirs['architectures'])}, the trainer trains "
            f"{'/'.join(ours['architectures'])}"
        )
    if theirs["vocab_size"] != ours["vocab_size"]:
        return f"its vocabulary has {theirs['vocab_size']} tokens, the trainer's {ours['vocab_size']}"
    names = [n for n in ours["tensors"] if theirs["tensors"].get(n) != ours["tensors"][n]]
    if names:
        n = names[0]
        return f"tensor {n} is {theirs['tensors'].get(n, 'missing')} there, {ours['tensors'][n]} here" + (
            f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        )
    return None


class ServerClient:
    """One `grpokit serve` process: its URL, JSON over HTTP with rollout.vllm_server_timeout, the wait for it
    to come up."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout
        # straight to the server, not through an http_proxy
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, path: str, body: dict | None = None) -> dict:
        """GET (no body) or POST JSON; the reply's JSON. Every failure is one line naming the server and the
        fix."""
        method = "GET" if body is None else "POST"
        req = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method=method,
        )
        try:
            with self._opener.open(req, timeout=self.timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:  # the server answered with an error: its message
            try:
                what = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                what = exc.reason
            raise RolloutError(
                f"the rollout server at {self.url} failed on {method} {path}: {what}"
            ) from None
        except TimeoutError as exc:
            raise self._timed_out(method, path) from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise self._timed_out(method, path) from None
            raise ServerDown(*self._down(f"({exc.reason})")) from None
        except (ConnectionError, http.client.HTTPException) as exc:
            problem = (
                f"the rollout server at {self.url} dropped the connection during {method} {path} ({exc!r})"
            )
            raise ServerError(
                f"{problem}: did it stop? Its output says why; start it again with `grpokit serve` and "
                "resume",
                problem,
            ) from None

    def _timed_out(self, method: str, path: str) -> ServerError:
        problem = (
            f"the rollout server at {self.url} did not answer {method} {path} within {self.timeout:g} s "
            "(rollout.vllm_server_timeout)"
        )
        return ServerError(
            f"{problem}: raise rollout.vllm_server_timeout, or see the server's output", problem
        )

    def _down(self, detail: str) -> tuple[str, str]:
        """(the line, the problem alone) of a URL where nothing answers."""
        port = urllib.parse.urlsplit(self.url).port or 80
        problem = f"no rollout server answers at {self.url} (rollout.vllm_server_url) {detail}"
        return (
            f"{problem}: start one with `grpokit serve MODEL_DIR --port {port}`, or use "
            "rollout.vllm_mode=colocate",
            problem,
        )

    def wait_until_up(self) -> dict:
        """The server's /info, once /health says it is ready (a server just started loads for a while):
        retried until rollout.vllm_server_timeout."""
        deadline, status = time.monotonic() + self.timeout, None
        while True:
            try:
                status = self.request("/health")["status"]
                if status == "ok":
                    return self.request("/info")
            except ServerDown:
                pass
            if time.monotonic() > deadline:
                if status == "loading":
                    raise ServerError(
                        f"the rollout server at {self.url} was still loading after {self.timeout:g} s "
                        "(rollout.vllm_server_timeout): wait for its 'ready' line, or raise the timeout"
                    )
                raise ServerError(*self._down(f"after {self.timeout:g} s (rollout.vllm_server_timeout)"))
            time.sleep(0.5)

    def local_address(self) -> str:
        """This machine's address on the connection to the server (the address the server sees)."""
        parts = urllib.parse.urlsplit(self.url)
        return facing_address(parts.hostname or "", parts.port or 80)

    @property
    def loopback(self) -> bool:
        host = urllib.parse.urlsplit(self.url).hostname or ""
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def weight_sync_mode(mode: str, servers: list[ServerClient]) -> str:
    """rollout.vllm_weight_sync as it applies: auto is shm for one server at a loopback address, else
    broadcast."""
    if mode != "auto":
        return mode
    return "shm" if len(servers) == 1 and servers[0].loopback else "broadcast"


class VLLMServerEngine(RolloutEngine):
    """rollout.engine=vllm with rollout.vllm_mode=server: generates on one `grpokit serve` process, or a
    fleet of them, over HTTP."""

    # Under torchrun every rank is a client and rank 0 alone pushes (sync_weights). LoRA: merged weights.
    caps = EngineCaps(
        sampling_logprobs=True,
        several_ranks=True,
        stop_sequences=True,
        own_process=True,
        whole_copy=False,
        lag_at_ranks=False,
    )

    @classmethod
    def from_config(cls, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None):
        """The engine of a run (grpokit/rollout/engines.py: make_engine)."""
        return cls(
            model,
            tokenizer,
            url=rollout.server_urls,
            timeout=rollout.vllm_server_timeout,
            weight_sync=rollout.vllm_weight_sync,
            sync_host=rollout.vllm_weight_sync_host,
        )

    def __init__(
        self,
        model,
        tokenizer,
        *,
        url: str | list[str],
        timeout: float = 240.0,
        verify: bool = True,
        weight_sync: str = "auto",
        sync_host: str = "",
    ):
        urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else list(url)
        self.servers = [ServerClient(u, timeout) for u in urls]  # the fleet: the servers still up
        self.url, self.timeout, self.tokenizer, self.verify = self.servers[0].url, timeout, tokenizer, verify
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pushes = 0  # weight pushes so far
        self.version: int | None = None  # the policy version the servers sample from (their reply to a push)
        self.last_push_error: float | None = None  # the check's max |diff| of the last push, over the servers
        self.push_checks = 0  # servers whose last push was checked
        self.gone: list[str] = []  # "URL (why)" of each server dropped from the fleet
        self.weight_sync, self.sync_host = weight_sync_mode(weight_sync, self.servers), sync_host
        self.group: WeightGroup | None = None  # the broadcast's process group, built by the first push
        infos = [server.wait_until_up() for server in self.servers]
        for server, info in zip(self.servers, infos, strict=True):
            self._check_same_model(server, info, model)
        self.dtype = getattr(torch, infos[0]["dtype"])  # the servers' weights (the push check's tolerance)
        # the trainer's weights (a fine-tuned or resumed policy, not MODEL_DIR's)
        self.sync_weights(model, version=0)

    @property
    def fleet_size(self) -> int:
        return len(self.servers)

    def _request(self, path: str, body: dict | None = None) -> dict:
        """A request to the first server of the fleet."""
        return self.servers[0].request(path, body)

    def _check_same_model(self, server: ServerClient, info: dict, model) -> None:
        ours = model_info(model, self.tokenizer)
        name = getattr(base_model(model).config, "_name_or_path", "") or "MODEL_DIR"
        fix = f"start it on the trainer's model: `grpokit serve {name}`"
        if (why := model_difference(info, ours)) is not None:
            raise ServerError(
                f"the rollout server at {server.url} serves another model ({info['model']}) than the "
                f"trainer's: {why}; {fix}"
            )
        if info["dtype"] != ours["dtype"]:
            raise ServerError(
                f"the rollout server at {server.url} runs {info['dtype']} weights, the trainer "
                f"{ours['dtype']} (model.dtype): {fix} --dtype {ours['dtype']}"
            )
        if info["eos_ids"] != ours["eos_ids"]:
            raise ServerError(
                f"the rollout server at {server.url} stops at EOS ids {info['eos_ids']}, the trainer at "
                f"{ours['eos_ids']}: {fix} --tokenizer <the trainer's tokenizer>"
            )

    # ------------------------------------------------------------------ the fleet
    def _each(self, jobs: Sequence[tuple[ServerClient, Callable[[], Any]]], during=None) -> list:
        """Run each job (a request to its server) in a thread of its own, and `during` in this one meanwhile;
        each job's result or exception, in order. An exception of `during` is raised once the jobs end."""
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            futures = [pool.submit(job) for _, job in jobs]
            failed = None
            if during is not None:
                try:
                    during()
                except Exception as exc:  # a failed collective: the jobs still end (each has its timeout)
                    failed = exc
            results = [f.exception() or f.result() for f in futures]
        if failed is not None:
            raise ServerError(
                f"the weight broadcast to the rollout servers failed ({failed}); see their output"
            ) from None
        return results

    def _drop(self, server: ServerClient, why: Exception, did: str) -> None:
        """Take a server that failed out of the fleet (the weight group is rebuilt before the next push);
        ServerError when none is left."""
        if server not in self.servers:
            return
        self.servers.remove(server)
        self.gone.append(f"{server.url} ({why.problem if isinstance(why, ServerError) else why})")  # one fix
        self.group = None
        if not self.servers:
            raise ServerError(
                f"no rollout server is left (rollout.vllm_server_url): {'; '.join(self.gone)}; start them "
                "again with `grpokit serve` and resume the run"
            )
        logger.warning(
            "rollout server %s is gone (%s): %s; %d of %d servers left (%s)",
            server.url,
            why,
            did,
            len(self.servers),
            len(self.servers) + len(self.gone),
            ", ".join(s.url for s in self.servers),
        )

    def _drop_unreachable(self) -> int:
        """Drop the servers whose /health does not answer; how many."""
        jobs = [(s, functools.partial(s.request, "/health")) for s in self.servers]
        dropped = 0
        for (server, _), result in zip(jobs, self._each(jobs), strict=True):
            if isinstance(result, ServerError):
                self._drop(server, result, "dropped from the fleet before the weight push")
                dropped += 1
        return dropped

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model, version: int | None = None) -> None:
        """Push the trainable tensors of `model` to the server and check them. version: the policy version
        these weights are (the trainer's step); None = one more than the server's last. Under torchrun
        every rank calls this at the same point and rank 0 alone pushes (sync_ranks)."""
        if several_ranks():
            self.sync_ranks(model, version)
            return
        self.push(pushed_tensors(model, everything=self.pushes == 0), version=version)
        if self.verify:
            self.verify_push(base_model(model))

    def sync_ranks(self, model, version: int | None) -> None:
        """sync_weights under torchrun, where every rank samples from the same server: rank 0 pushes and
        checks. An FSDP2 module's tensors are gathered one at a time and the check's probe forward is run by
        every rank (both are collectives), so no rank keeps a whole copy of the policy. Rank 0's reply (the
        server's version) then reaches every rank in one broadcast, which no rank passes before the push
        took and was checked: none samples from stale weights. A push that failed raises on rank 0, and
        torchrun stops the others."""
        reshard = getattr(model, "reshard", lambda: None)  # FSDP2: parameters back to shards after a forward
        reshard()
        named, main = gathered(pushed_tensors(model, everything=self.pushes == 0)), dist.get_rank() == 0
        if main:  # the whole tensors (FSDP2: gathered) for the time of the push, then dropped
            self.push(list(named), version=version)
        else:
            for _ in named:  # this rank's part in each gather
                pass
            self.pushes += 1
        if self.verify:
            sharded = hasattr(model, "reshard")  # FSDP2: the forward through its root, on every rank
            probe_model = model if sharded else base_model(model)
            if main:
                self.verify_push(probe_model)
            elif sharded:
                model_prompt_logprobs(probe_model, probe_ids(probe_model, self.pushes))
            reshard()  # as the trainer left them: the check's forward leaves the root's unsharded
        reply = [self.version]
        dist.broadcast_object_list(reply, src=0)  # every rank waits here for rank 0's push and check
        self.version = reply[0]

    def push(self, named, version: int | None = None) -> int:
        """Send (name, tensor) pairs to every server (rollout.vllm_weight_sync: a file in /dev/shm, or the
        weight group's broadcast) and have each load them; returns the servers' version. A server that does
        not answer is dropped from the fleet, and the push goes again to the others."""
        named = list(named)
        if self.pushes:
            self._drop_unreachable()
        try:
            replies = self._push_once(named, version)
        except ServerError:
            if not self._drop_unreachable():
                raise
            replies = self._push_once(named, version)
        self.pushes += 1
        self.version = replies[0]["version"]
        return self.version

    def _push_once(self, named: list, version: int | None) -> list[dict]:
        """One push to every server of the fleet; the first server's failure is raised."""
        results = (
            self._push_file(named, version)
            if self.weight_sync == "shm"
            else self._push_broadcast(named, version)
        )
        for result in results:
            if isinstance(result, Exception):
                self.group = None  # a server that failed a push leaves the group unusable
                raise result
        return results

    def _push_file(self, named: list, version: int | None) -> list:
        """One file in /dev/shm that every server (on this machine) loads."""
        path, aliases = write_push(named, push_dir())
        body = {"path": path, "aliases": aliases, "version": version}
        try:
            return self._each(
                [(s, functools.partial(s.request, "/update_weights", body)) for s in self.servers]
            )
        finally:
            os.unlink(path)

    def _push_broadcast(self, named: list, version: int | None) -> list:
        """/update_weights to every server at once (each then waits in the broadcast), and the broadcast."""
        unique, aliases = unique_tensors(named)
        if self.group is None or self.group.size != len(self.servers) + 1:
            self._build_group(unique[0][1].device if unique else torch.device("cpu"))
        group = self.group
        assert group is not None
        body = {"broadcast": True, "tensors": tensor_specs(unique), "aliases": aliases, "version": version}
        jobs = [(s, functools.partial(s.request, "/update_weights", body)) for s in self.servers]
        try:
            return self._each(jobs, during=lambda: group.send(unique))
        except ServerError:
            self.group = None  # a failed collective leaves the group unusable
            raise

    def _build_group(self, device: torch.device) -> None:
        """The weight group of this process (rank 0) and the servers (ranks 1..N, in fleet order)."""
        host = self.sync_host or self.servers[0].local_address()
        group = WeightGroup(host, len(self.servers), self.timeout, device)
        jobs = [
            (
                s,
                functools.partial(
                    s.request,
                    "/init_weight_group",
                    {
                        "host": host,
                        "port": group.port,
                        "rank": rank,
                        "world_size": group.size,
                        "timeout": self.timeout,
                    },
                ),
            )
            for rank, s in enumerate(self.servers, start=1)
        ]
        for result in self._each(jobs, during=group.join):
            if isinstance(result, Exception):
                raise result
        self.group = group

    def verify_push(self, model) -> float:
        """max |each server's prompt log-probs - model's| on a probe fixed per push; RolloutError above
        PUSH_TOLERANCE, naming the server."""
        ids = probe_ids(model, self.pushes)
        ours = model_prompt_logprobs(model, ids)
        errors = []
        for server in self.servers:
            theirs = torch.tensor(
                server.request("/score", {"token_ids": ids})["logprobs"], dtype=torch.float64
            )
            errors.append((ours - theirs).abs().max().item())
            check_push(errors[-1], model, self.dtype, self.pushes, where=f"vLLM server ({server.url})")
        self.last_push_error, self.push_checks = max(errors), len(errors)
        return self.last_push_error

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        """Whole prompt groups spread over the servers in order, in parallel; prompt i samples with the base
        seed + i * n wherever it runs (the colocated engine's seeds), so the fleet's samples are one server's.
        The prompts of a server that fails go to the others; the batch is whole or a ServerError."""
        prompts = [list(p) for p in prompt_token_ids]
        body = {"n": n, "sampling": sampling_to_wire(sampling)}
        seed = draw_seed(sampling)
        chunks = split_prompts(len(prompts), len(self.servers)) or [(0, 0)]
        replies: dict[int, dict] = {}
        while pending := [c for c in chunks if c[0] not in replies]:
            servers = list(self.servers)
            jobs = [
                (
                    servers[k % len(servers)],
                    functools.partial(
                        servers[k % len(servers)].request,
                        "/generate",
                        {**body, "prompt_token_ids": prompts[a:b], "seed": seed + a * n},
                    ),
                )
                for k, (a, b) in enumerate(pending)
            ]
            for (a, _), (server, _), result in zip(pending, jobs, self._each(jobs), strict=True):
                if isinstance(result, ServerError):
                    self._drop(server, result, "its prompts go to the others, with the same seeds")
                elif isinstance(result, Exception):
                    raise result
                else:
                    replies[a] = result
        token_ids, reasons, logprobs, versions = [], [], [], []
        for a, _ in chunks:
            token_ids += replies[a]["token_ids"]
            reasons += replies[a]["finish_reasons"]
            logprobs += replies[a]["logprobs"]
            versions += replies[a]["versions"]
        return Completions(
            token_ids=token_ids,
            texts=self.tokenizer.batch_decode(token_ids, skip_special_tokens=True),
            finish_reasons=reasons,
            logprobs=logprobs,
            versions=versions,
        )
