"""The outer exchange's options, read by every algorithm that averages pseudo-gradients over
the replicas (diloco, streaming, edit, aedit): the codec and its parameters, how a quantized
average travels, error feedback, the outer rule, and how replicas are weighed.

--merge-weights tokens (diloco, streaming; the default with --local-steps adaptive): each
replica's pseudo-gradient is weighed by the tokens it trained on since the fragment's last sync,
sum_i t_i x_i / sum_i t_i, where uniform (the default otherwise) is the plain mean. Replicas
of a synchronous run with fixed steps train on equal tokens, so the two agree to fp32 rounding
there; they differ where replicas' counts differ (exchanges.Weighted).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowband.comm.codecs import CHUNK, CODEC_RECORDS, CODECS, DENSITY, SPARSE, TWO_PHASE, Chunks
from lowband.comm.wire import EXCHANGES
from lowband.options import ConfigError, Options, option


@dataclass
class ExchangeOptions(Options):
    title = "outer exchange"
    codec: str = option(None, f"outer exchange codec: {', '.join(CODECS)} (diloco and edit fp32, "
                        "streaming fp4-e3m0)", kind=str)
    codec_block: int = option(64, "values per quantization block (one bf16 scale each)")
    exchange: str = option("auto", "how a quantized codec's average travels: all-gather (every "
                           "replica's payload to every replica, (R-1) x the payload a rank, one "
                           "quantization), two-phase (an all-to-all of chunks, each owner re-encodes "
                           "its chunk's mean, then an all-gather: 2(R-1)/R x, a second quantization) "
                           "or auto (the fewer bytes: two-phase from R=3 on); fp32 is an all-reduce",
                           EXCHANGES)
    error_feedback: bool = option(True, "add what quantization dropped to the next "
                                  "pseudo-gradient of the same fragment or block")
    sparse_chunk: int = option(CHUNK, "topk codecs: values per chunk (its top --density share "
                               "travels, indices of ceil(log2 chunk) bits)")
    density: float = option(DENSITY, "topk codecs: the share of each chunk's values sent, in (0, 1]")
    outer_rule: str = option("nesterov", "the outer step: nesterov (Nesterov SGD on the mean "
                             "pseudo-gradient) or sparseloco (SparseLoCo: error feedback decayed by "
                             "--outer-momentum in place of momentum, plain SGD on the mean of what "
                             "was sent)", ("nesterov", "sparseloco"))
    merge_weights: str = option(None, "weigh each replica's pseudo-gradient equally, or by "
                                "the tokens it trained on since the fragment's last sync "
                                "(diloco, streaming)", ("uniform", "tokens"), kind=str,
                                shown="tokens with --local-steps adaptive, else uniform")

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        """--merge-weights left unset: by tokens where replicas train unequal tokens between
        syncs (--local-steps adaptive, --replica-accum: algorithms/pace.py), else uniform."""
        if cfg.merge_weights is None:
            adaptive = getattr(cfg, "local_steps", "fixed") != "fixed"
            unequal = bool(getattr(cfg, "replica_accum", ""))
            cfg.merge_weights = "tokens" if adaptive or unequal else "uniform"

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.codec not in CODECS:
            raise ConfigError(f"unknown codec '{cfg.codec}': use one of {', '.join(CODECS)}.")
        if cfg.codec_block <= 0:
            raise ConfigError(f"--codec-block must be a positive integer, got {cfg.codec_block}.")
        if not 0 < cfg.density <= 1:
            raise ConfigError(f"--density must lie in (0, 1], got {cfg.density}.")
        if not 1 <= cfg.sparse_chunk <= 2 ** 24:
            raise ConfigError(f"--sparse-chunk must lie in 1..16777216, got {cfg.sparse_chunk}.")
        changed = [name for name, default in (("sparse_chunk", CHUNK), ("density", DENSITY))
                   if getattr(cfg, name) != default]
        if changed and cfg.codec not in SPARSE:
            raise ConfigError(f"--{changed[0].replace('_', '-')} applies only to the topk codecs: "
                              f"remove it or pick --codec {' or '.join(SPARSE)}.")
        if cfg.outer_rule == "sparseloco" and not cfg.error_feedback:
            raise ConfigError("--outer-rule sparseloco keeps its momentum in the error feedback: "
                              "drop --no-error-feedback.")
        if cfg.exchange == "two-phase" and cfg.codec != "fp32" and \
                not CODEC_RECORDS[cfg.codec].two_phase:  # the codec's record says (codecs.py)
            raise ConfigError(f"--exchange two-phase takes a dense codec ({', '.join(TWO_PHASE)}): "
                              f"use --exchange all-gather or auto with --codec {cfg.codec}.")
        if cfg.exchange == "two-phase" and cfg.elastic:
            raise ConfigError("--elastic averages over torchft's group with an all-gather: use "
                              "--exchange auto or all-gather with --elastic.")
        if cfg.merge_weights == "tokens" and cfg.algo in ("edit", "aedit"):
            raise ConfigError(f"--algo {cfg.algo} weighs replicas by its penalty (and aedit by "
                              "their steps, --edit-step-weights): drop --merge-weights tokens.")


def exchange_block(cfg) -> "int | Chunks":
    """The `block` the outer exchange's codec takes: --codec-block, or for a topk codec its
    chunk and density."""
    return Chunks(cfg.sparse_chunk, cfg.density) if cfg.codec in SPARSE else cfg.codec_block
