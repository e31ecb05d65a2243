"""[hello]: the hello app's one section."""

from __future__ import annotations

from pydantic import Field

from rlinf_hpc.config.section import Section


class HelloConfig(Section):
    """[hello]: parameters of the `hello` flow."""

    num_items: int = Field(8, ge=1, le=1_000_000, description="Numbers sent to each component.")
