"""Every byte that crosses a link goes through here."""
from lowband.comm.codecs import (CODEC_RECORDS, CODECS, DENSITY, SPARSE, Chunks, Codec,
                                 NonFiniteError, decode, encode, payload_bytes)
from lowband.comm.collectives import Average, Comm, Transfer
from lowband.comm.link import Link, parse_bandwidth, parse_duration
from lowband.comm.wire import wire_bytes

__all__ = ["CODEC_RECORDS", "CODECS", "DENSITY", "SPARSE", "Chunks", "Codec", "Average", "Comm", "Link", "NonFiniteError", "Transfer", "decode", "encode",
           "parse_bandwidth", "parse_duration", "payload_bytes", "wire_bytes"]
