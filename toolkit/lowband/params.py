"""Parameters as flat vectors, this rank's pieces of sharded ones (and of an optimizer's state),
and the split of a model into fragments of blocks."""

from __future__ import annotations

import hashlib
import sys

import torch
import torch.nn as nn


def is_dtensor(t) -> bool:
    """Whether t is a DTensor (a sharded parameter of edit's FSDP2), without importing
    torch.distributed.tensor, which is slow to import: no DTensor exists before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly sharded) tensor, sharing its storage."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def local_state(optim_state: dict) -> dict:
    """An optimizer's state dict with each sharded tensor as this rank's piece."""
    return {"state": {i: {k: local_piece(v) for k, v in st.items()} for i, st in optim_state["state"].items()},
            "param_groups": optim_state["param_groups"]}


def sharded_state(local: dict, optimizer) -> dict:
    """local_state's inverse for this optimizer: each piece as a DTensor shaped like its
    parameter (the same mesh and placements: the groups shard alike)."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, st in local["state"].items():
        p = params[int(i)]
        state[i] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                          stride=p.stride())
                    if is_dtensor(p) and v.dim() > 0 else v for k, v in st.items()}
    return {"state": state, "param_groups": local["param_groups"]}


def flatten(params: list[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 copy of the parameters, in order."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


@torch.no_grad()
def write_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector (as made by flatten) back into the parameters."""
    offset = 0
    for p in params:
        p.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()


def fragment_of_blocks(n_blocks: int, fragments: int, pattern: str) -> list[int]:
    """Fragment index of each block: strided (block i -> i mod P) or sequential (contiguous)."""
    if pattern == "strided":
        return [i % fragments for i in range(n_blocks)]
    return [i * fragments // n_blocks for i in range(n_blocks)]


def split_fragments(model: nn.Module, blocks: nn.ModuleList, fragments: int,
                    pattern: str) -> list[list[nn.Parameter]]:
    """The model's parameters in P fragments of whole blocks.

    Parameters outside the blocks join a block's fragment: those registered before the first
    block's (lowband's GPT: the token and position embeddings, and through tying the output
    head) join the first block's fragment; those registered after (the final norm) join the
    last block's fragment. Each fragment lists its parameters in registration order.
    """
    owner = fragment_of_blocks(len(blocks), fragments, pattern)
    in_block = {id(p): owner[i] for i, b in enumerate(blocks) for p in b.parameters()}
    out: list[list[nn.Parameter]] = [[] for _ in range(fragments)]
    seen_block = False
    for p in model.parameters():
        if id(p) in in_block:
            seen_block = True
            out[in_block[id(p)]].append(p)
        else:
            out[owner[-1] if seen_block else owner[0]].append(p)
    return out


def digest(tensors: dict | None) -> str | None:
    """sha256 of a state's tensors' bytes, in key order: equal states, equal digests."""
    if tensors is None:
        return None
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                 .tobytes())
    return h.hexdigest()
