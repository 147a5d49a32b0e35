"""The emulated link: bandwidth, latency and one FIFO queue, on a real 2-process exchange."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowband.comm import topology
from lowband.comm import Comm, Link, parse_bandwidth, parse_duration
from lowband.launch.local import free_port


def test_parse_units():
    assert parse_bandwidth("100Mbit") == 100e6
    assert parse_bandwidth("1gbit") == 1e9 and parse_bandwidth("2.5e9") == 2.5e9
    assert parse_duration("20ms") == 0.02 and parse_duration("150us") == 150e-6
    with pytest.raises(ValueError, match="100Mbit"):
        parse_bandwidth("fast")


def test_fifo_schedule():
    link = Link(8e6, latency_s=0.01)  # 1 MB/s
    assert link.schedule(100.0, 1_000_000) == pytest.approx((100.0, 101.01))
    assert link.schedule(100.0, 1_000_000) == pytest.approx((101.0, 102.01))  # queued behind
    assert link.schedule(200.0, 500_000) == pytest.approx((200.0, 200.51))  # idle link: no queue


def _worker(rank, port, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    topo = topology.init(2, 1, "cpu")
    comm = Comm(topo, None, Link(parse_bandwidth("8Mbit")))
    x = torch.ones(250_000)  # 1 MB; an all-reduce of 2 ranks puts 1 MB on each rank's wire
    dist.barrier()
    t0 = time.time()
    comm.all_reduce(x, "outer").wait()
    one = time.time() - t0
    dist.barrier()
    t0 = time.time()
    a, b = comm.all_reduce(x.clone(), "outer"), comm.all_reduce(x.clone(), "outer")
    first_done = a.done()
    a.wait()
    b.wait()
    two = time.time() - t0
    results.put((rank, one, two, first_done, comm.totals.wire_bytes["outer"]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_emulated_link_times_real_transfers():
    q = mp.get_context("spawn").Queue()
    mp.spawn(_worker, args=(free_port(), q), nprocs=2)
    for _ in range(2):
        rank, one, two, first_done, wire = q.get()
        assert 1.0 <= one <= 1.2, f"rank {rank}: 1 MB at 8 Mbit/s took {one:.2f} s"
        assert 2.0 <= two <= 2.4, f"rank {rank}: two back-to-back took {two:.2f} s"
        assert not first_done
        assert wire == 3_000_000
