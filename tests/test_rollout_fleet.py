"""A rollout fleet, for real: two `grpokit serve` processes, each in a network namespace of its own (a host of
its own: its own address, no loopback and no /dev/shm shared with the trainer), weights pushed to both by a
gloo broadcast, each step's prompts spread over both; a server killed mid-run.

The namespaces: one bridge in the test's namespace (10.77.0.1/24) and, per server, a namespace joined to it by
a veth pair (10.77.0.2, 10.77.0.3). One segment, not a routed /24 per server: gloo connects every pair of
ranks, so the servers must reach each other, and routing between namespaces would need the host's
ip_forward. Where namespaces cannot be made (not root, no `ip`), the servers listen on loopback addresses
(127.0.0.2, 127.0.0.3) and the test says so in a warning.
"""

import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest
import torch

from grpokit.rollout import SamplingParams
from grpokit.rollout.fleet import (
    BUCKET_BYTES,
    WeightGroup,
    join_group,
    plan_buckets,
    receive,
    split_prompts,
    tensor_specs,
)
from grpokit.rollout.server import ServerError, VLLMServerEngine
from tests.helpers import read_metrics, require
from tests.test_rollout_server import START_TIMEOUT_S, _die_with_parent, start_server, stop_server
from tests.test_rollout_vllm import grpo_config, load, prompts

TAG = os.getpid() % 100000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """n addresses for the servers: namespaces on a bridge, or loopback addresses (`reason` says why)."""

    def __init__(self, n: int):
        self.namespaces: list[str] = []
        self.bridge = f"gkbr{TAG}"
        self.reason = ""
        try:
            self._make(n)
        except (OSError, subprocess.SubprocessError) as exc:
            self.close()
            self.reason = f"no network namespaces ({exc}): the servers listen on loopback addresses instead"
            warnings.warn(self.reason, stacklevel=2)
            self.namespaces, self.addresses = [], [f"127.0.0.{i + 2}" for i in range(n)]

    def _make(self, n: int) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise OSError("needs root and iproute2's `ip`")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", "10.77.0.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.addresses = []
        for i in range(1, n + 1):
            ns, host_end, ns_end = f"gkfleet{TAG}_{i}", f"gkv{TAG}h{i}", f"gkv{TAG}n{i}"
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.addresses.append(f"10.77.0.{i + 1}")

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i], *argv] if self.namespaces else argv

    def close(self) -> None:
        for ns in self.namespaces:  # its veth end goes with it, and the peer with that
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


