"""Named recipes: configurations as functions. `lowband.recipes.main()` returns the main job's
full, validated Config; `lowband.recipes.main(steps=50)` the same with fields changed;
`lowband train --recipe main --steps 50` runs it with flags on top; `lowband recipes` lists them.

The main job, the benchmarks, the notebooks and the docs share these instead of repeating
flags. The reference recipes set each algorithm's knobs as its paper or its authors' code
does (docs/fidelity.md says where lowband's own algorithm still differs); their model and
length stay small enough for a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowband.config import Config, ConfigError
from lowband.options import close_match


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    values: dict = field(default_factory=dict)

    def __call__(self, **overrides) -> Config:
        """The recipe's Config with `overrides` applied, validated."""
        return self.config(**overrides).validate()

    def config(self, **overrides) -> Config:
        """The same, not yet validated (the CLI sets its flags on top first)."""
        return Config.from_dict({**self.values, **overrides}, source=f"recipe '{self.name}'")


# the main job is Config's defaults (config.py), so its recipe changes nothing; the others
# state their link: NO_LINK for a reference setting, or a benchmark row that adds its own link
NO_LINK = {"link_bandwidth": "", "link_latency": "0ms"}

main = Recipe("main", "the main job (lowband's defaults): Streaming DiLoCo (fp4, 4 fragments, "
              "overlap 1, H=20), 2 replicas of a 0.8M GPT, 200 steps, over an emulated 100 "
              "Mbit/s, 10 ms link")
ddp = Recipe("ddp", "the baseline of the main job: data-parallel over the same link",
             {"algo": "ddp"})
quickstart = Recipe("quickstart", "notebook 01: a short streaming run of a tiny GPT, no link "
                    "emulation", {"algo": "streaming", "model": "nano", "fragments": 2,
                                  "sync_every": 10, "steps": 60, "eval_every": 20, **NO_LINK})

# each seed algorithm as its reference sets it (see docs/fidelity.md)
diloco_paper = Recipe(
    "diloco_paper", "DiLoCo as its paper (arXiv 2311.08105): outer Nesterov SGD lr 0.7, "
    "momentum 0.9, fp32 average every H steps (the paper's H is 500; here 50 for a CPU run)",
    {"algo": "diloco", "model": "micro", "steps": 200, "sync_every": 50, "outer_lr": 0.7,
     "outer_momentum": 0.9, **NO_LINK})
streaming_paper = Recipe(
    "streaming_paper", "Streaming DiLoCo as its paper (arXiv 2501.18512): strided fragments, "
    "overlap 1, alpha 0.5, fp4 E3M0 exchange, outer lr 0.7 momentum 0.9",
    {"algo": "streaming", "model": "mini", "steps": 200, "sync_every": 48, "fragments": 3,
     "fragment_pattern": "strided", "overlap": 1, "alpha": 0.5, "codec": "fp4-e3m0",
     "outer_lr": 0.7, "outer_momentum": 0.9, **NO_LINK})
edit_atorch = Recipe(
    "edit_atorch", "EDiT with atorch's penalty, computed as atorch does (--edit-penalty "
    "reference: a detector per replica, softmax(-norm) at temperature 1 on the raw norms), EWMA "
    "rate 0.02, z-score 3, anomaly warm-up 10 syncs (its README example; its default 120 "
    "outlasts a CPU run), outer Nesterov SGD lr 0.7 momentum 0.8 (its training example); 2 "
    "replicas of 2 shards",
    {"algo": "edit", "model": "micro", "replicas": 2, "shards": 2, "steps": 120,
     "sync_every": 10, "warmup_sync_steps": 10, "edit_penalty": "reference",
     "edit_temperature": 1.0, "edit_ewma_rate": 0.02, "edit_z": 3.0, "edit_anomaly_warmup": 10,
     "outer_lr": 0.7, "outer_momentum": 0.8, **NO_LINK})
aedit_atorch = Recipe(
    "aedit_atorch", "A-EDiT with atorch's settings: syncs by wall-clock time, atorch's penalty "
    "(--edit-penalty reference: raw norms, temperature 1, EWMA rate 0.02, anomaly warm-up 10), "
    "no step weights, a minimum of 10 new steps a sync (atorch's 100 is a floor far below what "
    "its 600 s windows hold; 100 here would be 40% of the 240-step budget and leave about two "
    "syncs, while a 2 s window held 23 to 50 steps of the two replicas on a 2-core CPU)",
    {"algo": "aedit", "model": "micro", "replicas": 2, "steps": 120, "sync_seconds": 2.0,
     "time_budget": 120.0, "warmup_sync_steps": 10, "edit_penalty": "reference",
     "edit_temperature": 1.0, "edit_ewma_rate": 0.02, "edit_anomaly_warmup": 10,
     "edit_step_weights": False, "aedit_min_new_steps": 10, **NO_LINK})
