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
- Weights: the trainable tensors (tied names included: weights.trainable_tensors) are written to a safetensors
  file in /dev/shm (memory, not disk); /update_weights names it and the server loads it through the colocated
  engine's reload path; the client deletes the file. The server must therefore share this machine's /dev/shm.
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

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import torch
import torch.distributed as dist

from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
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
    push_error,
    trainable_tensors,
    write_push,
)


class ServerError(RolloutError):
    """The rollout server cannot be reached, serves another model, or did not answer in time (a user's
    fix)."""


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
        "tensors": {name: list(t.shape) for name, t in trainable_tensors(model, everything=True)},
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


class VLLMServerEngine(RolloutEngine):
    """rollout.engine=vllm with rollout.vllm_mode=server: generates on a `grpokit serve` process over HTTP."""

    # Under torchrun every rank is a client and rank 0 alone pushes (sync_weights). No LoRA on the server.
    caps = EngineCaps(
        sampling_logprobs=True, several_ranks=True, lora=False, stop_sequences=True, own_process=True
    )

    @classmethod
    def from_config(cls, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None):
        """The engine of a run (grpokit/rollout/engines.py: make_engine)."""
        return cls(model, tokenizer, url=rollout.vllm_server_url, timeout=rollout.vllm_server_timeout)

    def __init__(self, model, tokenizer, *, url: str, timeout: float = 240.0, verify: bool = True):
        self.url, self.timeout, self.tokenizer, self.verify = url.rstrip("/"), timeout, tokenizer, verify
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pushes = 0  # weight pushes so far
        self.version: int | None = (
            None  # the policy version the server samples from (its reply to the last push)
        )
        self.last_push_error: float | None = None  # the check's max |diff| of the last push
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({})
        )  # localhost, not the http_proxy
        info = self._wait_until_up()
        self._check_same_model(info, model)
        self.dtype = getattr(
            torch, info["dtype"]
        )  # the server's weights (what the push check's tolerance depends on)
        self.sync_weights(
            model, version=0
        )  # the trainer's weights (a fine-tuned or resumed policy, not MODEL_DIR's)

    # ------------------------------------------------------------------ HTTP
    def _request(self, path: str, body: dict | None = None) -> dict:
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
            raise ServerDown(self._down(f"({exc.reason})")) from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise ServerError(
                f"the rollout server at {self.url} dropped the connection during {method} {path} ({exc!r}): "
                "did it stop? Its output says why; start it again with `grpokit serve` and resume"
            ) from None

    def _timed_out(self, method: str, path: str) -> ServerError:
        return ServerError(
            f"the rollout server at {self.url} did not answer {method} {path} within {self.timeout:g} s "
            "(rollout.vllm_server_timeout): raise rollout.vllm_server_timeout, or see the server's output"
        )

    def _down(self, detail: str) -> str:
        port = urllib.parse.urlsplit(self.url).port or 80
        return (
            f"no rollout server answers at {self.url} (rollout.vllm_server_url) {detail}: start one with "
            f"`grpokit serve MODEL_DIR --port {port}`, or use rollout.vllm_mode=colocate"
        )

    def _wait_until_up(self) -> dict:
        """The server's /info, once /health says it is ready (a server just started loads for a while):
        retried until rollout.vllm_server_timeout."""
        deadline, status = time.monotonic() + self.timeout, None
        while True:
            try:
                status = self._request("/health")["status"]
                if status == "ok":
                    return self._request("/info")
            except ServerDown:
                pass
            if time.monotonic() > deadline:
                if status == "loading":
                    raise ServerError(
                        f"the rollout server at {self.url} was still loading after {self.timeout:g} s "
                        "(rollout.vllm_server_timeout): wait for its 'ready' line, or raise the timeout"
                    )
                raise ServerError(self._down(f"after {self.timeout:g} s (rollout.vllm_server_timeout)"))
            time.sleep(0.5)

    def _check_same_model(self, info: dict, model) -> None:
        ours = model_info(model, self.tokenizer)
        name = getattr(base_model(model).config, "_name_or_path", "") or "MODEL_DIR"
        fix = f"start it on the trainer's model: `grpokit serve {name}`"
        if (why := model_difference(info, ours)) is not None:
            raise ServerError(
                f"the rollout server at {self.url} serves another model ({info['model']}) than the "
                f"trainer's: {why}; {fix}"
            )
        if info["dtype"] != ours["dtype"]:
            raise ServerError(
                f"the rollout server at {self.url} runs {info['dtype']} weights, the trainer {ours['dtype']} "
                f"(model.dtype): {fix} --dtype {ours['dtype']}"
            )
        if info["eos_ids"] != ours["eos_ids"]:
            raise ServerError(
                f"the rollout server at {self.url} stops at EOS ids {info['eos_ids']}, the trainer at "
                f"{ours['eos_ids']}: {fix} --tokenizer <the trainer's tokenizer>"
            )

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model, version: int | None = None) -> None:
        """Push the trainable tensors of `model` to the server and check them. version: the policy version
        these weights are (the trainer's step); None = one more than the server's last. Under torchrun
        every rank calls this at the same point and rank 0 alone pushes (sync_ranks)."""
        if several_ranks():
            self.sync_ranks(model, version)
            return
        self.push(trainable_tensors(model, everything=self.pushes == 0), version=version)
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
        named, main = gathered(trainable_tensors(model, everything=self.pushes == 0)), dist.get_rank() == 0
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
        """Write (name, tensor) pairs to a file in /dev/shm, have the server load it; returns the server's
        version."""
        path, aliases = write_push(list(named), push_dir())
        try:
            reply = self._request("/update_weights", {"path": path, "aliases": aliases, "version": version})
        finally:
            os.unlink(path)
        self.pushes += 1
        self.version = reply["version"]
        return self.version

    def verify_push(self, model) -> float:
        """max |the server's prompt log-probs - model's| on a probe fixed per push; RolloutError above
        PUSH_TOLERANCE."""
        ids = probe_ids(model, self.pushes)
        self.last_push_error = push_error(self._request("/score", {"token_ids": ids})["logprobs"], model, ids)
        return check_push(
            self.last_push_error, model, self.dtype, self.pushes, where=f"vLLM server ({self.url})"
        )

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        reply = self._request(
            "/generate",
            {
                "prompt_token_ids": [list(p) for p in prompt_token_ids],
                "n": n,
                "sampling": sampling_to_wire(sampling),
                "seed": draw_seed(sampling),
            },
        )
        token_ids = reply["token_ids"]
        return Completions(
            token_ids=token_ids,
            texts=self.tokenizer.batch_decode(token_ids, skip_special_tokens=True),
            finish_reasons=reply["finish_reasons"],
            logprobs=reply["logprobs"],
            versions=reply["versions"],
        )
