"""The inner optimizer of lowband's own loop (--optimizer), the same for every algorithm.

  adamw  torch.optim.AdamW (fused on CUDA), weight decay on matrices and embeddings only (not
         on norms' scales or biases).
  muon   torch.optim.Muon on every 2-D parameter inside a block (the hidden layers' weight
         matrices), AdamW as above on the rest (the embeddings and the output head, 2-D but
         outside the blocks; norms; biases), as MuLoCo (arXiv 2505.23725) and Moonlight
         (arXiv 2502.16982) do. Muon's step scales the lr per matrix with torch's
         adjust_lr_fn="match_rms_adamw" (0.2 sqrt(max(rows, cols))), so that --lr and
         --weight-decay carry over from AdamW; momentum 0.95 with Nesterov (torch's defaults).
         One object (MuonAdamW) steps both, so that the loop, the algorithms (which set each
         group's lr, and guard.py's recovery, which zeroes moments), the checkpoints (torch
         DCP) and a heal see one optimizer. Muon is BatchedMuon: on a GPU its Newton-Schulz
         iterations run once per matrix shape, over every matrix of it; on the CPU, torch's.

Where muon cannot run, check() refuses it in one sentence before any worker starts.
"""

from __future__ import annotations

import math

import torch

from lowband.options import ConfigError
from lowband.params import is_dtensor

MUON_MOMENTUM = 0.95  # torch.optim.Muon's default, with nesterov=True


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz iterations run once per matrix shape, over every
    matrix of that shape stacked (torch.baddbmm), instead of once per matrix; its state and
    checkpoints are torch's. torch's loop launches 5 x 5 small kernels a matrix, which left
    Muon launch-bound on a GPU (+55% a token on GPT-2 124M, an H200: benchmarks/RESULTS.md);
    a GPT's blocks hold four shapes, so a step launches that many batches whatever the depth.

    batch: None batches on a GPU only. On the CPU the batched update is torch's bit for bit
    (tests/test_muon.py; nano to small in benchmarks/muon_step.py), and it stepped nano and
    micro 1.5x faster but mini only 1.06x and small 0.85x: there torch's own step runs. On a
    GPU its gain is not yet measured (the device script measures it first: issue 48)."""

    def __init__(self, params, *args, batch: bool | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.batch = batch

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if not (self.batch if self.batch is not None else
                any(p.device.type == "cuda" for p in params)):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
            shapes: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p) or p.grad.is_sparse or p.grad.dim() != 2:
                    raise RuntimeError("Muon steps real 2-D parameters with dense gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                shapes.setdefault((tuple(p.shape), p.device), []).append((p, update))
            for ((rows, cols), _), items in shapes.items():
                done = _newton_schulz([u for _, u in items], group["ns_coefficients"],
                                      group["ns_steps"], group["eps"])
                scale = _adjusted(group["adjust_lr_fn"], rows, cols)
                for (p, _), o in zip(items, done.unbind(0)):
                    p.mul_(1 - lr * wd)
                    p.add_(o, alpha=-lr * scale)
        return loss


def _newton_schulz(updates: list, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization of each of the updates (of
    one shape), as one batch: in bf16 (each update converted once, straight into the batch),
    a tall matrix as its transpose, each scaled to norm 1 first."""
    a, b, c = coefficients
    tall = updates[0].size(0) > updates[0].size(1)
    x = torch.empty((len(updates), *updates[0].shape), dtype=torch.bfloat16,
                    device=updates[0].device)
    for i, u in enumerate(updates):
        x[i].copy_(u)
    if tall:
        x = x.transpose(1, 2)
    x.div_(x.flatten(1).norm(dim=1).clamp(min=eps).view(-1, 1, 1))
    for _ in range(steps):
        gram = x @ x.transpose(1, 2)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.transpose(1, 2) if tall else x


