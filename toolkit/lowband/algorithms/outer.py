"""The outer loop's options and its step, shared by every algorithm that keeps outer (last synced)
parameters and steps them with Nesterov SGD (streaming's --outer-rule sparseloco: plain SGD, sgd_step):
diloco, streaming, edit and aedit. The state lives where
--outer-state-device says (the model's device by default; `cpu` keeps it in pinned host memory
when the model is on a GPU); the arithmetic always runs on the model's device.

--outer-lr, unless set, follows the replicas R and H (default_outer_lr): the best outer learning
rates Charles et al. 2025 (Scaling Laws for DiLoCo, arXiv 2503.09799) read at H = 30 for R = 1,
2, 4, 8, rising with H by a guessed gentle slope, times a factor per outer rule and codec kind
(OUTER_LR_FACTOR, set by benchmarks/outer_lr_sweep.py: 1 but for SparseLoCo's rule on a sparse
codec); docs/fidelity.md says what rests on what.

--outer-warmup N (0, off, by default): the Nesterov momentum of a fragment's (edit, aedit: a
sync's) k-th outer step, k = 0, 1, ..., is mu min(1, k / N), mu = --outer-momentum: the first
step is plain SGD on the pseudo-gradient, the (N+1)-th and later take mu (outer_momentum_at;
Pier, arXiv 2511.17849, warms the outer momentum up). The outer lr is not ramped."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowband.comm.codecs import SPARSE
from lowband.options import ConfigError, Options, option


@dataclass
class OuterOptions(Options):
    title = "outer loop"
    shared_knob = True
    sync_every: int = option(20, "H: inner steps between two syncs of the same fragment or block")
    outer_lr: float = option(None, "outer SGD learning rate", kind=float,
                             shown="by --replicas and --sync-every as the DiLoCo scaling laws "
                             "found: 0.4/0.6/0.6/0.8 for R=1/2/4/8 at H=30, +0.05 a doubling "
                             "of H, within [0.2, 1]; see docs/fidelity.md")
    outer_momentum: float = option(0.9, "outer SGD Nesterov momentum")
    outer_warmup: int = option(0, "N: the outer momentum ramps linearly from 0 over each "
                               "fragment's first N outer steps (edit, aedit: the first N syncs): "
                               "--outer-momentum x k/N at the k-th, k from 0 (0: off)")
    outer_state_device: str = option("same", "where the outer parameters and momentum live: same "
                                     "(the model's device) or cpu (pinned host memory: frees GPU "
                                     "memory, costs a PCIe round trip a sync)", ("same", "cpu"))
    eval_params: str = option("local", "evaluate the local (replica) or the outer parameters",
                              ("local", "outer"))

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        """--outer-lr left unset: default_outer_lr of the run's replicas and H (an algorithm
        syncing by time, aedit, has no H in steps: the H = 30 value)."""
        if cfg.outer_lr is None and cfg.sync_every > 0:  # else check() names --sync-every
            cfg.outer_lr = outer_lr_for(cfg.replicas, None if algorithm.timed else cfg.sync_every,
                                        cfg.outer_rule, cfg.codec)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.sync_every <= 0:
            raise ConfigError(f"--sync-every must be a positive integer, got {cfg.sync_every}.")
        if not cfg.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be positive, got {cfg.outer_lr}.")
        if not 0 <= cfg.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must lie in [0, 1), got {cfg.outer_momentum}.")
        if not (isinstance(cfg.outer_warmup, int) and cfg.outer_warmup >= 0):
            raise ConfigError(f"--outer-warmup must be 0 (off) or a positive number of outer "
                              f"steps, got {cfg.outer_warmup}.")
        if cfg.outer_warmup and cfg.outer_rule == "sparseloco":
            raise ConfigError("--outer-warmup ramps the Nesterov outer momentum, which --outer-rule "
                              "sparseloco does not have (its --outer-momentum decays the error "
                              "feedback): drop one of them.")


# The best outer learning rate at H = 30 for R = 1, 2, 4, 8 replicas (M in the paper), read from
# the heat-map of Charles et al. 2025, arXiv 2503.09799 (outer lr swept over 0.2..1.0 in steps
# of 0.2, so each value is +-0.2; it did not depend on the model size there).
OUTER_LR_AT_H30 = (0.4, 0.6, 0.6, 0.8)
# The paper found the best outer lr rising with H, without a rate to quote: this slope is a
# guess, kept gentle (one step of its 0.2 grid over H = 30 -> 480).
OUTER_LR_PER_DOUBLING_OF_H = 0.05
OUTER_LR_BOUNDS = (0.2, 1.0)  # the paper's swept range: nothing beyond it is evidence


def default_outer_lr(replicas: int, sync_every: int | None) -> float:
    """The outer learning rate for R replicas syncing every H steps (None: H unknown, the H = 30
    value): OUTER_LR_AT_H30 interpolated linearly in log2 R (R outside 1..8: the nearest end),
    plus OUTER_LR_PER_DOUBLING_OF_H per doubling of H from 30 (less below 30), clamped to
    OUTER_LR_BOUNDS, rounded to 3 decimals (the value a run's config.json records)."""
    x = min(max(math.log2(max(replicas, 1)), 0.0), len(OUTER_LR_AT_H30) - 1.0)
    i = min(int(x), len(OUTER_LR_AT_H30) - 2)
    lo, hi = OUTER_LR_AT_H30[i], OUTER_LR_AT_H30[i + 1]
    lr = lo + (hi - lo) * (x - i)
    if sync_every is not None:
        lr += OUTER_LR_PER_DOUBLING_OF_H * math.log2(sync_every / 30)
    return round(min(max(lr, OUTER_LR_BOUNDS[0]), OUTER_LR_BOUNDS[1]), 3)


# The default outer lr's factor on default_outer_lr(R, H) by (outer rule, codec kind): dense is
# fp32, bf16, int8 and the fp4 codecs, sparse the topk codecs (with error feedback).
# benchmarks/outer_lr_sweep.py (nano, R=2, H=20, 300 steps, seeds 0 and 1; RESULTS.md "outer lr
# by rule and codec"): Nesterov's best is the fit's within noise, dense fp4 +0.04% and topk
# +0.24% at 0.6 against 0.571; SparseLoCo's rule on topk-2bit is best at 1.5-2 (flat within
# 0.3%, 3 worse by 3%, 4 diverges), 8.8% below the fit's 0.571: 2.6 takes the flat region's
# low end, 1.485. SparseLoCo's rule with a dense codec was not swept and keeps the fit.
OUTER_LR_FACTOR = {("nesterov", "dense"): 1.0, ("nesterov", "sparse"): 1.0,
                   ("sparseloco", "dense"): 1.0, ("sparseloco", "sparse"): 2.6}


def outer_lr_for(replicas: int, sync_every: int | None, rule: str = "nesterov",
                 codec: str = "fp32") -> float:
    """The default outer lr of a run (--outer-lr unset): default_outer_lr(R, H) times
    OUTER_LR_FACTOR of its outer rule and codec kind, rounded to 3 decimals; a factor of 1 is
    default_outer_lr's value unchanged."""
    lr = default_outer_lr(replicas, sync_every)
    factor = OUTER_LR_FACTOR[(rule, "sparse" if codec in SPARSE else "dense")]
    return lr if factor == 1.0 else round(lr * factor, 3)


def outer_momentum_at(config, k: int) -> float:
    """The Nesterov momentum of the k-th outer step (k = 0, 1, ...) of a fragment (edit: of a
    sync): --outer-momentum, ramped linearly from 0 over the first --outer-warmup N steps,
    mu k / N while k < N; mu itself with N = 0 (off, or a config without the option)."""
    mu, n = config.outer_momentum, getattr(config, "outer_warmup", 0)
    return mu if k >= n else mu * k / n


def outer_home(config, device: torch.device) -> torch.device:
    """Where a run keeps its outer parameters and momentum (--outer-state-device)."""
    return torch.device("cpu") if config.outer_state_device == "cpu" else device


def kept_at(t: torch.Tensor, home: torch.device) -> torch.Tensor:
    """A copy of t that lives at `home`; in page-locked host memory when t is on a GPU and home
    is the CPU, so that the copies each way run asynchronously (see Staging)."""
    kept = t.detach().to(home, copy=True)
    return kept.pin_memory() if t.is_cuda and home.type == "cpu" else kept


class Staging:
    """Copies of outer state kept at `home` on the model's `device`, where the arithmetic runs.

    When the state lives on the device (`same`, or a CPU run) there is nothing to copy: get()
    hands back the state itself and the step works in place. Otherwise get() gives a device copy
    that stays staged until put() writes the new value back (or drop() forgets it), so a state
    read twice in one sync (streaming: the outer parameters at the exchange and again at the
    apply) crosses PCIe once.

    With the state in pinned host memory and the model on a GPU (`--outer-state-device cpu`),
    the copies run on a side stream, never on the compute stream:
      fetch(host)  allocates the device copy on the compute stream, has the side stream wait for
                   the work queued there so far (that memory may still be in use by it), and
                   queues the host-to-device copy there, recording `ready`; the copy runs
                   while the GPU computes;
      get(host)    has the compute stream (not the host) wait for `ready`;
      put(host, d) records `done` on the compute stream (d's value is final there) and keeps d;
      flush()      queues the writes put() kept on the side stream, each after its `done`.
    put() leaves the device-to-host copy to flush() so that the caller picks when it starts:
    a small copy that the host waits for (a step's loss, its gradient norm) queued just after
    a large one on another stream waits for it, so the large ones belong where none follows
    soon (streaming: before a step's last backward).
    Every device copy is record_stream'd on the side stream, so the caching allocator reuses
    its memory only once the side stream's work queued before its release is done, however it
    ends (put, drop, or just let go). Every access to the host copy goes through the side
    stream, so they run in the order they are queued (fetch() flushes a write of the same
    state first); a host reader or writer of the state (a checkpoint, a heal) calls settle()
    first, which flushes and waits."""

    def __init__(self, home: torch.device, device: torch.device, overlap: bool = True):
        self.device = device
        self.moves = home != device  # else get() is the state itself
        self.side = (torch.cuda.Stream(device) if overlap and self.moves and device.type == "cuda"
                     and home.type == "cpu" else None)
        self.staged: dict[int, tuple] = {}  # id(host) -> (host, its device copy, ready or None)
        self.writes: list[tuple] = []  # (host, device copy, done): put, not yet flushed

    def fetch(self, host: torch.Tensor) -> None:
        """Start copying `host` to the device (nothing if staged already, or nothing to copy)."""
        if not self.moves or id(host) in self.staged:
            return
        if any(h is host for h, _, _ in self.writes):
            self.flush()  # its new value goes back first, then comes here again
        if self.side is None:
            self.staged[id(host)] = (host, host.to(self.device, non_blocking=True, copy=True), None)
            return
        dev = torch.empty_like(host, device=self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            dev.copy_(host, non_blocking=True)
        dev.record_stream(self.side)
        self.staged[id(host)] = (host, dev, self.side.record_event())

    def get(self, host: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """`host`'s value on the device, for work queued on the compute stream from now on. It
        stays staged for a later get or put; with keep=False a copy made for this call alone
        (one not staged before) is forgotten at once (read-only uses: evaluation, the end)."""
        if not self.moves:
            return host
        was_staged = id(host) in self.staged
        self.fetch(host)
        forget = not keep and not was_staged
        _, dev, ready = self.staged.pop(id(host)) if forget else self.staged[id(host)]
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return dev

    def put(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        """Write `dev`, the state's new value computed on the compute stream, back to `host`
        (nothing to do when it is `host` itself; on a side stream, at the next flush(): nothing
        may write `dev` after this); it is no longer staged."""
        self.staged.pop(id(host), None)
        if dev.data_ptr() == host.data_ptr():
            return
        if self.side is None:
            host.copy_(dev, non_blocking=True)
            return
        self.writes.append((host, dev, torch.cuda.current_stream(self.device).record_event()))

    def flush(self) -> None:
        """Queue the writes put() kept, on the side stream; the compute stream goes on at once."""
        for host, dev, done in self.writes:
            self.side.wait_event(done)
            with torch.cuda.stream(self.side):
                host.copy_(dev, non_blocking=True)
            dev.record_stream(self.side)
        self.writes.clear()

    def drop(self, *hosts: torch.Tensor) -> None:
        """Forget the staged copies of `hosts` (of every state when none is named)."""
        if not hosts:
            self.staged.clear()
        for host in hosts:
            self.staged.pop(id(host), None)

    def settle(self) -> None:
        """Flush, then wait on the host for the side stream's copies (before the host reads or
        writes the state in host memory)."""
        if self.side is not None:
            self.flush()
            self.side.synchronize()


@torch.no_grad()
def nesterov_step(outer: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor,
                  lr: float, mu: float, staging: Staging | None = None) -> torch.Tensor:
    """One outer Nesterov SGD step, m <- mu m + delta; outer <- outer - lr (delta + mu m), worked
    out on delta's device wherever the state lives (a round trip over PCIe costs far less than
    the arithmetic on the host), the state written back without waiting. Returns the new outer
    parameters on delta's device. `staging`: where the device copies come from and go back
    (Staging; without one they are made and written back on the compute stream). Host readers
    of a CPU state call `settle` (or the staging's settle) first."""
    s = staging if staging is not None else Staging(outer.device, delta.device, overlap=False)
    o, m = s.get(outer), s.get(momentum)
    m.mul_(mu).add_(delta)
    o.sub_(lr * (delta + mu * m))
    s.put(outer, o)
    s.put(momentum, m)
    return o


@torch.no_grad()
def sgd_step(outer: torch.Tensor, delta: torch.Tensor, lr: float,
             staging: Staging | None = None) -> torch.Tensor:
    """SparseLoCo's outer step (streaming's --outer-rule sparseloco): outer <- outer - lr delta,
    no momentum (each replica's error feedback, decayed, stands in for it); worked out and
    written back as nesterov_step does. Returns the new outer parameters on delta's device."""
    s = staging if staging is not None else Staging(outer.device, delta.device, overlap=False)
    o = s.get(outer)
    o.sub_(lr * delta)
    s.put(outer, o)
    return o


def settle(device: torch.device) -> None:
    """Wait for the state's asynchronous copies to the host (before the host reads it): every
    stream of the device, side streams included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
