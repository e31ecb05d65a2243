"""The `rlinf-hpc` command line."""
