"""`python -m batchrun.cli`: the `batchrun` command (torchrun relaunches use it)."""

from batchrun.cli import main

main()
