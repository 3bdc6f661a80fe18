"""The RL objective: rewards, GRPO advantages, token log-probs, the PPO clipped loss.

**Reward rule** (built in, deterministic, a function of the tokens only): the fraction of a
sample's generated tokens in the target class, token ids that are multiples of
``TARGET_MODULUS`` (8: one id in 8). The task does not matter here (the data plane does). A
small class spreads the rewards within a GRPO group (0 to 3 hits in 10 tokens, against the
near-constant one-half of a class covering half the vocabulary), so the advantages are large
and point at the class: a few PPO steps raise ``expected_reward``, the policy's probability
mass on the class at the rollout's generated positions (the expected reward of one token drawn
there). An earlier rule, even ids, moved it 0.5023 -> 0.5003 in 2 steps: no signal.

**Advantages** (GRPO): rewards normalised within each ``group_id``, (r - mean) / (std + 1e-6);
a group of one gets 0. Every generated token of a sample gets its sample's advantage.

**Loss** (PPO clipped, token mean over the generated tokens of the micro-batch):
``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` with ``ratio = exp(logp - old_logp)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from trainer.data.source import Sample

TARGET_MODULUS = 8
REWARD_RULE = f"fraction of generated tokens whose id is a multiple of {TARGET_MODULUS}"


def reward(sample: Sample) -> float:
    """The built-in reward of one sample (``REWARD_RULE``)."""
    generated = sample.token_ids[sample.generated]
    return float((generated % TARGET_MODULUS == 0).mean()) if generated.size else 0.0


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str]) -> np.ndarray:
    """float32 ``[samples]``: rewards normalised within each group (GRPO)."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    for members in groups.values():
        if len(members) > 1:
            r = rewards[members]
            out[members] = (r - r.mean()) / (r.std() + 1e-6)
    return out.astype(np.float32)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[batch, seq]``: column c holds log p(token c | tokens before it); column 0 is 0.

    Args:
        logits: ``[batch, seq, vocab]`` (any float dtype; computed in float32).
        token_ids: int64 ``[batch, seq]``.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, token_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """float32 ``[batch, seq]``: column c holds the entropy of the policy's distribution of
    token c (column 0 is 0), in nats."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def target_mass(logits: torch.Tensor) -> torch.Tensor:
    """float32 ``[batch, seq]``: column c holds the policy's probability that token c is in
    the target class (the expected reward of one token drawn there)."""
    p = torch.softmax(logits[:, :-1].float(), dim=-1)
    return torch.nn.functional.pad(p[..., 0::TARGET_MODULUS].sum(-1), (1, 0))


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    tokens: int | None = None,
) -> tuple[torch.Tensor, float]:
    """PPO clipped loss (token mean over ``mask``) and the fraction of tokens clipped.

    Args:
        logp: float32 ``[batch, seq]`` with gradients.
        old_logp: float32 ``[batch, seq]``, the old-logprob pass.
        advantages: float32 ``[batch, seq]`` (each token its sample's advantage).
        mask: bool ``[batch, seq]``, the generated tokens.
        clip_eps: The clip range.
        tokens: Divide by this many tokens instead of ``mask.sum()`` (data parallel: the
            micro-batch's generated tokens over every DP rank, so the ranks' sum is the mean).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1) if tokens is None else max(tokens, 1)
    loss = (per_token * mask).sum() / n
    clip_fraction = float(((unclipped != clipped) & mask).sum() / n)
    return loss, clip_fraction
