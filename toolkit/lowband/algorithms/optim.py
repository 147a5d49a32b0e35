"""The optimizer of one rank's shard of a flat parameter vector (zero1, acco).

update(grad, lr, commit, found_inf) returns the stepped shard; commit=False leaves the master
shard, the moments and the step count untouched (acco's estimate round), commit=True advances
them. found_inf (a 0-d float tensor on the shard's device, 1 or 0) skips the step as under a
GradScaler: nothing changes, and what is returned holds the master shard's values. The step
count lives on the device too, so a skip decided there needs no host round trip.

  adamw  torch.optim.AdamW's update (decoupled weight decay per segment):
           p <- p (1 - lr wd);  m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2
           p <- p - lr / (1 - beta1^k) * m / (sqrt(v) / sqrt(1 - beta2^k) + eps),  k = step + 1
         stepped by PyTorch's fused AdamW kernel (torch._fused_adamw_, the one behind
         torch.optim.AdamW(fused=True)): one pass over the shard, one call per distinct weight
         decay with the segments' views as its tensor lists; over the same tensors it equals
         torch.optim.AdamW(fused=True) bitwise (tests/test_acco.py). Written out in torch ops
         only where that kernel is missing (a torch without it, or a device it does not cover);
         that form reads found_inf and the step count on the host.
  sgd    p <- p (1 - lr wd) - lr g   (no momentum, no state)
"""

from __future__ import annotations

import math

import torch

from lowband.options import ConfigError

_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)


class ShardOptimizer:
    def __init__(self, master: torch.Tensor, segments: list[tuple[int, int, float]], kind: str,
                 betas: tuple[float, float], eps: float):
        self.master, self.segments, self.kind = master, segments, kind
        self.betas, self.eps = betas, eps
        # the number of committed steps, on the shard's device in float32 (the kernel reads
        # its step numbers there; exact up to 2^24 steps)
        self.steps = torch.zeros((), dtype=torch.float32, device=master.device)
        # the segments by weight decay: the fused kernel takes one weight decay a call
        by_decay: dict[float, list[tuple[int, int]]] = {}
        for lo, hi, wd in segments:
            by_decay.setdefault(wd, []).append((lo, hi))
        self.by_decay = list(by_decay.items())
        self.fused = kind == "adamw" and _FUSED_ADAMW is not None
        if kind == "adamw":
            self.m, self.v = torch.zeros_like(master), torch.zeros_like(master)
        else:
            self.m = self.v = None

    @property
    def step(self) -> int:
        """Committed steps (read from the device)."""
        return int(self.steps.item())

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (the moments; the master shard not included)."""
        return sum(t.numel() * t.element_size() for t in (self.m, self.v) if t is not None)

    @torch.no_grad()
    def update(self, grad: torch.Tensor, lr: float, commit: bool,
               found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """The stepped shard. commit=True steps the master shard in place and returns it (no
        copy): the caller reads it before the next update and never writes into it.
        commit=False returns a new tensor; the state is left as it was."""
        if self.kind == "adamw" and self.fused:
            try:
                return self._fused(grad, lr, commit, found_inf)
            except NotImplementedError:  # the kernel exists, but not for this device
                self.fused = False
        if found_inf is not None and bool(found_inf.item()):
            return self.master if commit else self.master.clone()
        if self.kind == "sgd":
            return self._sgd(grad, lr, commit)
        return self._written_out(grad, lr, commit)

    def _fused(self, grad, lr: float, commit: bool, found_inf) -> torch.Tensor:
        if commit:
            p, m, v = self.master, self.m, self.v
            k = self.steps.add_(1)  # back by found_inf below: a skipped step is not counted
        else:  # the estimate: the kernel steps copies (3 copies, against the written-out
            p, m, v = self.master.clone(), self.m.clone(), self.v.clone()  # form's 8 passes)
            k = self.steps + 1
        beta1, beta2 = self.betas
        try:
            for wd, spans in self.by_decay:
                _FUSED_ADAMW([p[lo:hi] for lo, hi in spans], [grad[lo:hi] for lo, hi in spans],
                             [m[lo:hi] for lo, hi in spans], [v[lo:hi] for lo, hi in spans], [],
                             [k] * len(spans), amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                             weight_decay=wd, eps=self.eps, maximize=False, found_inf=found_inf)
        except NotImplementedError:
            if commit:
                self.steps.sub_(1)
            raise
        if commit and found_inf is not None:
            self.steps.sub_(found_inf)
        return p

    def _written_out(self, grad, lr: float, commit: bool) -> torch.Tensor:
        """The same update in torch ops (where torch has no fused AdamW kernel)."""
        beta1, beta2 = self.betas
        k = self.step + 1
        p = self.master.clone()
        for lo, hi, wd in self.segments:
            if wd:
                p[lo:hi].mul_(1 - lr * wd)
        m = torch.lerp(self.m, grad, 1 - beta1)
        v = self.v.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** k)).add_(self.eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** k))
        if commit:
            self.master.copy_(p)
            self.m, self.v = m, v
            self.steps.add_(1)
        return p

    def _sgd(self, grad: torch.Tensor, lr: float, commit: bool) -> torch.Tensor:
        p = self.master.clone()
        for lo, hi, wd in self.segments:
            if wd:
                p[lo:hi].mul_(1 - lr * wd)
        p.add_(grad, alpha=-lr)
        if commit:
            self.master.copy_(p)
            self.steps.add_(1)
        return p

    def state_dict(self) -> dict:
        cpu = lambda t: None if t is None else t.detach().cpu().clone()
        return {"kind": self.kind, "step": self.step, "master": cpu(self.master),
                "m": cpu(self.m), "v": cpu(self.v)}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] != self.kind or state["master"].numel() != self.master.numel():
            raise ConfigError("the checkpoint's shard optimizer does not match this run's (kind or "
                              "size): resume with the same --shard-optimizer, model and world.")
        self.steps.fill_(state["step"])
        self.master.copy_(state["master"])
        dev = self.master.device
        self.m = None if state["m"] is None else state["m"].to(dev).clone()
        self.v = None if state["v"] is None else state["v"].to(dev).clone()
