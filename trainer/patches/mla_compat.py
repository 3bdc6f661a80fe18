"""Multi-head latent attention (DeepSeek-V2/V3) in megatron-core 0.19.2 with local modules
(no TransformerEngine), in one place.

megatron-core builds ``MLASelfAttention`` for ``multi_latent_attention=True`` from
``get_gpt_decoder_block_spec(config, use_transformer_engine=False)``, but two spots assume
TransformerEngine, and a third does since 0.19; each failed the build without its fix
(docs/trainer.md has the messages):

1. ``transformer/multi_latent_attention.py``, ``MultiLatentAttention.__init__``, builds its core
   attention with ``k_channels`` (the query/key head size, latent + rotary) and ``v_channels``
   (``v_head_dim``). Only TransformerEngine's attention takes them; the local
   ``DotProductAttention`` raises ``TypeError: ... unexpected keyword argument 'k_channels'``.
   ``LocalMLACoreAttention`` accepts both: its scores work for any query/key size (a batched
   matmul) and MLA hands it its softmax scale, so only the output width needs them, which it
   takes from ``v_channels`` (the local attention would use ``kv_channels``).
2. The same module imports ``TELinear`` from ``extensions/transformer_engine.py``, which without
   TransformerEngine still imports, with a ``unittest.mock.MagicMock`` in place of the
   ``transformer_engine`` module: ``HAVE_TE`` is True and ``TELinear`` is derived from a mock,
   not a type, so ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError: isinstance()
   arg 2 must be a type``. ``apply()`` sets that module's ``HAVE_TE`` to False and its
   ``TELinear`` to None when ``TELinear`` is not a type (with TransformerEngine installed it
   is, and nothing changes). The local spec's projections are ``ColumnParallelLinear``, which
   the module's own non-TE branch handles.

3. (New in 0.19.) ``MLASelfAttention`` resolves its query/key-value norms and projections with
   ``transformer/mla_qk_norm_config.py``'s ``QKNormConfigResolver``. Without a query LoRA
   (``q_lora_rank`` None: DeepSeek-V2-Lite) it refuses megatron's own local spec, which sets
   ``q_layernorm`` whenever ``qk_layernorm`` is on (``ValueError: `q_layernorm=...
   WrappedTorchNorm` is non-trivial, but `q_lora_rank is None```), and with the norm left out it
   asks for a fused norm+linear ``linear_q_proj``, which only TransformerEngine has
   (``RuntimeError: qk_layernorm requires TransformerEngine ...``); that would also norm the
   hidden states a second time, which DeepSeek-V2's ``q_proj`` does not. ``LocalMLASelfAttention``
   builds what the checkpoint has: a plain ``q_proj``, no query norm, the key-value latent's norm
   (megatron 0.16.1 built the same modules). With a query LoRA megatron's resolver is used as is.

Under tensor parallelism one more, a megatron bug that is not about TransformerEngine:

4. ``MLASelfAttention.get_query_key_value_tensors``: the local spec's ``linear_kv_down_proj`` is
   column-parallel, so MLA gathers its output columns (``gather_from_tensor_model_parallel_region``)
   and takes the shared rotary key from them. Every rank uses that key for its own heads, but the
   gather's backward keeps each rank's own columns of the gradient: the rotary key's gradient (and
   through it the down projection's and the hidden states') lacks the other ranks' heads. Measured
   under TP2 + SP x EP2 against one rank (tests/trainer/parallel/test_family_layouts.py): the first
   RL step's loss 3.2e-5 off, natural routing after the update different on 1 row of 84; with the
   fix, equal as for the other families. TransformerEngine's spec replicates that projection
   instead, and MLA's branch for a full-width output gathers the rotary key from the sequence
   shards, whose backward sums the ranks' gradients. ``fix_tensor_parallel(model)`` makes the local
   projection take that branch: a forward hook gathers its output columns and scatters the sequence
   back to this rank's shard (requires sequence parallelism, which the trainer's TP sizes turn
   on).

DeepSeek's ``q_a_layernorm`` / ``kv_a_layernorm`` are the spec's ``q_layernorm`` /
``kv_layernorm``, RMSNorms when the config sets ``qk_layernorm`` (the family fields do); the
rotary layout needs no fix: megatron's MLA rope de-interleaves DeepSeek's pairs as
transformers' ``rope_interleave`` and vLLM do (measured: logits equal to 3e-7).
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

_APPLIED = False


class LocalMLACoreAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` with the ``k_channels`` / ``v_channels`` that
    ``MultiLatentAttention`` passes: query/key ``[s, b, heads, k_channels]``, value
    ``[s, b, heads, v_channels]``, output ``[s, b, heads * v_channels]`` (per TP rank)."""

    def __init__(
        self,
        *args: Any,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs: Any,
    ):
        del k_channels  # the scores' matmul takes any query/key size
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the Attention base class builds it once without them
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class LocalMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` that builds a query without LoRA as the checkpoint has
    it: ``linear_q_proj`` from the spec, no query norm (fix 3)."""

    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None:
            return super()._resolve_qk_norm_config(submodules)
        return {
            "linear_q_proj": submodules.linear_q_proj,
            "linear_q_up_proj": IdentityOp,
            "linear_kv_up_proj": submodules.linear_kv_up_proj,
            "q_layernorm": IdentityOp,
            "kv_layernorm": submodules.kv_layernorm,
        }


def apply() -> None:
    """Fix 2 above (idempotent; a no-op where TransformerEngine is installed)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.TELinear is not None and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
        mla.TELinear = None
    _APPLIED = True


def _full_width_on_sequence_shard(module, args, output):
    """Forward hook of a column-parallel ``linear_kv_down_proj`` under sequence parallelism:
    ``[s, b, width / tp]`` -> ``[s / tp, b, width]`` (fix 4)."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    out, bias = output
    out = gather_from_tensor_model_parallel_region(out, group=module.tp_group)
    return scatter_to_sequence_parallel_region(out, group=module.tp_group), bias


def fix_tensor_parallel(model) -> None:
    """Fix 4 above on every latent-attention layer of ``model`` (a no-op at TP 1).

    Raises:
        ValueError: Tensor parallelism without sequence parallelism (not fixed here).
    """
    config = model.config
    if config.tensor_model_parallel_size == 1:
        return
    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            if not config.sequence_parallel:
                raise ValueError(
                    "tensor parallelism with multi-head latent attention needs sequence "
                    "parallelism (parallel.sequence_parallel=true)"
                )
            module.linear_kv_down_proj.register_forward_hook(_full_width_on_sequence_shard)


def decoder_block_spec(config, **kwargs: Any):
    """``get_gpt_decoder_block_spec(config, use_transformer_engine=False, **kwargs)`` with
    ``LocalMLASelfAttention`` and ``LocalMLACoreAttention`` in latent-attention layers (fixes 1
    and 3)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **kwargs)
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            apply()
            attention.module = LocalMLASelfAttention
            attention.submodules.core_attention = LocalMLACoreAttention
    return spec
