"""The `hello` app: numbers sent to every component group, results printed (the smallest whole
job: placement, calls on every rank, futures)."""

from rlinf_hpc.apps.hello.config import HelloConfig
from rlinf_hpc.config.apps import App

APP = App(
    name="hello",
    flow="rlinf_hpc.apps.hello.flow:hello_flow",
    sections={"hello": HelloConfig},
    description="send numbers to every component group and print what came back",
)
