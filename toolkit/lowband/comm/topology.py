"""R replicas x S shards -> a 2-D DeviceMesh, the inner and outer process groups.

Global rank r is shard r % S of replica r // S. The inner group joins the S ranks of one replica
(the fast link); the outer group joins the ranks holding the same shard index across replicas
(the slow link). The backend: gloo on CPU; on CUDA NCCL when every rank of the node has a GPU
of its own, else gloo, which accepts CUDA tensors and lets several ranks share one GPU (NCCL
refuses two ranks on one device). `--backend` overrides the choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lowband.comm.membership.bind import bind_gloo, world_store
from lowband.options import ConfigError


@dataclass
class Topology:
    rank: int
    world: int
    replicas: int
    shards: int
    device: torch.device
    mesh: DeviceMesh
    inner: dist.ProcessGroup
    outer: dist.ProcessGroup
    side: dict = field(default_factory=dict)  # Comm.side_group's groups, by "GROUP:NAME"

    @property
    def replica(self) -> int:
        return self.rank // self.shards

    @property
    def shard(self) -> int:
        return self.rank % self.shards

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    def group(self, name: str) -> dist.ProcessGroup:
        """inner, outer, world, or a side group Comm.side_group made ("outer:grace")."""
        if name in self.side:
            return self.side[name]
        return {"inner": self.inner, "outer": self.outer, "world": dist.group.WORLD}[name]


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available: use "
                          "--device cpu or auto.")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; the world when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def pick_backend(requested: str, device: torch.device) -> str:
    if device.type == "cpu":
        if requested == "nccl":
            raise ConfigError("--backend nccl needs CUDA devices: use --backend gloo or auto on CPU.")
        return "gloo"
    if requested != "auto":
        return requested
    return "nccl" if local_world_size() <= torch.cuda.device_count() else "gloo"


def members_store(timeout: timedelta) -> dict:
    """The world's store, as torch's env:// makes it but with rank 0's server on bind_host()
    (comm/membership/bind.py: world_store). A run with a secret (comm/membership/secret.py: an elastic group, a
    launched job) meets in it under a prefix derived from it, so a process without the secret
    never meets its ranks."""
    from lowband.comm.membership.secret import read, tag

    key = read()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prefix = "default_pg" if key is None else f"default_pg/{tag(key, 'c10d')}"
    return {"store": dist.PrefixStore(prefix, world_store(rank, world, timeout)), "rank": rank,
            "world_size": world}


def init(replicas: int, shards: int, device: str = "auto", backend: str = "auto",
         timeout_s: float = 300, replica: int | None = None) -> Topology:
    """Join the process group described by the environment (torchrun's variables).

    replica: --elastic, where the job is one replica group (its S ranks) of R; the outer group
    is then torchft's (comm/membership/elastic.py), and rank and world stay the global ones (replica x S +
    shard, R x S), which data order and event files are keyed on."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    groups = 1 if replica is not None else replicas
    if groups * shards != world:
        if replica is not None:
            raise ConfigError(f"an elastic replica group has --shards {shards} ranks, but the job "
                              f"has {world} processes: start S processes a group.")
        raise ConfigError(f"--replicas {replicas} x --shards {shards} = {replicas * shards} ranks, "
                          f"but the job has {world} processes: make R x S equal the world size.")
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend = pick_backend(backend, dev)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", str(world))  # a plain `python mine.py`: a world of one
        bind_gloo()  # rank 0's store and gloo's pairs listen on bind_host() only (comm/membership/bind.py)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if backend == "nccl" else None,
                                **members_store(timedelta(seconds=timeout_s)))
    mesh = init_device_mesh(dev.type, (groups, shards), mesh_dim_names=("replicate", "shard"))
    first = 0 if replica is None else replica * shards
    topo = Topology(rank=first + dist.get_rank(), world=replicas * shards, replicas=replicas, shards=shards,
                    device=dev, mesh=mesh, inner=mesh.get_group("shard"),
                    outer=mesh.get_group("replicate"))
    for group in (topo.inner, topo.outer, None):  # connect now, not inside the first transfer
        dist.barrier(group=group)
    return topo
