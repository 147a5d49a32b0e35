"""Every byte that crosses a link goes through here."""
from lowband.comm.collectives import Comm, Transfer, wire_bytes

__all__ = ["Comm", "Transfer", "wire_bytes"]
