"""lowband's TorchX component by path, for `torchx run` from a source checkout:

    torchx run launchers/lowband_components.py:train --replicas 2 -- --model nano --steps 20

The component ships in the package (lowband/launch/component.py; `torchx run lowband.train` finds
it there through the `torchx.components` entry point); this file only re-exports it. TorchX reads
a component file's own source for the function it runs (its linter), so `train` is written out
here, as a wrapper that carries the packaged component's signature and documentation.
"""

import functools

from torchx.specs import AppDef

from lowband.launch import component


@functools.wraps(component.train)
def train(*flags: str, **params) -> AppDef:
    return component.train(*flags, **params)