acco_authors = Recipe(
    "acco_authors", "ACCO as its authors' code: adaptive accumulation, estimate and real rounds, "
    "AdamW shards, one learning rate for both rounds, no clipping in the rounds, a budget of "
    "micro-batches (ddp's for 100 steps)",
    {"algo": "acco", "model": "micro", "replicas": 2, "steps": 100, "acco_micro": "adaptive",
     "shard_optimizer": "adamw", "acco_clip": False, **NO_LINK})

# the benchmarks' configurations (benchmarks/*.py start from these)
_SLOW_LINK = {"model": "mini", "replicas": 2, "steps": 72, "batch_size": 4, "seq_len": 128,
              "eval_every": 0, **NO_LINK}
slow_link_ddp = Recipe("slow_link_ddp", "benchmarks/slow_link.py's ddp row (4.8M GPT, 72 steps; "
                       "the benchmark adds the link)", {"algo": "ddp", **_SLOW_LINK})
slow_link_diloco = Recipe("slow_link_diloco", "benchmarks/slow_link.py's diloco row (H=18)",
                          {"algo": "diloco", "sync_every": 18, **_SLOW_LINK})
slow_link_streaming = Recipe(
    "slow_link_streaming", "benchmarks/slow_link.py's streaming row (H=18, P=3, tau 1, "
    "alpha 0.5, fp4-e3m0)", {"algo": "streaming", "sync_every": 18, "fragments": 3, "overlap": 1,
                             "alpha": 0.5, "codec": "fp4-e3m0", **_SLOW_LINK})

_STRAGGLERS = {"model": "micro", "replicas": 2, "steps": 100, "batch_size": 8, "seq_len": 128,
               "eval_every": 0, "eval_batches": 8, "link_bandwidth": "100Mbit",
               "link_latency": "0ms", "straggler": "1:4"}
_STRAGGLER_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0}
stragglers = {name: Recipe(f"stragglers_{name}", f"benchmarks/stragglers_and_spikes.py (a): {name} "
                           "with replica 1 four times slower over 100 Mbit/s", {**_STRAGGLERS, **v})
              for name, v in {"ddp": {"algo": "ddp"},
                              "diloco": {"algo": "diloco", "sync_every": 20, **_STRAGGLER_OUTER},
                              "edit": {"algo": "edit", "sync_every": 20, **_STRAGGLER_OUTER},
                              "aedit": {"algo": "aedit", "sync_seconds": 2.0,
                                        **_STRAGGLER_OUTER}}.items()}
stragglers_ddp, stragglers_diloco = stragglers["ddp"], stragglers["diloco"]
stragglers_edit, stragglers_aedit = stragglers["edit"], stragglers["aedit"]

RECIPES = {r.name: r for r in (main, ddp, quickstart, diloco_paper, streaming_paper, edit_atorch,
                               aedit_atorch, acco_authors, slow_link_ddp, slow_link_diloco,
                               slow_link_streaming, *stragglers.values())}


def get(name: str) -> Recipe:
    if name not in RECIPES:
        meant = close_match(name, RECIPES)
        raise ConfigError(f"unknown recipe '{name}': " + (
            f"did you mean {meant}? (`lowband recipes` lists them)" if meant else
            f"use one of {', '.join(RECIPES)} (`lowband recipes` lists them)") + ".")
    return RECIPES[name]


def table() -> str:
    width = max(map(len, RECIPES))
    return "\n".join(f"{r.name:<{width}}  {r.summary}" for r in RECIPES.values())


def main_cli(argv: list[str]) -> int:
    """`lowband recipes`: the recipes, one a line; `lowband recipes NAME`: its full config."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: lowband recipes [NAME]  (each NAME runs as `lowband train --recipe NAME`)")
        return 0
    if not argv:
        print(table())
        return 0
    cfg = get(argv[0])()
    for key, value in cfg.to_dict().items():
        print(f"{key} = {value!r}")
    return 0