class Fleet:
    """`grpokit serve` on each host, port 8000, its output in a log of its own."""

    def __init__(self, hosts: Hosts, model_dir, logs):
        self.hosts, self.procs, self.logs = hosts, [], []
        for i, addr in enumerate(hosts.addresses):
            log = logs / f"serve{i}.log"
            argv = [
                sys.executable,
                "-m",
                "grpokit",
                "serve",
                str(model_dir),
                "--host",
                addr,
                "--port",
                "8000",
            ]
            argv += ["--threads", "1", "--max-num-seqs", "64"]
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        hosts.command(i, argv),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        preexec_fn=_die_with_parent,
                    )
                )
            self.logs.append(log)
        self.urls = [f"http://{addr}:8000" for addr in hosts.addresses]

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def health(self, i: int) -> dict:
        import json

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.urls[i] + "/health", timeout=30) as reply:
            return json.loads(reply.read())

    def wait_ready(self) -> None:
        """Until every server's /health says ok (vLLM loads for a while), at most START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for i in range(len(self.urls)):
            while True:
                try:
                    if self.health(i)["status"] == "ok":
                        break
                except OSError:  # not listening yet
                    pass
                assert time.monotonic() < deadline, (
                    f"server {i} not ready: {self.logs[i].read_text()[-2000:]}"
                )
                time.sleep(0.5)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                stop_server(proc)


@pytest.fixture(scope="module")
def fleet(vllm_model_dir, tmp_path_factory):
    """Two servers on two hosts; the last test of the module kills one."""
    require("vllm")
    hosts = Hosts(2)
    servers = None
    try:
        servers = Fleet(hosts, vllm_model_dir, tmp_path_factory.mktemp("fleet"))
        yield servers
    finally:
        if servers is not None:
            servers.close()
        hosts.close()


def connect(fleet, model, tok, urls=None, **kw):
    return VLLMServerEngine(model, tok, url=urls or fleet.urls, timeout=START_TIMEOUT_S, **kw)


def server_run_config(model_dir, tmp_path, urls: list[str], timeout: float = START_TIMEOUT_S):
    """4 GRPO steps (tests/test_rollout_vllm.py's run) in server mode on `urls`, into tmp_path/run."""
    return grpo_config(
        model_dir,
        tmp_path / "run",
        "optim.max_steps=4",
        "rollout.engine=vllm",
        "rollout.vllm_mode=server",
        f"rollout.vllm_server_url={','.join(urls)}",
        f"rollout.vllm_server_timeout={timeout:g}",
    )


# ------------------------------------------------------------------------------------------ no server needed
def test_prompts_are_split_in_order_into_near_equal_shares():
    assert split_prompts(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert split_prompts(2, 3) == [(0, 1), (1, 2)]  # a server with no share gets no request
    assert split_prompts(4, 1) == [(0, 4)]


def test_the_server_list_is_a_yaml_list_or_comma_separated_and_a_bad_entry_is_one_line():
    from grpokit.config import load_config

    def urls(value: str) -> list[str]:
        return load_config(None, [f"rollout.vllm_server_url={value}"]).rollout.server_urls

    assert urls("http://10.0.0.2:8000,http://10.0.0.3:8000/") == [
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ]
    assert urls("[http://10.0.0.2:8000, http://10.0.0.3:8000]") == [
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ]
    assert urls("http://127.0.0.1:8000") == ["http://127.0.0.1:8000"]
    with pytest.raises(
        Exception, match=r"rollout.vllm_server_url='10.0.0.3:8000' must be http://HOST:PORT"
    ) as bad:
        urls("http://10.0.0.2:8000,10.0.0.3:8000")
    assert "\n" not in str(bad.value)
    with pytest.raises(Exception, match="rollout.vllm_server_url lists a server twice"):
        urls("http://a:1,http://a:1")
    with pytest.raises(Exception, match="vllm_weight_sync"):
        load_config(None, ["rollout.vllm_weight_sync=nfs"])


def test_auto_weight_sync_is_the_file_for_one_local_server_and_the_broadcast_otherwise():
    from grpokit.rollout.server import ServerClient, weight_sync_mode

    def mode(*urls: str, key: str = "auto") -> str:
        return weight_sync_mode(key, [ServerClient(u, 1.0) for u in urls])

    assert mode("http://127.0.0.1:8000") == mode("http://localhost:8000") == "shm"
    assert mode("http://10.0.0.2:8000") == "broadcast"
    assert mode("http://127.0.0.1:8000", "http://127.0.0.1:8001") == "broadcast"
    assert mode("http://127.0.0.1:8000", "http://127.0.0.1:8001", key="shm") == "shm"
    assert mode("http://127.0.0.1:8000", key="broadcast") == "broadcast"


def test_a_broadcast_delivers_every_tensor_bit_for_bit_in_few_buckets():
    """The trainer's WeightGroup and a receiver in a thread of this process, over gloo on loopback: every
    tensor arrives with its name, dtype and shape, bit for bit; many small tensors travel in one bucket."""
    import threading

    named = [(f"t{i}", torch.randn(17, 3)) for i in range(300)]
    named += [
        ("ids", torch.arange(7)),
        ("half", torch.randn(5).bfloat16()),
        ("big", torch.zeros(BUCKET_BYTES // 4)),
    ]
    specs = tensor_specs(named)
    assert len(plan_buckets(specs)) == 2  # the 302 small ones, then the one of a whole bucket
    group, got = WeightGroup("127.0.0.1", 1, 60.0, torch.device("cpu")), {}

    def server():
        pg = join_group("127.0.0.1", group.port, 1, 2, 60.0, torch.device("cpu"))
        got["named"] = receive(pg, specs, torch.device("cpu"), 60.0)

    thread = threading.Thread(target=server)
    thread.start()
    group.join()
    group.send(named)
    thread.join()
    assert [n for n, _ in got["named"]] == [n for n, _ in named]
    assert all(
        a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(named, got["named"], strict=True)
    )


# ------------------------------------------------------------------------------------------ the fleet
@pytest.mark.slow
def test_the_fleets_samples_are_one_servers_and_each_server_takes_the_broadcast(fleet, vllm_model_dir):
    model, tok = load(vllm_model_dir)
    both = connect(fleet, model, tok)  # waits for both, checks their models, pushes by broadcast (checked)
    assert both.weight_sync == "broadcast" and both.push_checks == 2 and both.last_push_error < 1e-3
    if not fleet.hosts.reason:  # the group's address: the trainer's end of the bridge, as the servers see it
        assert both.group is not None and both.group.address == "10.77.0.1"
    else:
        assert ipaddress.ip_address(both.group.address).is_loopback
    p, sampling = prompts(tok) * 3, SamplingParams(max_tokens=12)
    torch.manual_seed(7)
    spread = both.generate(p, 4, sampling)
    assert [fleet.health(i)["samples"] > 0 for i in range(2)] == [True, True]  # each served its share
    one = connect(fleet, model, tok, urls=fleet.urls[:1])  # one server, still by broadcast (not loopback)
    torch.manual_seed(7)
    alone = one.generate(p, 4, sampling)
    assert spread.token_ids == alone.token_ids and spread.finish_reasons == alone.finish_reasons
    assert spread.versions == alone.versions == [0] * len(alone)
    assert len({tuple(x) for x in spread.token_ids}) > 4  # samples, not copies


@pytest.mark.slow
def test_grpo_on_a_fleet_of_two_every_push_reaches_both(fleet, vllm_model_dir, tmp_path):
    from grpokit.trainer import Trainer

    cfg = server_run_config(
        vllm_model_dir, tmp_path, fleet.urls
    )  # a comma-separated list, the command line's form
    trainer = Trainer(cfg)  # waits for both servers
    before = [fleet.health(i)["samples"] for i in range(2)]
    trainer.train()
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 4
    assert all(r["rollout/push_checks"] == 2 and r["rollout/servers"] == 2 for r in steps), steps
    assert all(r["rollout/push_error"] < 1e-3 and r["rollout/logp_diff_max"] < 1e-3 for r in steps)
    # both took the last push (the version of step 4), and both sampled
    assert [fleet.health(i)["version"] for i in range(2)] == [4, 4]
    assert all(fleet.health(i)["samples"] > before[i] for i in range(2))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_trains_on_a_fleet_of_two_fed_by_the_broadcast(fleet, vllm_model_dir, tmp_path, strategy):
    """`torchrun --nproc_per_node 2 -m grpokit train ... rollout.vllm_mode=server` with both servers and
    rollout.vllm_weight_sync=broadcast: each rank spreads its share of the prompts over the two servers, and
    rank 0 alone pushes (under FSDP2 the tensors gathered from the shards with both ranks) by the gloo
    broadcast to both and checks each: rollout/push_checks is 2 per step (rank 0's two checks, summed over
    the ranks), the servers end at the last step's version, both sampled, and no sample of either rank lags
    or comes from other weights than the trainer's."""
    from tests.test_distributed import _output
    from tests.test_vllm_torchrun import _config, _launch

    config = _config(tmp_path, vllm_model_dir, strategy)
    fleet.wait_ready()
    before = [fleet.health(i)["samples"] for i in range(2)]
    proc = _launch(
        tmp_path,
        "-m",
        "grpokit",
        "train",
        str(config),
        "rollout.vllm_mode=server",
        f"rollout.vllm_server_url={','.join(fleet.urls)}",
        "rollout.vllm_weight_sync=broadcast",
        f"rollout.vllm_server_timeout={START_TIMEOUT_S}",
    )
    assert proc.returncode == 0, _output(proc)
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/push_checks"] == 2 and r["rollout/servers"] == 2, r
        assert r["rollout/push_error"] < 1e-3 and r["rollout/logp_diff_max"] < 1e-3, r
        assert r["rollout/version_lag_max"] == 0, r
    assert [fleet.health(i)["version"] for i in range(2)] == [2, 2]
    assert all(fleet.health(i)["samples"] > before[i] for i in range(2))


@pytest.mark.slow
def test_a_server_that_stops_answering_is_dropped_after_the_timeout(fleet, vllm_model_dir, caplog):
    """SIGSTOP to the second server (it hangs, its connections stay open): the rollout's request to it times
    out after rollout.vllm_server_timeout, its prompts go to the first with the same seeds, and the next push
    rebuilds the weight group with the first alone."""
    model, tok = load(vllm_model_dir)
    engine = connect(fleet, model, tok)
    engine.timeout = 10.0  # what rollout.vllm_server_timeout=10 gives, once both are up
    for server in engine.servers:
        server.timeout = 10.0
    p, sampling = prompts(tok) * 2, SamplingParams(max_tokens=8)
    torch.manual_seed(3)
    expected = engine.generate(p, 2, sampling)
    fleet.procs[1].send_signal(signal.SIGSTOP)
    try:
        torch.manual_seed(3)
        with caplog.at_level(logging.WARNING, logger="grpokit.rollout"):
            got = engine.generate(p, 2, sampling)
        assert got.token_ids == expected.token_ids and engine.fleet_size == 1
        line = next(m for m in caplog.messages if "is gone" in m)
        assert line.startswith(
            f"rollout server {fleet.urls[1]} is gone (the rollout server at {fleet.urls[1]} "
            "did not answer POST /generate within 10 s"
        ), line
        engine.sync_weights(model)
        assert engine.push_checks == 1 and engine.group is not None and engine.group.size == 2
        assert engine.generate(p, 2, sampling).versions == [1] * len(expected)  # the push after version 0
    finally:
        fleet.procs[1].send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_server_killed_between_steps_leaves_the_run_to_the_other(fleet, vllm_model_dir, tmp_path, caplog):
    """SIGKILL to the second server before the second step's rollouts: its prompts go to the first with the
    same seeds (the batch is the one both would have sampled), it leaves the fleet, the next push rebuilds
    the weight group with the first alone, and the run finishes."""
    from grpokit.trainer import Trainer

    cfg = server_run_config(vllm_model_dir, tmp_path, fleet.urls, timeout=60)
    trainer = Trainer(cfg)
    engine, calls = trainer.pipeline.engine, []
    generate = engine.generate

    def kill_before_the_second(prompt_ids, n, sampling):
        calls.append(engine.pushes)
        if engine.pushes == 2 and fleet.procs[1].poll() is None:  # the rollouts after the first update
            gen = sampling.generator
            state = torch.random.get_rng_state() if gen is None else gen.get_state()
            expected = generate(prompt_ids, n, sampling)  # what both servers sample
            torch.random.set_rng_state(state) if gen is None else gen.set_state(state)
            fleet.kill(1)
            got = generate(prompt_ids, n, sampling)
            assert got.token_ids == expected.token_ids and got.versions == expected.versions
            return got
        return generate(prompt_ids, n, sampling)

    engine.generate = kill_before_the_second
    with caplog.at_level(logging.WARNING, logger="grpokit.rollout"):
        trainer.train()
    steps = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(steps) == 4 and 2 in calls and fleet.procs[1].poll() is not None
    assert [r["rollout/servers"] for r in steps] == [2, 1, 1, 1]
    assert [r["rollout/push_checks"] for r in steps] == [2, 2, 1, 1]
    line = next(m for m in caplog.messages if "is gone" in m)
    assert line.startswith(f"rollout server {fleet.urls[1]} is gone"), line
    assert "its prompts go to the others, with the same seeds; 1 of 2 servers left" in line, line
    assert fleet.health(0)["version"] == 4


@pytest.mark.slow
def test_the_only_server_killed_stops_the_run_with_one_line(server, vllm_model_dir, tmp_path):
    """One server (loopback: the /dev/shm path), SIGKILLed after the first step: the next push finds it gone
    and the run stops with a ServerError naming it, well within rollout.vllm_server_timeout."""
    from grpokit.trainer import Trainer

    cfg = server_run_config(vllm_model_dir, tmp_path, [server[0]])
    trainer = Trainer(cfg)
    engine = trainer.pipeline.engine
    assert engine.weight_sync == "shm"
    push = engine.push

    def kill_before_the_second_push(named, version=None):
        if engine.pushes == 1:
            server[2].send_signal(signal.SIGKILL)
            server[2].wait()
        return push(named, version)

    engine.push = kill_before_the_second_push
    with pytest.raises(ServerError) as caught:
        trainer.train()
    line = str(caught.value)
    assert "\n" not in line and line.startswith("no rollout server is left (rollout.vllm_server_url): "), line
    assert re.search(
        rf"{re.escape(server[0])} \(no rollout server answers at {re.escape(server[0])}", line
    ), line
    assert line.endswith("start them again with `grpokit serve` and resume the run"), line
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = read_metrics(tmp_path / "run") if metrics.exists() else []
    assert len([r for r in rows if "reward/mean" in r]) <= 1  # no step after the kill


@pytest.fixture
def server(vllm_model_dir, tmp_path):
    """(url, log, process) of one `grpokit serve` on a free loopback port, for a test that kills it."""
    require("vllm")
    proc, url = start_server(vllm_model_dir, tmp_path / "serve.log")
    try:
        yield url, tmp_path / "serve.log", proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
