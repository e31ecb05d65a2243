"""Applications built on the framework, each a package of its own: ``hello`` and ``toy`` (the
demos), ``math`` (LLM reasoning with GRPO/PPO), ``embodied`` (PPO against CPU simulators). The
framework packages import none of them; each registers its `rlinf_hpc.config.apps.App` under
the ``rlinf_hpc.apps`` entry points."""
