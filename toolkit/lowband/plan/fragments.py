"""How many values each fragment (and each of edit's units) holds: the real split of the real
model, or an even one.

lowband's streaming splits a model with params.split_fragments: whole blocks per fragment, and
the parameters outside the blocks (embeddings, through tying the output head; the final norm)
join the first and the last block's fragment. So fragment 0 of a small-vocabulary GPT is larger
than params/P. A named model (a preset or hf:PATH) is built on the meta device (no memory, no
weights) and split exactly so; bare --params/--layers are spread evenly over the blocks.
"""

from __future__ import annotations

import functools

import torch

from lowband.models import spec
from lowband.params import fragment_of_blocks, split_fragments


@functools.lru_cache(maxsize=16)
def _meta_model(model: str, n_layer: int, n_head: int, d_model: int, vocab_size: int,
                seq_len: int):
    """(model, blocks) built on the meta device, with lowband's size overrides (0 keeps the
    model's; a source whose files fix its sizes ignores them)."""
    source = spec(model)
    with torch.device("meta"):
        net = source.network(n_layer, n_head, d_model, vocab_size, seq_len or source.seq_len)
    return net, source.blocks(net)


def model_size(model: str, *shape: int) -> tuple[int, int]:
    """(parameters, blocks) of a model as lowband builds it; shape: n_layer, n_head, d_model,
    vocab_size, seq_len (0 keeps the preset's)."""
    net, blocks = _meta_model(model, *shape)
    return sum(p.numel() for p in net.parameters()), len(blocks)


def model_fragments(model: str, fragments: int, pattern: str, *shape: int) -> tuple[int, ...]:
    """Values in each of the P fragments lowband's streaming makes of the model."""
    net, blocks = _meta_model(model, *shape)
    return tuple(sum(p.numel() for p in ps)
                 for ps in split_fragments(net, blocks, fragments, pattern))


def model_units(model: str, *shape: int) -> tuple[int, ...]:
    """Values in edit's units of the model: the parameters outside the blocks (the root's),
    then each block's."""
    net, blocks = _meta_model(model, *shape)
    sizes = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
    return (sum(p.numel() for p in net.parameters()) - sum(sizes), *sizes)


def even_units(params: int, layers: int) -> tuple[int, ...]:
    """edit's units when the parameters are spread evenly over the blocks: nothing at the root."""
    return (0, *(params * (i + 1) // layers - params * i // layers for i in range(layers)))


def even_fragments(params: int, layers: int, fragments: int, pattern: str) -> tuple[int, ...]:
    """Values in each fragment when the parameters are spread evenly over the blocks (nothing
    outside them): whole blocks per fragment as lowband assigns them, so with P not dividing L
    some fragments hold more blocks than others."""
    sizes = [0] * fragments
    for i, p in enumerate(fragment_of_blocks(layers, fragments, pattern)):
        sizes[p] += params * (i + 1) // layers - params * i // layers
    return tuple(sizes)
