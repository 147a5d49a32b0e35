"""The configuration of a run: one dataclass, one validate() with clear messages.

Every field is a `lowband train` flag (`--batch-size` for `batch_size`) and a key of a
`--config FILE.toml`; flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """Input a user can fix; its message is one sentence naming the fix."""


class ArgParser(argparse.ArgumentParser):
    """argparse for lowband's commands: a bad flag raises ConfigError with one sentence, no usage
    block; each command prints it and exits with status 2."""

    def error(self, message):
        raise ConfigError(f"{message} (see `{self.prog} --help`).")


def _f(default, help: str, choices=None, kind=None):
    """A field; `kind` is its type where the default is None (resolved per algorithm)."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "type": kind or type(default)})


# per-algorithm defaults of the fields left as None
ALGO_DEFAULTS = {
    "diloco": {"fragments": 1, "overlap": 0, "alpha": 0.0, "codec": "fp32"},
    "streaming": {"fragments": 4, "overlap": 1, "alpha": 0.5, "codec": "fp4-e3m0"},
}
OUTER_ALGOS = tuple(ALGO_DEFAULTS)


@dataclass
class Config:
    # what to run
    algo: str = _f("ddp", "training algorithm: ddp, diloco, streaming, zero1, acco, edit or aedit")
    replicas: int = _f(2, "R: replica groups, joined by the slow outer link")
    shards: int = _f(1, "S: ranks inside each replica group, joined by the fast inner link")
    # model
    model: str = _f("micro", "model preset (nano, micro, mini, small, gpt2)")
    n_layer: int = _f(0, "override the preset's number of blocks (0 keeps the preset)")
    n_head: int = _f(0, "override the preset's attention heads (0 keeps the preset)")
    d_model: int = _f(0, "override the preset's width (0 keeps the preset)")
    vocab_size: int = _f(0, "override the vocabulary size (0: 256 for bytes, the preset's otherwise)")
    # data
    data: str = _f("builtin", "'builtin' (the Python standard library's source), a text file or "
                   "directory of text files, or a uint16 token file (.bin)")
    val_fraction: float = _f(0.02, "fraction of the corpus held out for validation")
    seq_len: int = _f(128, "tokens per sequence")
    batch_size: int = _f(8, "sequences per micro-batch on each rank")
    grad_accum: int = _f(1, "micro-batches accumulated per step on each rank")
    # inner optimizer
    steps: int = _f(200, "training steps")
    lr: float = _f(3e-3, "peak learning rate of the inner AdamW")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = _f(10, "linear learning-rate warm-up steps")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the gradient norm to this value (0 disables)")
    # communication
    bucket_mb: float = _f(4.0, "gradient bucket size in MiB for data-parallel all-reduce")
    # sharded optimizer (zero1, acco)
    shard_optimizer: str = _f("adamw", "zero1/acco: optimizer of each rank's shard: adamw (the "
                              "trainer's AdamW) or sgd (plain, no momentum)", ("adamw", "sgd"))
    acco_micro: str = _f("adaptive", "acco: micro-batches per group: adaptive (as many as fit "
                         "while the round is in flight, at least 1), N1:N2 (fixed, every rank) "
                         "or one N1:N2 per rank, comma-separated")
    # outer loop (diloco, streaming)
    sync_every: int = _f(20, "H: inner steps between two syncs of the same fragment")
    fragments: int = _f(None, "P: fragments synced in turn (diloco 1, streaming 4)", kind=int)
    fragment_pattern: str = _f("strided", "strided (block i -> fragment i mod P) or sequential",
                               ("strided", "sequential"))
    overlap: int = _f(None, "tau: steps between starting a fragment's exchange and applying it "
                      "(diloco 0, streaming 1)", kind=int)
    alpha: float = _f(None, "merge theta <- alpha*local + (1-alpha)*outer (diloco 0, streaming 0.5)",
                      kind=float)
    codec: str = _f(None, "outer exchange codec: fp32, bf16, int8, fp4-e3m0, fp4-e2m1 "
                    "(diloco fp32, streaming fp4-e3m0)", kind=str)
    codec_block: int = _f(64, "values per quantization block (one bf16 scale each)")
    error_feedback: bool = _f(True, "add what quantization dropped to the fragment's next "
                              "pseudo-gradient")
    outer_lr: float = _f(0.7, "outer SGD learning rate")
    outer_momentum: float = _f(0.9, "outer SGD Nesterov momentum")
    outer_state_device: str = _f("cpu", "where the outer parameters and momentum live: cpu or "
                                 "same (the model's device)", ("cpu", "same"))
    eval_params: str = _f("local", "evaluate the local (replica) or the outer parameters",
                          ("local", "outer"))
    # edit, aedit (algorithms/edit.py; the pseudo-gradient penalty: algorithms/penalty.py)
    warmup_sync_steps: int = _f(0, "edit/aedit: the first N steps are synchronous training over "
                                "all ranks, local steps and syncs follow")
    sync_seconds: float = _f(5.0, "aedit: seconds of training between two syncs")
    max_seconds: float = _f(0.0, "aedit: wall-clock budget; the run ends at the sync where it is "
                            "spent or where all replicas' steps reach --steps x R (0: no limit)")
    edit_anomaly: bool = _f(True, "edit/aedit: leave a replica out of a block's average when its "
                            "pseudo-gradient norm is anomalous (EWMA z-score)")
    edit_ewma_rate: float = _f(0.1, "edit/aedit: rate of the norms' EWMA mean and variance")
    edit_z: float = _f(3.0, "edit/aedit: z-score above which a norm is anomalous")
    edit_anomaly_warmup: int = _f(3, "edit/aedit: syncs of a block before anomalies are acted on")
    edit_weighted: bool = _f(True, "edit/aedit: weigh replicas by softmax(-norm / T), else equally")
    edit_temperature: float = _f(0.0, "edit/aedit: T of the weights (0: the mean of the block's "
                                 "norms)")
    edit_clip: float = _f(0.0, "edit/aedit: clip a block's averaged pseudo-gradient to this norm "
                          "(0: off)")
    edit_step_weights: bool = _f(True, "aedit: also weigh replicas by their share of the steps "
                                 "since the last sync")
    link_bandwidth: str = _f("", "emulate the outer link's bandwidth, e.g. 100Mbit (empty: none)")
    link_latency: str = _f("0ms", "emulated outer link latency, e.g. 20ms")
    # checkpoints and faults
    checkpoint_every: int = _f(0, "write a checkpoint every N steps and at the end (0: never)")
    keep_checkpoints: int = _f(3, "how many of the newest checkpoints to keep")
    stop_after: int = _f(0, "stop after this many steps as if interrupted (0: run to --steps); "
                         "the schedule still spans --steps, so --resume continues it")
    max_skips: int = _f(10, "stop after this many updates in a row skipped for NaN or inf")
    # fault injection (lowband/faults.py)
    straggler: str = _f("", "REPLICA:FACTOR: that replica computes FACTOR x slower")
    corrupt: str = _f("", "REPLICA:STEP[:SCALE]: noise of SCALE x RMS added to that replica's "
                      "parameters after STEP")
    crash_checkpoint: int = _f(0, "die between writing and renaming the checkpoint of this step "
                               "(to test that the previous one survives)")
    # evaluation, output, reproducibility
    eval_every: int = _f(50, "evaluate on the validation split every N steps (0: only at the end)")
    eval_batches: int = _f(4, "validation micro-batches per evaluation")
    seed: int = _f(0, "seed for initialisation and data order")
    run_dir: str = _f("", "run directory (default: runs/<algo>-<time>)")
    device: str = _f("auto", "auto, cpu or cuda", ("auto", "cpu", "cuda"))
    backend: str = _f("auto", "process-group backend: auto (gloo on CPU; on CUDA nccl when every "
                      "rank of a node has its own GPU, else gloo, which lets several ranks "
                      "share one), nccl or gloo", ("auto", "nccl", "gloo"))
    precision: str = _f("fp32", "fp32, or bf16: forward and backward under bf16 autocast; "
                        "weights, gradients, optimizer states and exchanges stay fp32",
                        ("fp32", "bf16"))
    compile: bool = _f(False, "torch.compile each block's forward (hooks and communication stay "
                       "eager)")
    progress: bool = _f(True, "show a progress bar on rank 0")

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    def validate(self) -> "Config":
        from lowband.algorithms import ALGORITHMS
        from lowband.model import PRESETS

        if self.algo not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm '{self.algo}': use one of {', '.join(ALGORITHMS)}.")
        if self.model not in PRESETS:
            raise ConfigError(f"unknown model '{self.model}': use one of {', '.join(PRESETS)}.")
        for name in ("replicas", "shards", "seq_len", "batch_size", "grad_accum", "steps",
                     "eval_batches", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be a positive integer, got {getattr(self, name)}.")
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "warmup_steps", "eval_every",
                     "checkpoint_every", "max_skips", "crash_checkpoint", "stop_after"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)} must be zero or positive, got {getattr(self, name)}.")
        for name in ("lr", "bucket_mb"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {getattr(self, name)}.")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{_flag(name)} must be zero or positive, got {getattr(self, name)}.")
        for name in ("beta1", "beta2", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{_flag(name)} must lie in [0, 1], got {getattr(self, name)}.")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must lie strictly between 0 and 1, got {self.val_fraction}.")
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"--{_flag(f.name)} '{value}' is not one of {', '.join(choices)}.")
        self._validate_outer()
        from lowband.algorithms.acco import check_config

        check_config(self)
        from lowband.algorithms.edit import check_config as check_edit

        check_edit(self)
        from lowband.faults import parse_corrupt, parse_straggler

        parse_straggler(self.straggler, self.replicas)
        parse_corrupt(self.corrupt, self.replicas, self.steps)
        if self.data != "builtin" and not Path(self.data).exists():
            raise ConfigError(f"data path '{self.data}' does not exist: give an existing text file, "
                              "directory or .bin token file, or 'builtin'.")
        return self

    def _validate_outer(self) -> None:
        from lowband.comm import CODECS, parse_bandwidth, parse_duration

        for name, value in ALGO_DEFAULTS.get(self.algo, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.algo == "diloco" and (self.fragments, self.overlap) != (1, 0):
            raise ConfigError("diloco syncs the whole model with no overlap: use --algo streaming "
                              "for --fragments above 1 or --overlap above 0.")
        try:
            parse_bandwidth(self.link_bandwidth or 0)
            parse_duration(self.link_latency)
        except ValueError as e:
            raise ConfigError(f"{e}.") from None
        if self.algo not in OUTER_ALGOS:
            return
        P, H = self.fragments, self.sync_every
        if H <= 0 or P <= 0:
            raise ConfigError("--sync-every and --fragments must be positive integers.")
        if H % P:
            raise ConfigError(f"--sync-every {H} is not a multiple of --fragments {P}: fragments "
                              "sync in turn every H/P steps, so pick H divisible by P.")
        if P > self.n_blocks():
            raise ConfigError(f"--fragments {P} is more than the model's {self.n_blocks()} blocks: "
                              "use at most one fragment per block.")
        if not 0 <= self.overlap < H // P:
            raise ConfigError(f"--overlap {self.overlap} must be at least 0 and below H/P = "
                              f"{H // P}, so a fragment's exchange lands before its next one starts.")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"--alpha must lie in [0, 1], got {self.alpha}.")
        if self.codec not in CODECS:
            raise ConfigError(f"unknown codec '{self.codec}': use one of {', '.join(CODECS)}.")
        if self.codec_block <= 0 or not self.outer_lr > 0:
            raise ConfigError("--codec-block and --outer-lr must be positive.")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must lie in [0, 1), got {self.outer_momentum}.")

    def n_blocks(self) -> int:
        from lowband.model import PRESETS

        return self.n_layer or PRESETS[self.model][0]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key.replace("-", "_") not in known:
                raise ConfigError(f"unknown key '{key}' in {source}: remove it or use one of the "
                                  "`lowband train --help` options.")
        cfg = cls()
        for key, value in values.items():
            name = key.replace("-", "_")
            expected = FIELD_TYPES[name]
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if value is None and getattr(cfg, name) is None:  # left to the algorithm's default
                continue
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(f"'{key}' in {source} must be of type {expected.__name__}, "
                                  f"got {value!r}.")
            setattr(cfg, name, value)
        return cfg

    @classmethod
    def from_toml(cls, path: str) -> "Config":
        try:
            values = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' does not exist: check the --config path.") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML ({e}): fix its syntax.") from None
        return cls.from_dict(values, source=path)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Config))


FIELD_TYPES = {f.name: f.metadata["type"] for f in dataclasses.fields(Config)}
