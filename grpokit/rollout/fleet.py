"""Weights from the trainer to a fleet of `grpokit serve` processes by a torch.distributed broadcast, and the
way a step's prompts are spread over the fleet (rollout.vllm_server_url with several URLs; the client is
grpokit/rollout/server.py, the server grpokit/rollout/serve.py).

    # the trainer: rank 0 of a group with the N servers (ranks 1..N), built when a push needs it
    group = WeightGroup(address, n_servers=2, timeout=240.0, device=device)  # a TCPStore on group.port
    group.join()                                  # while each server joins (POST /init_weight_group)
    group.send(unique)                            # [(name, tensor)], each storage once, in byte buckets
    # a server, in its main thread (serve.py: POST /init_weight_group, then each POST /update_weights)
    pg = join_group(host, port, rank, world_size, timeout)
    named = receive(pg, tensor_specs(unique), device, timeout)   # [(name, tensor)] in the order sent
    # the prompts of a step over the servers: whole prompt groups, each chunk with its own base seed
    chunks = split_prompts(n_prompts=8, n_servers=3)    # [(0, 3), (3, 6), (6, 8)]

The group is a process group of its own (a TCPStore on the trainer, ProcessGroupGloo on CPU, ProcessGroupNCCL
on CUDA), never the default one, which under torchrun belongs to the trainer's ranks. A broadcast moves the
tensors flattened into byte buckets of at most BUCKET_BYTES (a 135M model is a handful of collectives, not
one per tensor). Every collective waits at most the group's timeout (rollout.vllm_server_timeout).
"""

from __future__ import annotations

import datetime
import math
import socket
from dataclasses import dataclass
from typing import Any

import torch

#: the most bytes one broadcast moves (tensors are packed into buckets up to this size; a larger tensor is a
#: bucket of its own)
BUCKET_BYTES = 64 << 20
#: each tensor starts at a multiple of this many bytes in its bucket (its dtype's view needs the alignment)
ALIGN = 16


def split_prompts(n_prompts: int, n_servers: int) -> list[tuple[int, int]]:
    """[start, end) of each server's share of the prompts, in order: contiguous, sizes differing by at most
    one, empty shares left out."""
    base, extra = divmod(n_prompts, n_servers)
    out, start = [], 0
    for i in range(n_servers):
        end = start + base + (i < extra)
        if end > start:
            out.append((start, end))
        start = end
    return out


def facing_address(host: str, port: int) -> str:
    """This machine's address on the route to host (no packet is sent: a UDP socket's connect picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def tensor_specs(named: list[tuple[str, torch.Tensor]]) -> list[dict]:
    """What a server needs to receive the tensors: each one's name, shape and dtype, in the order sent."""
    return [
        {"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in named
    ]


@dataclass(frozen=True)
class _Slot:
    index: int  # in the specs
    offset: int  # bytes into the bucket
    nbytes: int


def plan_buckets(specs: list[dict]) -> list[tuple[int, list[_Slot]]]:
    """(bucket size in bytes, its slots) for the specs in order, each bucket at most BUCKET_BYTES unless one
    tensor is larger. The sender and the receivers compute it from the same specs."""
    buckets: list[tuple[int, list[_Slot]]] = []
    size, slots = 0, list[_Slot]()
    for i, spec in enumerate(specs):
        nbytes = math.prod(spec["shape"]) * getattr(torch, spec["dtype"]).itemsize
        offset = -(-size // ALIGN) * ALIGN
        if slots and offset + nbytes > BUCKET_BYTES:
            buckets.append((size, slots))
            size, slots, offset = 0, [], 0
        slots.append(_Slot(i, offset, nbytes))
        size = offset + nbytes
    if slots:
        buckets.append((size, slots))
    return buckets


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_group(store, rank: int, size: int, timeout: float, address: str, device: torch.device):
    """A process group of `size` ranks on `store`: NCCL when the tensors live on CUDA, else gloo on the
    interface that holds `address` (gloo otherwise takes the address its host name resolves to)."""
    dist = torch.distributed
    if device.type == "cuda":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = _timeout(timeout)
        return dist.ProcessGroupNCCL(store, rank, size, nccl_opts)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the options with devices
    opts._timeout = _timeout(timeout)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


class WeightGroup:
    """The trainer's side: rank 0 of a group with the servers, on a TCPStore this process listens on."""

    def __init__(self, address: str, n_servers: int, timeout: float, device: torch.device):
        dist = torch.distributed
        self.address, self.size, self.timeout, self.device = address, n_servers + 1, timeout, device
        # port 0: a free one; the store listens on every interface, the servers reach it at `address`
        self.store = dist.TCPStore(
            "0.0.0.0", 0, self.size, is_master=True, timeout=_timeout(timeout), wait_for_workers=False
        )
        self.port = self.store.port
        self.pg: Any = None

    def join(self) -> None:
        """Build this rank's process group; returns once every server built its own (or the timeout)."""
        self.pg = make_group(self.store, 0, self.size, self.timeout, self.address, self.device)

    def send(self, unique: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast the tensors, in buckets (plan_buckets of tensor_specs(unique))."""
        for size, slots in plan_buckets(tensor_specs(unique)):
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            for slot in slots:
                t = unique[slot.index][1].detach().to(self.device).contiguous()
                buf[slot.offset : slot.offset + slot.nbytes] = t.reshape(-1).view(torch.uint8)
            _broadcast(self.pg, buf, self.timeout)


def _broadcast(pg, buf: torch.Tensor, timeout: float) -> None:
    pg.broadcast(buf, 0, _timeout(timeout)).wait(_timeout(timeout))


def join_group(host: str, port: int, rank: int, size: int, timeout: float, device: torch.device):
    """A server's side: rank `rank` of the trainer's group, through the trainer's TCPStore at host:port, on
    the interface that faces the trainer."""
    store = torch.distributed.TCPStore(host, port, size, is_master=False, timeout=_timeout(timeout))
    return make_group(store, rank, size, timeout, facing_address(host, port), device)


def receive(pg, specs: list[dict], device: torch.device, timeout: float) -> list[tuple[str, torch.Tensor]]:
    """The tensors the trainer's WeightGroup.send broadcasts, as (name, tensor) in the order of specs."""
    out: list[tuple[str, torch.Tensor]] = []
    for size, slots in plan_buckets(specs):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        _broadcast(pg, buf, timeout)
        for slot in slots:
            spec = specs[slot.index]
            raw = buf[slot.offset : slot.offset + slot.nbytes]
            out.append((spec["name"], raw.view(getattr(torch, spec["dtype"])).reshape(spec["shape"])))
    return out
