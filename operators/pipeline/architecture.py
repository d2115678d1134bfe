"""The spec's ``model`` section: the Llama architecture to train, the registered model to
continue from, or the open pretrained weights (``pretrained``) to start from."""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from trainforge.contract import PRETRAINED_OVERRIDABLE, S3_URI, attention_errors
from trainforge.pipeline.data import _MODELS, _SCHEME
from trainforge.pipeline.engines import needs_s3
from trainforge.pipeline.llama_keys import FIRST_CLASS, FIRST_CLASS_ALIASES, OVERRIDABLE
from trainforge.pipeline.stage_checks import rewrap
from trainforge.sections import SpecModel, field_errors


def _json_type(value: object) -> str:
    """The JSON type name of a scalar: null, bool, int, float or str."""
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str"}[type(value)]


#: ``hf://<org>/<name>[@<revision>]``: a Hugging Face Hub model, at a branch, tag or commit.
HF_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._\-]*/"
                    r"[A-Za-z0-9][A-Za-z0-9._\-]{0,95})"
                    r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/\-]*))?$")
#: The forms of ``model.pretrained``, as error messages list them.
PRETRAINED_FORMS = ("a local folder (absolute, or relative to TRAINFORGE_HOME), "
                    "'s3://bucket/prefix/', 'models:/<name>@<alias>', 'models:/<name>/<version>' "
                    "or 'hf://<org>/<name>[@<revision>]'")
#: The fields that describe the architecture; with ``pretrained`` its config.json does.
ARCHITECTURE_FIELDS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                       "intermediate_size", "rope_theta", "tie_word_embeddings")


def check_pretrained(value: str) -> str:
    """``model.pretrained`` in one of :data:`PRETRAINED_FORMS`; ValueError naming it otherwise."""
    expected = f"expected {PRETRAINED_FORMS}"
    if not value.strip():
        raise ValueError(f"model.pretrained may not be empty (got {value!r}; {expected})")
    if value.startswith("hf:"):
        match = HF_URI.match(value)
        if not match or "--" in match["repo"] or ".." in match["repo"]:
            raise ValueError(f"not a Hugging Face model URI (got {value!r}; expected "
                             f"'hf://<org>/<name>' or 'hf://<org>/<name>@<revision>', e.g. "
                             f"'hf://Qwen/Qwen3-0.6B')")
    elif value.startswith("models:"):
        if not _MODELS.match(value):
            raise ValueError(f"not a registered model URI (got {value!r}; expected "
                             f"'models:/<name>@<alias>' or 'models:/<name>/<version>')")
    elif value.startswith("s3:"):
        if not S3_URI.match(value):
            raise ValueError(f"not an s3://bucket/prefix URI (got {value!r}; expected s3:// "
                             f"followed by a bucket name of 3-63 lower-case letters, digits, '.' "
                             f"or '-', then the folder holding config.json)")
    elif _SCHEME.match(value):
        raise ValueError(f"not a pretrained model source trainforge reads (got {value!r}; "
                         f"{expected})")
    return value


