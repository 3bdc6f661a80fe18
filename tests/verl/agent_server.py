"""A stand-in for verl's vLLM rollout server, for the agent-loop tests (Ray actors import it).

verl's ``vLLMHttpServer`` needs a vLLM build verl supports, which cannot be installed next to
verl on this CPU machine. ``StandInServer.generate`` reproduces the envelope of its
``generate()`` (verl/workers/rollout/vllm_rollout/vllm_async_server.py, 0.9.1) exactly where the
integration depends on it: the request id it is given, an aborted request answered with
``TokenOutput(token_ids=[], routed_experts=None, stop_reason="aborted")`` (or the tokens and
routes produced before the abort), ``extra_fields["global_steps"]``, ``routed_experts`` only
with ``enable_rollout_routing_replay``, and finish reasons mapped to ``completed``/``aborted``.

What stands in is the engine alone: the completions are scripted (so that verl's tool parser
finds a tool call on the first turns), and their routes and log-probs are the policy's own, by
teacher-forcing the transformers model of the current policy version over prompt + completion
(vLLM's layout: ``[T - 1, num_hidden_layers, k]``). Each call is served by the next policy
version, as if weights were synced between every two calls (an abort's included).
"""

from __future__ import annotations

import numpy as np
import torch

from routereplay.dev.hf_rollout import _forward_with_routes, hf_routers


class StandInServer:
    def __init__(
        self, config, model_dirs, completions, tokenizer_dir, assistant="<|im_start|>assistant"
    ):
        """``assistant``: the chat template's assistant header, counted in a prompt to tell
        which assistant turn a call is (ChatML's by default)."""
        from types import SimpleNamespace

        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl_integration.contract import served_geometry

        torch.set_num_threads(1)
        self.assistant = assistant
        self.moe_layers = list(served_geometry(model_dirs[0]).record.moe_layers)
        self.config = config
        self.model_config = SimpleNamespace(local_path=model_dirs[0])
        self.models = [AutoModelForCausalLM.from_pretrained(d).eval() for d in model_dirs]
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.completions = completions  # the completion of the n-th assistant turn of a sample
        self.global_steps = 0
        self.abort_after = None  # tokens to produce before the next call is aborted
        self.served = []  # (request_id, prompt_ids, token_ids, policy version, routes)

    def abort_next(self, tokens: int) -> None:
        self.abort_after = tokens

    def calls(self):
        return self.served

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        extra_fields = {"global_steps": self.global_steps}
        turn = self.tokenizer.decode(prompt_ids).count(self.assistant) - 1
        completion = list(self.completions[min(turn, len(self.completions) - 1)])
        # A resumed partial rollout's prompt ends with what the aborted call produced.
        resumed = next(
            (n for n in range(len(completion), 0, -1) if list(prompt_ids[-n:]) == completion[:n]),
            0,
        )
        completion = completion[resumed:]
        finish = "stop"
        if self.abort_after is not None:
            completion, finish, self.abort_after = completion[: self.abort_after], "abort", None
            if not completion:
                self.served.append((request_id, list(prompt_ids), [], self.global_steps, None))
                return TokenOutput(
                    token_ids=[],
                    log_probs=None,
                    routed_experts=None,
                    stop_reason="aborted",
                    extra_fields=extra_fields,
                )
        model = self.models[self.global_steps]
        sequence = torch.tensor([list(prompt_ids) + completion])
        with torch.no_grad():
            out, chosen = _forward_with_experts(model, sequence)
        layers = model.config.num_hidden_layers
        k = chosen[0].shape[-1]
        routes = np.zeros((sequence.shape[1] - 1, layers, k), dtype=np.int32)
        for layer, ids in zip(self.moe_layers, chosen, strict=True):
            routes[:, layer] = ids[:-1].numpy()
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        picked = logp.gather(-1, sequence[0, 1:, None]).squeeze(-1)[len(prompt_ids) - 1 :]
        self.served.append(
            (request_id, list(prompt_ids), completion, self.global_steps, routes.copy())
        )
        self.global_steps = min(self.global_steps + 1, len(self.models) - 1)
        return TokenOutput(
            token_ids=completion,
            log_probs=picked.tolist() if sampling_params.get("logprobs") else None,
            routed_experts=routes if self.config.enable_rollout_routing_replay else None,
            stop_reason="aborted" if finish == "abort" else "completed",
            extra_fields=extra_fields,
        )


def _forward_with_experts(model, sequence):
    """``_forward_with_routes``, for the transformers verl pins too: there GLM-4.5's router
    returns only its logits, and its MoE block chooses (``route_tokens_to_experts``), so the
    choice is taken from that method where the block has one."""
    blocks = {n: model.model.layers[n].mlp for n in hf_routers(model)}
    if not all(hasattr(b, "route_tokens_to_experts") for b in blocks.values()):
        return _forward_with_routes(model, sequence)
    chosen = {}

    def capture(n, choose):
        def route_tokens_to_experts(logits):
            indices, weights = choose(logits)
            chosen[n] = indices.detach().clone()
            return indices, weights

        return route_tokens_to_experts

    for n, block in blocks.items():
        block.route_tokens_to_experts = capture(n, block.route_tokens_to_experts)
    try:
        out = model(sequence)
    finally:
        for block in blocks.values():
            del block.route_tokens_to_experts
    return out, [chosen[n] for n in sorted(chosen)]
