"""``python -m rlinf_hpc`` is the same as the ``rlinf-hpc`` command."""

from rlinf_hpc.cli.main import main

raise SystemExit(main())
