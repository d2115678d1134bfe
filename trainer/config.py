"""The job config the trainer is handed (docs/contracts.md, "Job config"), as frozen dataclasses.

`load_job_config(path)` reads the JSON, checks every field once (type, range, cross-field rules)
and returns a `JobConfig`; anything wrong raises `ConfigError` (exit code 78) whose message names
the field path, the value given and what was expected. Unknown keys are rejected, so a renamed
field in the operator cannot be silently ignored here. The typed field reads themselves are
trainforge.trainer.config_fields.

Two keys are optional so that job configs written before them still load: ``optim.lr_schedule``
(default "cosine") and the ``framework`` section (every field optional, defaults in
`FrameworkConfig`). Also optional: ``model.config_overrides`` (further LlamaConfig keys) and the
``init`` section (weights to start from, `InitConfig`). Whether a value can run on this machine (a CUDA-only feature on a CPU, say)
is not checked here: the validator and exporter parse the same config on other machines.

The one rule that needs the world size, ``global_batch_size % (micro_batch_size * world) == 0``,
is checked by `JobConfig.grad_accum_steps(world_size)` once the process group is up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainforge.contract import COMPILE_FALLBACKS, DIGEST_EXCLUDED, JOB_FORMAT, RETRY_SECTION, attention_errors
from trainforge.trainer.config_fields import Section, scalar_overrides, show
from trainforge.trainer.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
LR_SCHEDULES = ("cosine", "linear", "constant")
PARALLELISMS = ("ddp", "fsdp")
GRADIENT_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
BACKENDS = ("auto", "gloo", "nccl")
# distributed.world_size_change: a resume on another world size goes on (and is recorded in the
# checkpoint's world_size_history) or is refused with ConfigError (exit 78).
WORLD_SIZE_CHANGES = ("continue", "refuse")
FAMILIES = ("llama",)
#: ``model.family`` of a job whose architecture comes from a pretrained folder's config.json.
PRETRAINED_FAMILY = "pretrained"


@dataclass(frozen=True)
class Identity:
    dag_id: str
    run_id: str
    task_id: str
    try_number: int


@dataclass(frozen=True)
class DataConfig:
    dataset_dir: str  # absolute path of a prepared dataset folder, or its s3://bucket/prefix/<digest> URI
    sequence_length: int  # tokens per training sequence
    packing: bool = False  # examples datasets: several examples per sequence (trainforge.trainer.packing)


@dataclass(frozen=True)
class ModelConfig:
    """The model section. With ``family == "pretrained"`` only ``dropout`` (None: the checkpoint's)
    and ``config_overrides`` are set: the architecture is the pretrained folder's config.json."""

    family: str
    hidden_size: int | None
    num_layers: int | None
    num_heads: int | None
    num_kv_heads: int | None
    intermediate_size: int | None
    rope_theta: float | None
    dropout: float | None  # attention dropout probability, [0, 1)
    tie_word_embeddings: bool | None
    # further config keys (spec model.config_overrides); checked by trainforge.trainer.model.llama_config,
    # or for a pretrained model by trainforge.trainer.pretrained (contract.PRETRAINED_OVERRIDABLE)
    config_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PretrainedSource:
    """Open weights to start from: a Hugging Face model folder (docs/model.md, "Open weights")."""

    folder: str  # absolute folder or s3:// prefix: config.json, *.safetensors (+ index), tokenizer files
    source: str  # the spec's URI: a folder, s3://, models:/..., hf://org/name[@revision]
    revision: str | None  # what the source resolved to: a Hub commit, models:/<name>/<version>, or None


@dataclass(frozen=True)
class InitConfig:
    """Start from existing weights (fresh optimizer) when the run has no checkpoint of its own."""

    checkpoint: str  # absolute folder or s3:// prefix: a step-XXXXXXXX/ checkpoint or an HF model folder
    source: str  # where it came from: "models:/<name>/<version>" or "stage:<name>"


@dataclass(frozen=True)
class OptimConfig:
    max_steps: int  # optimizer steps
    global_batch_size: int  # sequences per optimizer step, all ranks together
    micro_batch_size: int  # sequences per forward pass on one rank
    learning_rate: float  # peak learning rate, reached at the end of warm-up
    min_learning_rate: float  # where the cosine or linear decay ends (unused by "constant")
    warmup_steps: int
    weight_decay: float  # AdamW decoupled weight decay, applied to 2-D+ parameters only
    beta1: float
    beta2: float
    grad_clip: float  # max global L2 norm of the gradients; 0 disables clipping
    seed: int
    lr_schedule: str = "cosine"  # decay after warm-up: "cosine" | "linear" | "constant"


@dataclass(frozen=True)
class FrameworkConfig:
    """How the model is spread over the ranks; defaults are what a job config without it means."""

    parallelism: str = "ddp"  # "ddp" (replicated) | "fsdp" (FSDP2 fully_shard per decoder layer + root)
    gradient_compression: str = "none"  # DDP communication hook: "none" | "fp16" | "bf16" | "powersgd"
    powersgd_rank: int = 1  # PowerSGD matrix_approximation_rank
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward pass
    compile: str | bool = "auto"  # torch.compile each decoder layer: "auto" | True | False
    compile_fallback: str = "error"  # Dynamo's recompile or cache-size limit hit: "error" | "warn"

    def compile_on(self, device_type: str) -> bool:
        """Whether to torch.compile the decoder layers when training on ``device_type``.

        ``compile`` itself when it is true or false; for ``"auto"``, on for ``"cuda"`` and off
        for anything else (``"cpu"``, ...). Pure: whether torch.compile works here is not checked.

        Args:
            device_type: ``torch.device.type`` of the training device, e.g. ``"cuda"`` or ``"cpu"``.
        """
        if self.compile == "auto":
            return device_type == "cuda"
        return bool(self.compile)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str  # absolute path or s3://bucket/prefix; step-XXXXXXXX/ folders are written below it
    interval_steps: int
    keep_last: int
    max_host_bytes: int | None = None  # what checkpoint staging may use (None: what the host has)


@dataclass(frozen=True)
class LoggingConfig:
    log_every_steps: int


@dataclass(frozen=True)
class DistributedConfig:
    backend: str  # "auto" | "gloo" | "nccl"
    collective_timeout_s: float
    world_size_change: str = "continue"  # WORLD_SIZE_CHANGES; absent from the JSON: "continue"


@dataclass(frozen=True)
class LoraSettings:
    """The ``peft`` section (method ``lora``): trainforge.trainer.adapters applies it."""

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | None  # None: the family's attention and MLP projections
    merge: bool  # register merged full weights (True) or the adapter with a reference to its base


@dataclass(frozen=True)
class JobConfig:
    identity: Identity
    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    precision: str
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    distributed: DistributedConfig
    framework: FrameworkConfig
    raw: dict[str, Any]  # the JSON object as read, saved verbatim into each checkpoint's meta.json
    init: InitConfig | None = None  # optional "init" section: initial weights
    pretrained: PretrainedSource | None = None  # optional "pretrained" section: open weights
    peft: LoraSettings | None = None  # optional "peft" section: LoRA adapters on the pretrained weights

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step on each rank: global / (micro * world).

        Raises:
            ConfigError: when ``global_batch_size`` is not a multiple of
                ``micro_batch_size * world_size``.
        """
        per_pass = self.optim.micro_batch_size * world_size
        if world_size < 1 or self.optim.global_batch_size % per_pass != 0:
            raise ConfigError(
                f"optim.global_batch_size={self.optim.global_batch_size} must be a multiple of "
                f"optim.micro_batch_size ({self.optim.micro_batch_size}) x world size "
                f"({world_size}) = {per_pass}; change the batch sizes or the number of processes"
            )
        return self.optim.global_batch_size // per_pass

    def digest(self) -> str:
        """SHA-256 hex of the canonical JSON of the config without ``identity`` and ``retry``.

        ``identity`` (and so ``try_number``) and ``retry`` (a smaller micro-batch after an out of
        memory) are left out so every retry of one training run has the same digest.
        """
        body = {k: v for k, v in self.raw.items() if k not in DIGEST_EXCLUDED}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def parse_job_config(obj: Any) -> JobConfig:
    """Check a decoded job config object and build a `JobConfig`.

    Raises:
        ConfigError: on the first field that is missing, unknown, of the wrong type or out of
            range, or a cross-field rule that does not hold.
    """
    top = Section(obj, "")
    fmt = top._get("format")
    if fmt != JOB_FORMAT:
        raise ConfigError(f"format={fmt!r}: expected {JOB_FORMAT!r}")

    s = top.section("identity")
    identity = Identity(s.str("dag_id"), s.str("run_id"), s.str("task_id"), s.int("try_number", lo=1))
    s.done()

    s = top.section("data")
    data = DataConfig(s.location("dataset_dir"), s.int("sequence_length", lo=2, hi=1 << 20),
                      s.bool("packing", default=DataConfig.packing))
    s.done()

    s = top.section("model")
    pretrained_family = s.obj.get("family") == PRETRAINED_FAMILY if isinstance(s.obj, dict) else False
    if pretrained_family:
        model = ModelConfig(
            family=s.str("family", (PRETRAINED_FAMILY,)), hidden_size=None, num_layers=None, num_heads=None,
            num_kv_heads=None, intermediate_size=None, rope_theta=None, tie_word_embeddings=None,
            dropout=None if s.obj.get("dropout") is None else s.float("dropout", lo=0.0, hi=1.0, hi_open=True),
            config_overrides=scalar_overrides(s._get("config_overrides", {}), "model.config_overrides"),
        )
        s.used.add("dropout")  # null: the checkpoint's own dropout
        s.done()
    else:
        model = _scratch_model(s)
    s = top.section("optim")
    optim = OptimConfig(
        max_steps=s.int("max_steps", lo=1),
        global_batch_size=s.int("global_batch_size", lo=1),
        micro_batch_size=s.int("micro_batch_size", lo=1),
        learning_rate=s.float("learning_rate", lo=0.0, lo_open=True),
        min_learning_rate=s.float("min_learning_rate", lo=0.0),
        warmup_steps=s.int("warmup_steps", lo=0),
        weight_decay=s.float("weight_decay", lo=0.0),
        beta1=s.float("beta1", lo=0.0, hi=1.0, hi_open=True),
        beta2=s.float("beta2", lo=0.0, hi=1.0, hi_open=True),
        grad_clip=s.float("grad_clip", lo=0.0),
        seed=s.int("seed", lo=0, hi=2**63 - 1),
        lr_schedule=s.str("lr_schedule", LR_SCHEDULES, default=OptimConfig.lr_schedule),
    )
    s.done()
    if optim.min_learning_rate > optim.learning_rate:
        raise ConfigError(
            f"optim.min_learning_rate={optim.min_learning_rate} must be <= "
            f"optim.learning_rate={optim.learning_rate}"
        )
    if optim.warmup_steps > optim.max_steps:
        raise ConfigError(
            f"optim.warmup_steps={optim.warmup_steps} must be <= optim.max_steps={optim.max_steps}"
        )
    if optim.global_batch_size % optim.micro_batch_size != 0:
        raise ConfigError(
            f"optim.global_batch_size={optim.global_batch_size} must be a multiple of "
            f"optim.micro_batch_size={optim.micro_batch_size}"
        )
    if RETRY_SECTION in top.obj:  # a retry after an out of memory: a smaller micro-batch, the same global batch
        s = top.section(RETRY_SECTION)
        micro = s.int("micro_batch_size", lo=1)
        s.done()
        if optim.micro_batch_size % micro:
            raise ConfigError(f"retry.micro_batch_size={micro}: expected a divisor of optim.micro_batch_size="
                              f"{optim.micro_batch_size} (a retry trains at a smaller micro-batch)")
        optim = replace(optim, micro_batch_size=micro)

    precision = top.str("precision", PRECISIONS)
    if precision == "fp8" and optim.micro_batch_size * data.sequence_length % 16:  # float8 matmul dims
        raise ConfigError(f"precision 'fp8' needs micro-batch tokens divisible by 16 (got optim.micro_batch_size="
                          f"{optim.micro_batch_size} x data.sequence_length={data.sequence_length})")

    s = top.section("framework", optional=True)
    framework = FrameworkConfig(
        parallelism=s.str("parallelism", PARALLELISMS, default=FrameworkConfig.parallelism),
        gradient_compression=s.str("gradient_compression", GRADIENT_COMPRESSIONS,
                                   default=FrameworkConfig.gradient_compression),
        powersgd_rank=s.int("powersgd_rank", lo=1, default=FrameworkConfig.powersgd_rank),
        activation_checkpointing=s.bool("activation_checkpointing", default=FrameworkConfig.activation_checkpointing),
        compile=s.auto_or_bool("compile", default=FrameworkConfig.compile),
        compile_fallback=s.str("compile_fallback", COMPILE_FALLBACKS, default=FrameworkConfig.compile_fallback),
    )
    s.done()
    if framework.parallelism != "ddp" and framework.gradient_compression != "none":
        raise ConfigError(
            f"framework.gradient_compression={framework.gradient_compression!r} is a DDP communication "
            f"hook and does not apply to framework.parallelism={framework.parallelism!r}: expected 'none' "
            f"with {framework.parallelism!r}, or parallelism 'ddp'")

    s = top.section("checkpoint")
    checkpoint = CheckpointConfig(s.location("dir"), s.int("interval_steps", lo=1), s.int("keep_last", lo=1),
                                  s.optional_int("max_host_bytes", lo=0))
    s.done()

    s = top.section("logging")
    logging_cfg = LoggingConfig(s.int("log_every_steps", lo=1))
    s.done()

    s = top.section("distributed")
    distributed = DistributedConfig(
        s.str("backend", BACKENDS), s.float("collective_timeout_s", lo=0.0, lo_open=True),
        s.str("world_size_change", WORLD_SIZE_CHANGES, default=DistributedConfig.world_size_change),
    )
    s.done()
    init = None
    if "init" in top.obj:
        s = top.section("init")
        init = InitConfig(s.location("checkpoint"), s.str("source"))
        s.done()
    pretrained = None
    if "pretrained" in top.obj:
        s = top.section("pretrained")
        revision = s._get("revision", None)
        if revision is not None and (not isinstance(revision, str) or not revision):
            raise ConfigError(f"pretrained.revision={revision!r}: expected null or a non-empty string")
        pretrained = PretrainedSource(s.location("folder"), s.str("source"), revision)
        s.done()
    if (pretrained is not None) != (model.family == PRETRAINED_FAMILY):
        raise ConfigError(f"model.family={model.family!r} with{'' if pretrained else 'out'} a pretrained section: "
                          f"expected family {PRETRAINED_FAMILY!r} exactly when the job config has one")
    if pretrained is not None and init is not None:
        raise ConfigError("init and pretrained sections together: expected at most one (pretrained weights are "
                          "the initial weights)")
    peft = _peft(top.section("peft")) if "peft" in top.obj else None
    if peft is not None and pretrained is None:
        raise ConfigError("a peft section without a pretrained one: expected LoRA adapters only on pretrained "
                          "weights (model.pretrained)")
    top.done()
    return JobConfig(identity, data, model, optim, precision, checkpoint, logging_cfg, distributed, framework, obj,
                     init=init, pretrained=pretrained, peft=peft)


def _peft(s: Section) -> LoraSettings:
    """The ``peft`` section: LoRA's rank, alpha, dropout, target modules (``auto`` or names), merge."""
    s.str("method", ("lora",))
    targets = s._get("target_modules", "auto")
    if targets != "auto" and (not isinstance(targets, list) or not targets
                              or not all(isinstance(t, str) and t for t in targets)):
        raise ConfigError(f"peft.target_modules={show(targets)}: expected 'auto' or a non-empty list of module names")
    settings = LoraSettings(r=s.int("r", lo=1), alpha=s.float("alpha", lo=0.0, lo_open=True),
                            dropout=s.float("dropout", lo=0.0, hi=1.0, hi_open=True),
                            target_modules=None if targets == "auto" else tuple(targets), merge=s.bool("merge"))
    s.done()
    return settings


def _scratch_model(s: Section) -> ModelConfig:
    """The model section of a model built from the spec's fields (a Llama from random weights)."""
    model = ModelConfig(
        family=s.str("family", FAMILIES),
        hidden_size=s.int("hidden_size", lo=1),
        num_layers=s.int("num_layers", lo=1),
        num_heads=s.int("num_heads", lo=1),
        num_kv_heads=s.int("num_kv_heads", lo=1),
        intermediate_size=s.int("intermediate_size", lo=1),
        rope_theta=s.float("rope_theta", lo=0.0, lo_open=True),
        dropout=s.float("dropout", lo=0.0, hi=1.0, hi_open=True),
        tie_word_embeddings=s.bool("tie_word_embeddings"),
        config_overrides=scalar_overrides(s._get("config_overrides", {}), "model.config_overrides"),
    )
    s.done()
    errors = attention_errors(model.hidden_size, model.num_heads, model.num_kv_heads)
    if errors:
        raise ConfigError("; ".join(f"model.{message}" for _, message in errors))
    return model


def load_job_config(path: str | Path) -> JobConfig:
    """Read and check the job config JSON file at ``path``.

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or any field is invalid.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"job config {path}: cannot read ({err.strerror or err})") from err
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"job config {path}: not valid JSON ({err})") from err
    try:
        return parse_job_config(obj)
    except ConfigError as err:
        raise ConfigError(f"job config {path}: {err}") from None
