"""State trees for checkpoints: tensors apart from structure, RNG states, host copies.

A state is a tree of dicts (any JSON-scalar keys, e.g. an optimizer's integer parameter ids),
lists, tuples, tensors, numpy arrays and JSON scalars. `flatten` splits it into a tensor table
(for safetensors) and a JSON skeleton that names each tensor; `unflatten` puts it back with the
same container and key types. Anything else is refused with its path, so nothing needs pickle.

>>> import torch
>>> tensors, skeleton = flatten({"step": 3, 1: (torch.ones(2), [0.5, None])})
>>> sorted(tensors), skeleton["D"][1]
(['t0'], [1, {'U': [{'T': 't0'}, {'L': [0.5, None]}]}])
>>> state = unflatten(tensors, skeleton)
>>> state["step"], type(state[1]).__name__, state[1][0].tolist()
(3, 'tuple', [1.0, 1.0])

A tensor met again as the same view (tied weights) is stored once:

>>> weight = torch.ones(3)
>>> sorted(flatten({"embed": weight, "head": weight, "other": weight[1:]})[0])
['t0', 't1']
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import random
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from rlinf_hpc.imports import loaded

if TYPE_CHECKING:
    import torch

_SCALARS = (bool, int, float, str, type(None))


def _tensor_type() -> type | tuple[()]:
    """torch's Tensor class, or no class at all (``isinstance(x, ())`` is False) in a process
    that never imported torch: ranks that run no torch code (the coordinator; hello, toy and
    probe workers) start ~3 s of CPU sooner on a slow 2-core box without importing it."""
    torch = loaded("torch")
    return torch.Tensor if torch is not None else ()


def flatten(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, skeleton)``: every tensor (and ndarray) under its own key ``t<N>``."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}  # a view met again (tied weights): its first key
    tensor_type = _tensor_type()

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, tensor_type):
            view = _view_identity(node)
            if view in seen:
                return {"T": seen[view]}
            key = f"t{len(tensors)}"
            tensors[key] = node
            if view is not None:
                seen[view] = key
            return {"T": key}
        if isinstance(node, np.ndarray):
            import torch

            key = f"t{len(tensors)}"
            tensors[key] = torch.from_numpy(np.ascontiguousarray(node))
            return {"A": key}
        if isinstance(node, np.generic):
            return walk(node.item(), path)
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, dict):
            pairs = []
            for key, value in node.items():
                if not isinstance(key, _SCALARS):
                    raise TypeError(f"checkpoint state {path}: key {key!r} is not a JSON scalar")
                pairs.append([key, walk(value, f"{path}[{key!r}]")])
            return {"D": pairs}
        if isinstance(node, (list, tuple)):
            items = [walk(value, f"{path}[{i}]") for i, value in enumerate(node)]
            return {"L": items} if isinstance(node, list) else {"U": items}
        raise TypeError(
            f"checkpoint state {path} is a {type(node).__module__}.{type(node).__qualname__}; a "
            "state_dict() may hold only dicts, lists, tuples, tensors, numpy arrays and JSON "
            "scalars (checkpoints never pickle)"
        )

    return tensors, walk(state, "state")


def _view_identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same bytes: storage, offset, shape, strides, dtype (tied
    embeddings appear twice in a state_dict; written once, they load back as one tensor). None
    for a tensor without storage."""
    pointer = tensor.untyped_storage().data_ptr()
    if not pointer:
        return None
    return (
        tensor.device,
        pointer,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def unflatten(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """The inverse of `flatten`."""
    if isinstance(skeleton, dict):
        ((kind, value),) = skeleton.items()
        if kind == "T":
            return tensors[value]
        if kind == "A":
            return tensors[value].numpy()
        if kind == "D":
            return {key: unflatten(tensors, item) for key, item in value}
        items = [unflatten(tensors, item) for item in value]
        return items if kind == "L" else tuple(items)
    return skeleton


def host_copy(state: Any, pool: dict[str, torch.Tensor] | None = None) -> Any:
    """A copy of ``state`` whose tensors are contiguous host-memory copies (the only part of an
    async save that stalls training); containers are copied, scalars shared, a view met again
    (tied weights) copied once. With ``pool``, buffers of the same shape and dtype from the
    previous save are reused: copying into memory that is already mapped is several times
    faster than into fresh pages."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(node: Any, path: str) -> Any:
        if isinstance(node, _tensor_type()):
            view = _view_identity(node)
            if view in copies:
                return copies[view]
            if pool is None:
                out = node.detach().to("cpu", copy=True).contiguous()
            else:
                buffer = pool.get(path)
                if buffer is None or buffer.shape != node.shape or buffer.dtype != node.dtype:
                    buffer = pool[path] = node.new_empty(node.shape, device="cpu")
                out = buffer.copy_(node.detach())
            if view is not None:
                copies[view] = out
            return out
        if isinstance(node, np.ndarray):
            return node.copy()
        if isinstance(node, dict):
            return {key: copy(value, f"{path}/{key}") for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            items = [copy(value, f"{path}/{i}") for i, value in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return node

    return copy(state, "")


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors and arrays in ``state`` (nested dicts, lists, tuples), a view met
    again (tied weights) counted once.

    >>> import torch
    >>> w = torch.zeros(4)
    >>> tensor_bytes({"w": w, "tied": w, "m": [np.zeros(2, dtype=np.int64)], "step": 3})
    32
    """
    seen: set[tuple[Any, ...]] = set()

    def count(node: Any) -> int:
        if isinstance(node, _tensor_type()):
            view = _view_identity(node)
            if view is not None and view in seen:
                return 0
            if view is not None:
                seen.add(view)
            return node.numel() * node.element_size()
        if isinstance(node, np.ndarray):
            return int(node.nbytes)
        if isinstance(node, dict):
            return sum(count(value) for value in node.values())
        if isinstance(node, (list, tuple)):
            return sum(count(value) for value in node)
        return 0

    return count(state)


def host_view(state: Any) -> Any:
    """``state`` with every tensor readable from host memory: CPU tensors as they are (a
    synchronous save writes them before training goes on), device tensors copied."""
    if isinstance(state, _tensor_type()):
        return state.detach().to("cpu").contiguous()
    if isinstance(state, dict):
        return {key: host_view(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        items = [host_view(value) for value in state]
        return items if isinstance(state, list) else tuple(items)
    return state


def seed_process(seed: int, rank: int) -> None:
    """Seed python's, numpy's and torch's global generators from (job seed, world rank), so
    that whatever draws from them does so identically run to run (and a checkpoint of their
    state means something). torch is seeded now if it is imported, else the moment it is."""
    derived = random.Random(f"{seed}:{rank}:process").getrandbits(32)
    random.seed(derived)
    np.random.seed(derived)
    torch = loaded("torch")
    if torch is not None:
        torch.manual_seed(derived)
        return
    for finder in [f for f in sys.meta_path if isinstance(f, _SeedTorchOnImport)]:
        sys.meta_path.remove(finder)
    sys.meta_path.insert(0, _SeedTorchOnImport(derived))


class _SeedTorchOnImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: finds torch through the other finders and seeds its global
    generator as soon as its module has run, before any code can draw from it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, seed = spec.loader.exec_module, self.seed

        def exec_and_seed(module: Any) -> None:
            run(module)
            module.manual_seed(seed)

        spec.loader.exec_module = exec_and_seed  # type: ignore[method-assign]
        return spec


def capture_rng() -> dict[str, Any]:
    """This process's random generators: python, numpy, torch CPU and every CUDA device (torch's
    only if torch is imported: a process without it cannot have drawn from them)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = loaded("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_rng` took (after a round trip through `flatten`/`unflatten`)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
