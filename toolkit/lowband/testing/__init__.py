"""Test and lab tooling, outside the core: nothing in lowband outside this folder imports it.

  synthetic.py       run directories written as a trainer would, without training (the
                     dashboard's and the report's tests and demos)
  slurm_cluster.py   a local Slurm cluster (`python -m lowband.testing.slurm_cluster up`)
  chaos.py           an --elastic run under kills from outside, and the invariants its records
                     must keep (benchmarks/chaos.py, tests/test_chaos.py)
  tunnel.py          wireguard-go between the test hosts, and a packet capture on their link
                     (benchmarks/tunnel.py, tests/test_tunnel.py)

The test hosts (network namespaces joined by a shaped link) are lowband.launch.hosts: `lowband
compare --test-hosts` runs over them.
"""
