"""The optimizer of one rank's shard of a flat parameter vector (zero1, acco).

update(grad, lr, commit) returns the stepped shard; commit=False leaves the master shard, the
moments and the step count untouched (acco's estimate round), commit=True advances them.

  adamw  torch.optim.AdamW's update, written out (decoupled weight decay per segment):
           p <- p (1 - lr wd);  m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2
           p <- p - lr / (1 - beta1^k) * m / (sqrt(v) / sqrt(1 - beta2^k) + eps),  k = step + 1
  sgd    p <- p (1 - lr wd) - lr g   (no momentum, no state)
"""

from __future__ import annotations

import math

import torch

from lowband.options import ConfigError


class ShardOptimizer:
    def __init__(self, master: torch.Tensor, segments: list[tuple[int, int, float]], kind: str,
                 betas: tuple[float, float], eps: float):
        self.master, self.segments, self.kind = master, segments, kind
        self.betas, self.eps = betas, eps
        self.step = 0
        if kind == "adamw":
            self.m, self.v = torch.zeros_like(master), torch.zeros_like(master)
        else:
            self.m = self.v = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (the moments; the master shard not included)."""
        return sum(t.numel() * t.element_size() for t in (self.m, self.v) if t is not None)

    @torch.no_grad()
    def update(self, grad: torch.Tensor, lr: float, commit: bool) -> torch.Tensor:
        p = self.master.clone()
        for lo, hi, wd in self.segments:
            if wd:
                p[lo:hi].mul_(1 - lr * wd)
        if self.kind == "sgd":
            p.add_(grad, alpha=-lr)
            m = v = None
        else:
            beta1, beta2 = self.betas
            k = self.step + 1
            m = torch.lerp(self.m, grad, 1 - beta1)
            v = self.v.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** k)).add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** k))
        if commit:
            self.master.copy_(p)
            self.m, self.v = m, v
            self.step += 1
        return p

    def state_dict(self) -> dict:
        cpu = lambda t: None if t is None else t.detach().cpu().clone()
        return {"kind": self.kind, "step": self.step, "master": cpu(self.master),
                "m": cpu(self.m), "v": cpu(self.v)}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] != self.kind or state["master"].numel() != self.master.numel():
            raise ConfigError("the checkpoint's shard optimizer does not match this run's (kind or "
                              "size): resume with the same --shard-optimizer, model and world.")
        self.step = state["step"]
        self.master.copy_(state["master"])
        dev = self.master.device
        self.m = None if state["m"] is None else state["m"].to(dev).clone()
        self.v = None if state["v"] is None else state["v"].to(dev).clone()