def _adjusted(how: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's per-matrix lr factor (adjust_lr_fn)."""
    if how is None or how == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if how == "match_rms_adamw" else 1.0


def check(cfg, algorithm) -> None:
    """--optimizer muon runs where the algorithm steps the loop's optimizer over whole
    matrices: not zero1 and acco, which take the inner step themselves with AdamW sharded over
    the ranks (algorithms/optim.py; any algorithm that owns its step), nor edit and aedit at
    --shards > 1, whose FSDP2 splits each matrix over a replica's ranks."""
    from lowband.algorithms.edit import EDiT

    if cfg.optimizer != "muon":
        return
    if algorithm.owns_step:
        raise ConfigError(f"--optimizer muon with --algo {cfg.algo}: {cfg.algo} takes the inner "
                          "step itself with AdamW's state sharded over the ranks; use --algo "
                          "ddp for Muon, or --optimizer adamw.")
    if issubclass(algorithm, EDiT) and cfg.shards > 1:
        raise ConfigError(f"--optimizer muon with --algo {cfg.algo} and --shards {cfg.shards}: "
                          "FSDP2 splits each weight matrix over the replica's ranks, and Muon's "
                          "Newton-Schulz needs whole matrices; use --shards 1 or --optimizer "
                          "adamw.")


def make_optimizer_factory(cfg, device: torch.device, blocks=None):
    """make(params) -> the run's inner optimizer over params (cfg.optimizer; see the module
    doc). blocks: the model's (models.blocks_of), which muon needs; the parameters inside
    them are read when make is called, after any sharding."""

    def adamw(params):
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]
        if cfg.optimizer == "muon":  # (a group with no parameters breaks DCP's loading)
            groups = [g for g in groups if g["params"]]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 fused=device.type == "cuda")

    def make(params):
        params = [p for p in params if p.requires_grad]
        if cfg.optimizer == "adamw":
            return adamw(params)
        if blocks is None:
            raise ValueError("--optimizer muon needs the model's blocks (make_optimizer_factory)")
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        hidden = [p for p in params if p.dim() == 2 and id(p) in in_blocks]
        if any(is_dtensor(p) for p in hidden):  # (an algorithm registered from outside)
            raise ConfigError(f"--optimizer muon with --algo {cfg.algo}: its parameters are "
                              "sharded over the ranks, and Muon's Newton-Schulz needs whole "
                              "matrices; use --optimizer adamw.")
        if not hidden:
            raise ConfigError("--optimizer muon found no weight matrix inside the model's "
                              "blocks to orthogonalize: use --optimizer adamw.")
        mine = {id(p) for p in hidden}
        muon = BatchedMuon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                momentum=MUON_MOMENTUM, nesterov=True,
                                adjust_lr_fn="match_rms_adamw")
        return MuonAdamW(muon, adamw([p for p in params if id(p) not in mine]))

    return make


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW over disjoint parameters as one optimizer: param_groups are Muon's, then
    AdamW's (the live group dicts: setting a group's lr sets it in its optimizer); state maps
    each parameter to its own optimizer's state ('momentum_buffer' for Muon's, 'exp_avg',
    'exp_avg_sq', 'step' for AdamW's); state_dict() is the usual form, the parameters numbered
    in param_groups' order, so torch DCP's get_state_dict/set_state_dict (checkpoint/) and
    params.local_state (a heal) read and write it as any optimizer's. Its step is decided on
    the host (defaults' fused is False: Muon reads no found_inf), AdamW's kernel as in an
    AdamW run. torch.optim.Optimizer's own __init__ is not run (the groups are the two
    optimizers'), so step hooks cannot be registered on it."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.optimizers = (muon, adamw)
        self.defaults = {**adamw.defaults, "fused": False}

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """Each parameter's state dict (the optimizers' own; a new mapping each read)."""
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        out, offset = {"state": {}, "param_groups": []}, 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            out["state"].update({i + offset: s for i, s in sd["state"].items()})
            out["param_groups"] += [{**g, "params": [i + offset for i in g["params"]]}
                                    for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """state_dict's groups in param_groups' order (their parameters named by number, as
        state_dict() writes them, or by name, as DCP's set_state_dict passes them)."""
        groups, start = state_dict["param_groups"], 0
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state holds {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)} (Muon's, then AdamW's)")
        for opt in self.optimizers:
            mine = groups[start: start + len(opt.param_groups)]
            start += len(opt.param_groups)
            keys = [k for g in mine for k in g["params"]]
            opt.load_state_dict({"state": {k: state_dict["state"][k] for k in keys
                                           if k in state_dict["state"]},
                                 "param_groups": mine})

    def __repr__(self) -> str:
        return f"MuonAdamW({self.optimizers[0]!r}, {self.optimizers[1]!r})"
