"""The parallel sizes, a rank's coordinates under them, and data parallelism (step 1): which
samples a DP rank fetches. Errors raised before a step are ``ParallelismError``."""

from __future__ import annotations

from dataclasses import dataclass


class ParallelismError(ValueError):
    """Parallel sizes that cannot replay the records as configured (raised before a step)."""


# --------------------------------------------------------------------------------------------
# Parallelism


@dataclass(frozen=True)
class Parallelism:
    """Parallel sizes of the trainer (megatron's names).

    Attributes:
        tp: Tensor-parallel size. cp: context-parallel size. pp: pipeline-parallel size.
        vp: Virtual pipeline stages per pipeline rank (None: not interleaved).
        ep: Expert-parallel size (nothing to reshard: expert ids are global).
        etp: Expert tensor-parallel size (None: megatron's default, ``tp``).
        sequence_parallel: Sequence parallel across the TP ranks (megatron requires it for MoE
            training with TP > 1).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vp: int | None = None
    ep: int = 1
    sequence_parallel: bool = False
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; refuses a world that does not divide."""
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ParallelismError(f"{name}={getattr(self, name)}; parallel sizes must be >= 1")
        model = self.tp * self.cp * self.pp
        if world_size % model:
            raise ParallelismError(
                f"world size {world_size} is not divisible by tp x cp x pp = {self.tp} x "
                f"{self.cp} x {self.pp} = {model}"
            )
        dp = world_size // model
        if (dp * self.cp * self.tp) % (self.ep * self.expert_tp):
            raise ParallelismError(
                f"ep x etp = {self.ep} x {self.expert_tp} must divide dp x cp x tp = {dp} x "
                f"{self.cp} x {self.tp} (world size {world_size})"
            )
        if self.tp > 1 and not self.sequence_parallel:
            raise ParallelismError(
                "MoE training with tp > 1 needs sequence_parallel=True (megatron)"
            )
        if self.vp is not None and self.pp < 2:
            raise ParallelismError(f"vp={self.vp} needs pp > 1")
        return dp

    @property
    def multiple(self) -> int:
        """What each sequence (THD) or the padded sequence length must be a multiple of."""
        return pad_multiple(self.tp, self.cp, self.sequence_parallel)


def pad_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """TP x CP x 2 with context parallelism (2 x CP chunks, each split over TP with SP), TP with
    sequence parallelism alone, else 1."""
    tp_part = tp if sequence_parallel else 1
    return tp_part * cp * 2 if cp > 1 else tp_part


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class RankCoords:
    """One rank's coordinates under the parallel sizes (megatron's ranks within each group)."""

    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0
    vp_stage: int | None = None


# --------------------------------------------------------------------------------------------
# 1. Data parallel


def dp_shard(num_samples: int, dp_size: int, dp_rank: int) -> range:
    """Indices of the samples of one DP rank: contiguous blocks, as megatron's sampler hands a
    global batch out (rank r gets ``[r * n / dp, (r + 1) * n / dp)``).

    Raises:
        ParallelismError: ``num_samples`` not divisible by ``dp_size`` (ranks would disagree on the
            number of steps and hang).
    """
    if not 0 <= dp_rank < dp_size:
        raise ParallelismError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    if num_samples % dp_size:
        raise ParallelismError(
            f"a batch of {num_samples} samples does not divide over {dp_size} DP ranks"
        )
    per = num_samples // dp_size
    return range(dp_rank * per, (dp_rank + 1) * per)
