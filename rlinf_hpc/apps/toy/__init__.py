"""The `toy_pipeline` app: `rlinf_hpc.scheduler.Pipeline` over sleep-costed stages (placement
and micro-batching experiments without a model). Parameters in ``[flow] options``."""

from rlinf_hpc.config.apps import App

APP = App(
    name="toy_pipeline",
    flow="rlinf_hpc.apps.toy.flow:toy_pipeline_flow",
    description="a pipeline of toy stages over the job's components in config order",
)
