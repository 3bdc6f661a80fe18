"""The trainer's configuration: one dataclass, from YAML, with dotted command-line overrides.

The names follow what users of RL frameworks know: ``router_replay.mode`` in ``disabled``,
``R2``, ``R3``; ``router_replay.record_file``; ``router_replay.replay_file``. Example::

    python -m trainer --config config.yaml router_replay.mode=R3 train.seed=3

An override's value is parsed as YAML (``3`` is an int, ``true`` a bool, ``null`` None).
Unknown keys and invalid values fail before anything runs, naming the key.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routereplay.domain.record_checks import MissingRecord


class ConfigError(ValueError):
    """A configuration key or value is invalid."""


class ReplayMode(enum.Enum):
    """Which routes the trainer's routers use."""

    DISABLED = "disabled"  # natural routing
    R2 = "R2"  # record in the old-logprob pass, replay in the update passes over that batch
    R3 = "R3"  # replay the rollout engine's routes (route cache or replay_file)


# The string settings below are enums with string values (StrEnum), so YAML and dotted
# overrides spell them as before and code may compare them with plain strings.
class PaddingSide(enum.StrEnum):
    RIGHT = "right"
    LEFT = "left"


class Dtype(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class DataSource(enum.StrEnum):
    IDS = "ids"  # the sample ids given, or every record of the file
    FEED = "feed"  # the route cache's ready feed


@dataclass
class RouterReplayConfig:
    """``router_replay.*``.

    Attributes:
        mode: ``disabled``, ``R2`` or ``R3``.
        record_file: Write the routes used (recorded in R2, fetched in R3) here, for offline
            analysis; None writes nothing.
        replay_file: R3 only: replay routes from such a file instead of the route cache.
        missing_record: ``error`` fails the step when a sample has no record; ``native`` routes
            that sample natively, with a warning and a counter.
    """

    mode: ReplayMode = ReplayMode.DISABLED
    record_file: str | None = None
    replay_file: str | None = None
    missing_record: MissingRecord = MissingRecord.ERROR

    @property
    def enabled(self) -> bool:
        return self.mode is not ReplayMode.DISABLED


@dataclass
class ModelConfig:
    """``model.*``: the Hugging Face checkpoint folder that the rollout server serves."""

    path: str = ""
    # The model id the records must carry (the rollout server's ``model_id``); empty: the
    # checkpoint folder's name, the rollout server's default.
    model_id: str = ""
    recompute: bool = False  # full activation recompute, one layer per checkpoint
    # > 0: megatron's load-balancing aux loss (``aux_loss``) with this coefficient; it is
    # computed from the routers' natural top-k even under replay.
    aux_loss_coeff: float = 0.0
    # Leave the checkpoint's multi-token-prediction layers (DeepSeek-V3's
    # num_nextn_predict_layers) out of the trained model; exports carry them over unchanged.
    # False refuses such checkpoints (megatron's MTP block adds its own loss to the gradient).
    drop_mtp_layers: bool = True


@dataclass
class ClientSecurityConfig:
    """How the trainer reaches a service: the same keys for every outgoing connection.

    Attributes:
        tls: speak TLS, trusting the system's roots unless ``ca_file`` is set.
        ca_file: the CA of the service's certificate (PEM; turns TLS on).
        cert_file, key_file: this trainer's certificate and key, for mutual TLS.
        token_file: a file holding the bearer token the service expects.
    """

    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    token_file: str = ""

    def security(self):
        """These settings as a ``routereplay.rpc.security.ClientSecurity`` for the client."""
        from routereplay.rpc.security import ClientSecurity

        return ClientSecurity(
            tls=self.tls,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            token_file=self.token_file,
        )


@dataclass
class RouteCacheConfig(ClientSecurityConfig):
    """``route_cache.*``: the route cache service (R3 without a replay_file): ``target``
    (``host:port``) and how to reach it (``ClientSecurityConfig``'s keys)."""

    target: str = ""


@dataclass
class PushConfig(ClientSecurityConfig):
    """``push.*``: the rollout servers that load each export through ``UpdateWeights``.

    Attributes:
        targets: comma-separated ``host:port``; each loads the folder (shared storage: they
            must be able to read it) and bumps its policy version. None pushes nothing.
        The rest: how to reach them (``ClientSecurityConfig``'s keys).
    """

    targets: str | None = None


@dataclass
class TrainConfig:
    """``train.*``.

    Attributes:
        steps: Steps to run (one batch each).
        batch_size: Samples per step (keep whole GRPO groups in a batch).
        micro_batch_size: Samples per micro-batch (one forward of megatron's schedule).
        mini_batch_size: Samples per optimizer step: each update pass runs the schedule over a
            mini-batch's micro-batches, accumulating gradients, then steps. None: one
            micro-batch per optimizer step.
        max_tokens_per_micro_batch: Dynamic batching: each mini-batch's micro-batches are
            filled up to this many tokens (padded to the parallel sizes' multiple) instead of
            ``micro_batch_size`` samples, balanced, the same count on every DP rank.
        packing: Remove padding: each micro-batch's sequences packed back to back in one row
            (THD), each padded to the parallel sizes' multiple, attention block-diagonal.
        ppo_epochs: Update passes over each batch.
        clip_eps: PPO clip range.
        dtype: ``float32`` or ``bfloat16`` (parameters and activations; AdamW keeps float32
            master weights).
        export_dir: Export the weights in the Hugging Face format the rollout server loads to
            ``export_dir/step_NNNNNN`` every ``export_every`` steps (and after the last step);
            ``export_dir/latest`` names the newest. None exports nothing.
        checkpoint_dir: Save model, optimizer, step and RNG states to
            ``checkpoint_dir/step_NNNNNN.pt`` every ``checkpoint_every`` steps (and after the
            last step). None saves nothing.
        resume: Continue from the last checkpoint in ``checkpoint_dir`` when there is one.
    """

    seed: int = 0
    padding_side: PaddingSide = PaddingSide.RIGHT
    steps: int = 1
    batch_size: int = 8
    micro_batch_size: int = 4
    mini_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    packing: bool = False
    ppo_epochs: int = 2
    clip_eps: float = 0.2
    lr: float = 1e-4
    weight_decay: float = 0.0
    dtype: Dtype = Dtype.FLOAT32
    export_dir: str | None = None
    export_every: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    resume: bool = True

    @property
    def mini_batch_size_or_micro(self) -> int:
        """Samples per optimizer step."""
        return self.mini_batch_size or self.micro_batch_size


@dataclass
class DataConfig:
    """``data.*``: where samples come from besides the route cache.

    Attributes:
        records_file: The rollout's records from a file (``save_records``) instead of the
            route cache, in any mode (R3's ``replay_file`` does the same for R3).
        prefetch: Fetch batch i + 1 while batch i trains.
        source: ``ids`` (the sample ids given, or every record of the file) or ``feed`` (the
            route cache's ready feed: each batch is the next ``batch_size / group_size``
            whole GRPO groups announced; see ``trainer.data.source.FeedPlans``).
        group_size: ``feed``: samples per GRPO group.
        consumer_group: ``feed``: the consumer group on the feed (one per training job).
        consumer: ``feed``: this job's consumer name; a restarted job reuses it to get back
            the groups it had not acknowledged.
        start_from_latest: ``feed``: a consumer group created now skips earlier entries.
        wait_s: ``feed``: how long to wait for a batch; the run ends when none comes.
        stage_reads: From the route cache, one rank per (DP rank, pipeline stage) reads its
            stage's MoE layers and shares them with its TP/CP group
            (``trainer.data.stage_reads``); false: every rank reads whole records.
    """

    records_file: str | None = None
    prefetch: bool = True
    source: DataSource = DataSource.IDS
    group_size: int = 1
    consumer_group: str = "trainer"
    consumer: str = "trainer"
    start_from_latest: bool = False
    wait_s: float = 600.0
    stage_reads: bool = True


@dataclass
class ReportConfig:
    """``report.*``.

    Attributes:
        compare: Run a comparison pass each step with the other routing (natural in R3, the
            rollout's replayed routes in disabled and R2), so the gap to the rollout is reported
            with replay and without in the same step; costs one forward per micro-batch.
        json: Write the run's report (every step) to this JSON file.
        tensorboard_dir: Log the report's scalars every step to TensorBoard event files here.
        metrics: Serve Prometheus metrics at ``/metrics`` from the lead rank
            (``trainer.report.metrics``; no TLS or token: keep the port internal).
        metrics_host, metrics_port: Where (port 0 picks a free one).
    """

    compare: bool = True
    json: str | None = None
    tensorboard_dir: str | None = None
    metrics: bool = False
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9466


@dataclass
class ParallelConfig:
    """``parallel.*``: the parallel sizes of a ``torchrun`` world
    (``trainer.sharding.Parallelism``'s fields).

    The data-parallel size is what the world leaves: world size / (tp x cp x pp). ``dp``, when
    set, must equal it (a check against launching the wrong number of processes).
    Every combination of sizes runs the RL step but context parallel, which needs
    TransformerEngine's attention (refused without it, naming it). ``first_stage_layers`` /
    ``last_stage_layers`` give the first and last pipeline stages that many decoder layers
    (megatron's uneven split, ``num_layers_in_first_pipeline_stage`` / ``..._last_...``);
    the rest divide evenly.
    """

    dp: int | None = None
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vp: int | None = None
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def sizes(self):
        """These sizes as the sharding functions take them (``Parallelism``)."""
        from trainer.sharding import Parallelism

        return Parallelism(
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            vp=self.vp,
            ep=self.ep,
            etp=self.etp,
            sequence_parallel=self.sequence_parallel,
        )


@dataclass
class TrainerConfig:
    """The whole trainer configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    route_cache: RouteCacheConfig = field(default_factory=RouteCacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    push: PushConfig = field(default_factory=PushConfig)
    data: DataConfig = field(default_factory=DataConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> None:
        replay = self.router_replay
        # Configurations built in code may hold plain strings: the same check as YAML's.
        for section, key, kind in (
            (replay, "missing_record", MissingRecord),
            (self.train, "padding_side", PaddingSide),
            (self.train, "dtype", Dtype),
            (self.data, "source", DataSource),
        ):
            name = next(k for k, v in vars(self).items() if v is section)
            setattr(section, key, _coerce(getattr(section, key), kind, f"{name}.{key}"))
        if replay.replay_file and replay.mode is not ReplayMode.R3:
            raise ConfigError(
                f"router_replay.replay_file replays rollout routes, which is mode R3; "
                f"mode is {replay.mode.value}"
            )
        if replay.mode is ReplayMode.R3 and not replay.replay_file and not self.route_cache.target:
            if not self.data.records_file:
                raise ConfigError("mode R3 needs route_cache.target or router_replay.replay_file")
        if self.model.aux_loss_coeff < 0:
            raise ConfigError("model.aux_loss_coeff must be >= 0")
        for key in ("steps", "batch_size", "ppo_epochs", "export_every", "checkpoint_every"):
            if getattr(self.train, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1")
        self._validate_batches()
        self._validate_feed()

    def _validate_batches(self) -> None:
        train, par = self.train, self.parallel
        if train.micro_batch_size < 1:
            raise ConfigError("train.micro_batch_size must be >= 1")
        mini = train.mini_batch_size_or_micro
        if mini < 1:
            raise ConfigError(f"train.mini_batch_size={mini} must be >= 1")
        budget = train.max_tokens_per_micro_batch
        if budget is not None and budget < 1:
            raise ConfigError("train.max_tokens_per_micro_batch must be >= 1")
        if budget is None and mini % train.micro_batch_size:
            raise ConfigError(
                f"train.micro_batch_size={train.micro_batch_size} must divide "
                f"train.mini_batch_size={mini}"
            )
        if par.vp is not None and par.pp < 2:
            raise ConfigError(f"parallel.vp={par.vp} needs pipeline stages (parallel.pp > 1)")
        if par.vp is not None and budget is None:
            per_step = mini // train.micro_batch_size
            if per_step % par.pp:
                # megatron's interleaved schedule runs micro-batches in groups of pp per chunk.
                raise ConfigError(
                    f"parallel.vp={par.vp}: megatron's interleaved schedule needs the "
                    f"micro-batches of an optimizer step to be a multiple of parallel.pp="
                    f"{par.pp}; train.mini_batch_size / train.micro_batch_size = {per_step}"
                )

    def _validate_feed(self) -> None:
        data = self.data
        if self.push.targets and not self.train.export_dir:
            raise ConfigError("push.targets needs train.export_dir (what is pushed)")
        if data.source is not DataSource.FEED:
            return
        if not self.route_cache.target:
            raise ConfigError("data.source=feed needs route_cache.target")
        if data.group_size < 1 or self.train.batch_size % data.group_size:
            raise ConfigError(
                f"data.group_size={data.group_size} must be >= 1 and divide "
                f"train.batch_size={self.train.batch_size} (batches of whole GRPO groups)"
            )


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """Check or convert ``value`` to the annotated type ``kind`` of ``key``."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        valid = [m.value for m in kind]
        if isinstance(value, kind):
            return value
        if value not in valid:
            raise ConfigError(f"{key}={value!r} is not one of {valid}")
        return kind(value)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(o for o in options if o is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string.
        try:
            return float(value)
        except ValueError:
            pass
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} must be of type {kind.__name__}")
    return value


def _apply(target: Any, values: dict[str, Any], prefix: str = "") -> None:
    hints = typing.get_type_hints(type(target))
    names = {f.name for f in dataclasses.fields(target)}
    for name, value in values.items():
        key = prefix + name
        if name not in names:
            raise ConfigError(f"unknown key {key!r}; valid keys here: {sorted(names)}")
        current = getattr(target, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section; got {value!r}")
            _apply(current, value, key + ".")
        else:
            setattr(target, name, _coerce(value, hints[name], key))


def _override(dotted: str) -> dict[str, Any]:
    import yaml

    key, sep, raw = dotted.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {dotted!r} must look like section.key=value")
    value: Any = yaml.safe_load(raw) if raw else ""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Build and validate the configuration.

    Args:
        path: A YAML file of nested sections (None: defaults only).
        overrides: ``section.key=value`` strings applied after the file, in order.

    Returns:
        The validated ``TrainerConfig``.

    Raises:
        ConfigError: An unknown key, a value of the wrong type, an unknown mode name, or a
            combination that cannot run.
    """
    import yaml

    config = TrainerConfig()
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        _apply(config, data)
    for dotted in overrides:
        _apply(config, _override(dotted))
    config.validate()
    return config
