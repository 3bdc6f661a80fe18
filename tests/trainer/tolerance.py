"""How far the loss of two runs of the same RL steps may differ when only float32 rounding does.

Two layouts (one rank against TP, EP, DP or pipeline stages), or one layout on two machines'
kernels, compute the same sums in another order: row-parallel partial sums, a matmul blocking
chosen for another padded shape, other vector widths (``ATEN_CPU_CAPABILITY=avx2`` against
AVX-512 here). Nothing else differs: same samples, same routes, same advantages.

The reported loss is a mean over the step's optimizer steps of ``-(1/N) sum_t A_t r_t``, with
``r_t = exp(logp_t - old_t)`` (the PPO ratio, about 1) over the N generated tokens of a
mini-batch. Between the two runs it moves by at most:

- **the log-probs**: ``logp = z - logsumexp(z)`` of a near-uniform tiny model sits at about
  ``ln V`` (6.24 for 512 tokens), where float32's spacing is 4.77e-7; each of ``logp_t`` and
  ``old_t`` lands within one spacing of the other run's (measured: the trainer against
  transformers, a third summation order, differs by at most exactly 4.77e-7 per token), so
  ``r_t`` moves by up to 2 spacings and the loss by ``max|A|`` times that;
- **the sum**: N terms of at most ``max|A|``, summed in float32 in two groupings (micro-batches,
  ranks): up to N - 1 roundings of eps / 2 (eps = 1.19e-7) on each side;
- **the advantages**: GRPO normalises within a group of n; one outlier gives the largest,
  ``max|A| = sqrt(n - 1)`` (1 for the tests' groups of 2).

So ``atol = sqrt(n - 1) * (2 * spacing(ln V) + (N - 1) * eps)``. The weights each run updates
differ too (AdamW turns rounding noise on near-zero gradient entries into steps of up to lr),
but those entries barely move a log-prob, and the ratio divides out what both passes of a step
share: step 1, on weights 4 AdamW steps apart, differed less than step 0 in every run below.

Measured, PP2 x VP2 with recompute against one rank (tests/trainer/parallel/test_rl_layouts.py,
N = 16, n = 2, V = 512: atol 2.74e-6): |d loss| 3.3e-7 with this machine's AVX-512 kernels,
6.2e-7 with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (the value a fresh clone
failed with against the former, unstated 5e-7), the same on repeated runs. A fault stays far
outside: leaving out the TP gradient sum of the sequence-parallel norms moved step 0's loss by
3.6e-6; training without replay (``disabled`` against R3, one rank) by 1.6e-5 at step 0 and
6.5e-4 at step 1; replay ids one token off the records by 3.7e-4 (tests/trainer/rl/test_rl.py).
"""

from __future__ import annotations

import math

import numpy as np

EPS = float(np.finfo(np.float32).eps)


def logprob_spacing(vocab: int) -> float:
    """float32's spacing at ``ln vocab``, where a near-uniform model's log-probs sit."""
    return float(np.spacing(np.float32(math.log(vocab))))


def loss_atol(tokens: int, group_size: int, vocab: int, logprob_noise: float = 0.0) -> float:
    """The loss's bound (module docstring) for mini-batches of ``tokens`` generated tokens,
    GRPO groups of ``group_size`` and a vocabulary of ``vocab``. ``logprob_noise``: for a
    model whose log-probs two summation orders move by more than one spacing
    (``FAMILY_LOGPROB_NOISE``)."""
    max_advantage = math.sqrt(group_size - 1)
    noise = max(logprob_spacing(vocab), logprob_noise)
    return max_advantage * (2 * noise + (tokens - 1) * EPS)


# Families whose log-probs move by more than one spacing between summation orders, as measured
# against transformers (tests/trainer/model/test_model_parity.py, max |logit difference|, right
# padding): gpt-oss's tiny model runs its experts with weights large enough for the SwiGLU
# clamp to act, and its activations, so their rounding, are larger: 2.44e-6, where the other
# families stay at 3.9e-7 to 6.0e-7 (within the spacing above). Measured between TP2+SP x EP2
# and one rank: |d loss| 1.0e-6 and 3.5e-6 on different runs; the bound for it is 6.7e-6.
FAMILY_LOGPROB_NOISE = {"gpt_oss": 2.5e-6}

# The layout tests' steps: mini-batches of 2 samples with 8 generated tokens, groups of 2, the
# tiny models' 512 tokens: 2.74e-6.
LAYOUT_LOSS_ATOL = loss_atol(tokens=2 * 8, group_size=2, vocab=512)