class ModelSection(SpecModel):
    pretrained: str | None = Field(
        None, description="Start from open pretrained weights (docs/model.md, \"Open weights\"): "
        + PRETRAINED_FORMS + " (the Hub through the deployment's HF_HOME cache; HF_HUB_OFFLINE=1 "
        "honoured). The folder's config.json gives the architecture and its tokenizer.json the "
        "tokenizer, so the architecture fields below, init_from and data.tokenizer.source must "
        "be unset; dropout and config_overrides' " + ", ".join(sorted(PRETRAINED_OVERRIDABLE))
        + " may be set. null: build the architecture below.",
    )
    family: Literal["llama"] = Field("llama", description="Architecture family (transformers).")
    hidden_size: int = Field(256, ge=8, le=65_536, description="Model width d_model.")
    num_layers: int = Field(4, ge=1, le=512, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, le=1024, description="Attention heads.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); default num_heads."
    )
    intermediate_size: int | None = Field(
        None, ge=8, description="MLP width; default 8/3 x hidden_size rounded up to 64 (Llama)."
    )
    rope_theta: float = Field(10_000.0, gt=0, description="RoPE base.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Attention dropout probability.")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings.")
    config_overrides: dict[str, bool | int | float | str | None] = Field(
        {}, description="Further transformers LlamaConfig keys, e.g. {rms_norm_eps: 1e-5, "
        "attention_bias: true}: " + ", ".join(sorted(OVERRIDABLE)) + ". Keys set by the fields "
        "above (hidden_size, rope_theta, ...) or by the dataset (vocab_size) are refused. With "
        "pretrained, only " + ", ".join(sorted(PRETRAINED_OVERRIDABLE)) + " (numbers in [0, 1)).",
        json_schema_extra={"propertyNames": {"enum": sorted({*OVERRIDABLE,
                                                             *PRETRAINED_OVERRIDABLE})}},
    )
    init_from: str | None = Field(
        None, description="Continue training a registered model: 'models:/<name>@<alias>' or "
        "'models:/<name>/<version>'. Its weights start the run (a fresh optimizer); the fields "
        "above must describe its architecture, and data.tokenizer.source must be the same URI "
        "(its tokenizer). A checkpoint of the run's own takes precedence on a retry. null: "
        "random initialisation."
    )

    @field_validator("init_from")
    @classmethod
    def _registered_model(cls, value: str | None) -> str | None:
        if value is not None and not _MODELS.match(value):
            raise ValueError(f"not a registered model URI (got {value!r}; expected "
                             f"'models:/<name>@<alias>' or 'models:/<name>/<version>')")
        return value

    @field_validator("pretrained")
    @classmethod
    def _pretrained_form(cls, value: str | None) -> str | None:
        return value if value is None else check_pretrained(value)

    @field_validator("config_overrides")
    @classmethod
    def _known_config_keys(cls, value: dict, info: ValidationInfo) -> dict:
        if info.data.get("pretrained") is not None:
            return cls._pretrained_overrides(value, info.data["pretrained"])
        errors = []
        for key, given in value.items():
            if key in FIRST_CLASS or key in FIRST_CLASS_ALIASES:
                source = FIRST_CLASS.get(key) or FIRST_CLASS_ALIASES[key]
                errors.append(((key,), f"{key} is set by {source}, not by an override (got "
                               f"{given!r}; expected it there)", given, ()))
            elif key not in OVERRIDABLE:
                close = difflib.get_close_matches(key, list(OVERRIDABLE), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else (
                    "expected one of: " + ", ".join(sorted(OVERRIDABLE)))
                errors.append(((key,), f"not a LlamaConfig key trainforge lets you set (got "
                               f"{key!r}; {hint})", key, ()))
            elif _json_type(given) not in OVERRIDABLE[key] and not (
                    _json_type(given) == "int" and "float" in OVERRIDABLE[key]):
                errors.append(((key,), f"wrong type for {key} (got {given!r}; expected "
                               f"{' or '.join(OVERRIDABLE[key])})", given, ()))
        if errors:
            raise field_errors(ModelSection, *errors)
        return value

    @classmethod
    def _pretrained_overrides(cls, value: dict, pretrained: str) -> dict:
        # The checkpoint's config.json fixes the architecture: only its dropouts may change.
        errors = []
        allowed = ", ".join(sorted(PRETRAINED_OVERRIDABLE))
        for key, given in value.items():
            if key not in PRETRAINED_OVERRIDABLE:
                errors.append(((key,), f"{key} comes from the pretrained model's config.json "
                               f"(got {key!r} with model.pretrained {pretrained!r}; expected one "
                               f"of: {allowed})", key, ()))
            elif (isinstance(given, bool) or not isinstance(given, (int, float))
                  or not 0 <= given < 1):
                errors.append(((key,), f"{key} is a dropout probability (got {given!r}; "
                               f"expected a number >= 0 and < 1)", given, ()))
        if errors:
            raise field_errors(ModelSection, *errors)
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _pretrained_sets_architecture(cls, data: Any, handler: Any) -> ModelSection:
        # On the section as written, so that these errors show up next to any other of its
        # errors (pydantic skips "after" rules when a field is invalid).
        try:
            section = handler(data)
        except ValidationError as err:
            failed = {tuple(e["loc"][:1]) for e in err.errors()}
            extra = [e for e in _pretrained_rules(data) if e[0][:1] not in failed]
            if not extra:
                raise
            raise ValidationError.from_exception_data(cls.__name__, rewrap(
                [*err.errors(), *field_errors(cls, *extra).errors()], ())) from None
        errors = _pretrained_rules(data)
        if errors:
            raise field_errors(cls, *errors)
        return section

    @model_serializer(mode="wrap")
    def _as_written(self, handler: Any) -> dict[str, Any]:
        # With pretrained, unset fields stay out of a dump: the spec crosses Airflow as JSON and
        # is validated again, where a dumped default would count as set (and be refused).
        data = handler(self)
        if self.pretrained is None:
            return data
        return {k: v for k, v in data.items() if k in self.model_fields_set}

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        kv = self.num_kv_heads or self.num_heads
        given = {"num_heads": (self.num_heads, ("hidden_size",)), "num_kv_heads": (kv, ("num_heads",))}
        errors = [((field,), message, *given[field])
                  for field, message in attention_errors(self.hidden_size, self.num_heads, kv)]
        if errors:
            raise field_errors(ModelSection, *errors)
        return self

    @property
    def resolved_intermediate_size(self) -> int:
        """MLP width; Llama's default is 8/3 x d_model rounded up to a multiple of 64."""
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64


def _pretrained_rules(data: Any) -> list[tuple]:
    """What ``model.pretrained`` forbids in the section ``data`` as written (a mapping; an
    already validated section has passed): the architecture fields, init_from, and dropout
    given twice. Nothing when pretrained is unset or invalid (its own error says so)."""
    if not isinstance(data, dict) or not isinstance(data.get("pretrained"), str):
        return []
    uri = data["pretrained"]
    try:
        check_pretrained(uri)
    except ValueError:
        return []
    given = f"with model.pretrained {uri!r}"
    errors = [((name,), f"{name} comes from the pretrained model's config.json (got {name} "
               f"{data[name]!r} {given}; expected it unset)", data[name], ("pretrained",))
              for name in ARCHITECTURE_FIELDS if name in data]
    if data.get("init_from") is not None:
        errors.append((("init_from",), f"init_from and pretrained both name the starting weights "
                       f"(got init_from {data['init_from']!r} {given}; expected only pretrained, "
                       f"which takes a registered model too: pretrained: {data['init_from']!r})",
                       data["init_from"], ()))
    overrides = data.get("config_overrides")
    if "dropout" in data and isinstance(overrides, dict) and "attention_dropout" in overrides:
        errors.append((("config_overrides", "attention_dropout"), f"attention_dropout is set by "
                       f"model.dropout (got both, {data['dropout']!r} and "
                       f"{overrides['attention_dropout']!r}; expected one of them)",
                       overrides["attention_dropout"], ()))
    return errors


def fine_tuning_errors(model: ModelSection, data_format: str, peft: bool = False,
                       unmerged: bool = False) -> list[tuple]:
    """Conversations are rendered with a pretrained model's tokenizer: ``data.format`` chat or
    prompt_completion needs ``model.pretrained``; so do LoRA adapters (``training.peft``). An
    adapter registered alone (``unmerged``: ``training.peft.merge: false``) refers to its base by
    a local folder, which an ``s3://`` base is not."""
    errors = []
    if data_format in ("chat", "prompt_completion") and model.pretrained is None:
        errors.append((("data", "format"), f"format {data_format!r} fine-tunes a pretrained model, whose "
                       "tokenizer and chat template render the conversations (got no model.pretrained; expected "
                       "e.g. model.pretrained: 'models:/my-model@champion' or a Hugging Face model folder)",
                       data_format, ("model", "pretrained")))
    if peft and model.pretrained is None:
        errors.append((("training", "peft"), "LoRA adapters train on pretrained weights (got no "
                       "model.pretrained; expected e.g. model.pretrained: 'models:/my-model@champion', or no "
                       "training.peft to train every weight)", "lora", ("model", "pretrained")))
    if unmerged and str(model.pretrained or "").startswith("s3://"):
        errors.append((("training", "peft", "merge"), f"merge: false registers the adapter with a reference "
                       f"to its base model's local folder, and model.pretrained {model.pretrained!r} is on S3 "
                       "(expected merge: true, or a local folder or hf:// model)", False, ("model", "pretrained")))
    return errors


def pretrained_errors(model: ModelSection, tokenizer_source: str | None,
                      engine: str, stages: int = 0) -> list[tuple]:
    """The spec-wide rules of ``model.pretrained`` (:func:`field_errors` entries, locations from
    the spec's root): the model's own tokenizer is used, an engine whose ranks do not see this
    machine's disk needs the weights on S3, and ``stages`` (their number) are not built for it."""
    uri = model.pretrained
    if uri is None:
        return []
    errors = []
    if tokenizer_source is not None:
        errors.append((("data", "tokenizer", "source"), f"model.pretrained {uri!r} brings its own "
                       f"tokenizer, which the data is encoded with (got data.tokenizer.source "
                       f"{tokenizer_source!r}; expected it unset)", tokenizer_source,
                       ("model", "pretrained")))
    if stages:
        errors.append((("stages",), f"model.pretrained {uri!r} with stages is not supported yet: a "
                       f"later stage cannot start from an earlier stage's checkpoint of open weights "
                       f"(got {stages} stages; expected none: fine-tune in one training section)",
                       stages, ("model", "pretrained")))
    if needs_s3(engine) and not uri.startswith(("s3://", "models:/")):
        errors.append((("model", "pretrained"), f"model.pretrained must be on S3 with the "
                       f"{engine} engine, whose ranks cannot read this machine's disk or "
                       f"Hugging Face cache (got {uri!r}; expected an 's3://bucket/prefix/' copy "
                       f"of the folder, or a models:/ version in an S3 artifact store)", uri,
                       ("training", "engine")))
    return errors
