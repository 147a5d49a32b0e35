"""An algorithm from outside lowband, as a researcher writes one in their own module: DiLoCo
whose outer rule is plain averaging (no momentum): theta_outer <- theta_outer - avg_step * mean
delta, so with --avg-step 1 (the default) the replicas restart each sync from their mean
(local SGD / FedAvg's rule).

It subclasses lowband's DiLoCo and overrides only the outer rule, brings one option group of
its own (--avg-step) beside DiLoCo's, and registers itself on import. LOWBAND_ALGORITHMS names
it for `lowband train` and its workers:

    LOWBAND_ALGORITHMS=examples/diloco_avg.py lowband train --algo diloco-avg --avg-step 0.8

tests/test_outside_algorithm.py runs it that way; a package would name it in an entry point
instead:

    [project.entry-points."lowband.algorithms"]
    diloco-avg = "diloco_avg:DiLoCoAvg"
"""

from dataclasses import dataclass

import lowband
from lowband.algorithms.outer import sgd_step
from lowband.algorithms.streaming import DiLoCo
from lowband.options import ConfigError, Options, option


@dataclass
class AvgOptions(Options):
    title = "plain averaging"
    avg_step: float = option(1.0, "outer step on the averaged pseudo-gradient (1: the replicas' "
                             "mean; no momentum)")

    @classmethod
    def check(cls, cfg) -> None:
        if not 0 < cfg.avg_step <= 1:
            raise ConfigError(f"--avg-step must lie in (0, 1], got {cfg.avg_step}.")


@lowband.register
class DiLoCoAvg(DiLoCo):
    name = "diloco-avg"
    summary = "DiLoCo with plain averaging as its outer rule (no momentum): an outside algorithm"
    options = (*DiLoCo.options, AvgOptions)

    def outer_step(self, f, delta):
        return sgd_step(f.outer, delta, self.config.avg_step, self.staging)
