"""Parameters as flat vectors, and the split of a model into fragments of blocks."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn


def is_dtensor(t) -> bool:
    """Whether t is a DTensor (a sharded parameter of edit's FSDP2), without importing
    torch.distributed.tensor, which is slow to import: no DTensor exists before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


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
