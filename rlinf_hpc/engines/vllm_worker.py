"""Code that runs inside vLLM's worker: the weight-sync route of `VLLMRollout`.

vLLM loads this class into its worker (``LLM(worker_extension_cls=...)``, the mechanism of its
own RLHF examples) and `VLLMRollout` calls its methods through ``LLM.collective_rpc``, which
reaches every worker of the engine (one here: the engine runs in the rank's process, so the
tensors are passed by reference, not serialized).

Weights go through the worker's ``reload_weights`` (vLLM's in-place, layer-wise reload): each
layer is restored to its checkpoint layout, loaded with the model's own loaders (fused
qkv/gate-up, shards) and post-processed again, so it works where the engine has repacked its
weights into kernel formats (CPU GEMM prepacking drops the parameters' ``weight_loader``s; a
plain ``model.load_weights`` then fails half-way). One gap is closed here: with tied input and
output embeddings the checkpoint has no ``lm_head.weight``, so the layer-wise reload skips the
head and, on CPU, the head keeps a prepacked copy of the *old* embedding; the head is
post-processed again from the reloaded embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class WeightSyncExtension:
    """Methods added to vLLM's worker class (``self`` is the worker)."""

    def rlinf_update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Load checkpoint-format ``(name, tensor)`` pairs in place; returns how many."""
        weights = list(named_tensors)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        refresh_tied_head(self.model_runner.model)  # type: ignore[attr-defined]
        return len(weights)

    def rlinf_parameter_bytes(self) -> int:
        """Bytes of the engine's model parameters (tests: repeated syncs do not grow it)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return sum(p.numel() * p.element_size() for p in model.parameters())


def refresh_tied_head(model: Any) -> bool:
    """Post-process an output head tied to the input embedding again (True if it was)."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None or head is embed:
        return False
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return False  # untied: the reload loaded and processed the head itself
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True
