"""Test and lab tooling, outside the core: nothing in lowband outside this folder imports it.

  synthetic.py       run directories written as a trainer would, without training (the
                     dashboard's and the report's tests and demos)
  testbed.py         test hosts on this machine: network namespaces joined by shaped veth pairs
  slurm_cluster.py   a local Slurm cluster (`python -m lowband.testing.slurm_cluster up`)
"""
