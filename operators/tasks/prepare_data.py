"""The ``prepare_data`` task: stream, clean, split, tokenise and shard the corpus; log lineage.

The work itself is :func:`trainforge.data.prepare.prepare_dataset` (no Airflow, no MLflow); this
operator

1. maps the spec onto its settings, resolving a ``models:/name@alias`` tokenizer source to the
   registered model version's ``tokenizer.json`` (downloaded once per version into
   ``TRAINFORGE_HOME/staging/tokenizers/``); with ``model.pretrained``, resolves the model once
   (``trainforge.model_source``) and encodes with its folder's tokenizer.json and EOS
   (``trainforge.data.model_tokenizer``);
2. runs it; an ``s3://`` output is staged in ``TRAINFORGE_HOME/staging/datasets/`` so that the
   local trainer has a ``dataset_dir`` to read;
3. records the dataset in the DAG run's MLflow run: an input (digest, dataset URI, source
   patterns, document and token counts, what each cleaning rule removed), params, metrics, and
   the manifest as an artifact;
4. sets the extra of the task's asset event (the dataset root, declared as the outlet by
   :func:`dataset_asset` when the DAG is built): digest, dataset URI, token counts, reused.

XCom: :meth:`PreparedDataset.summary` (``dataset_dir``, ``dataset_uri``, ``digest``, ``reused``,
counts, timings) plus ``mlflow_run_id``, ``tokenizer_source`` and, with ``model.pretrained``,
``pretrained`` (the job config's section: folder, source, revision), which the train task uses
so that the model cannot move between the tasks. Re-running on the same inputs reuses the
finished dataset and says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from airflow.sdk import Asset

from trainforge.base import TrainforgeStageOperator, fail_permanently
from trainforge.contract import EXIT_CONFIG
from trainforge.storage.s3 import make_client
from trainforge.data.errors import DataPrepError, TokenizerSourceError
from trainforge.data.model_tokenizer import ModelEos, load_model_eos
from trainforge.data.settings import EXAMPLE_FORMATS, PrepareSettings
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.s3 import S3ConnectionError, S3Hook
from trainforge.paths import resolve, safe_segment, trainforge_home
from trainforge.pipeline.spec import PipelineSpec
#: Folders searched below a model version's artifact root for ``tokenizer.json``.
_TOKENIZER_SEARCH_DEPTH = 4
#: MLflow input-tag values are at most 500 characters.
_TAG_VALUE_MAX = 500


def dataset_root_uri(spec: PipelineSpec) -> str:
    """The dataset root as a URI: ``s3://bucket/prefix`` or ``file:///abs/datasets``."""
    root = resolve(spec.data.output_uri)
    return root.rstrip("/") if root.startswith("s3://") else Path(root).as_uri()


def dataset_asset(spec: PipelineSpec):
    """The Airflow asset the ``prepare_data`` task updates: the spec's dataset root (pipelines
    sharing a root share the asset; each event's extra names the dataset digest)."""
    return Asset(uri=dataset_root_uri(spec))


def staging_root(output_uri: str) -> Path:
    """Local copy of an ``s3://bucket/prefix`` dataset root: staging/datasets/bucket/prefix."""
    return trainforge_home() / "staging" / "datasets" / output_uri[len("s3://"):].strip("/")


def prepare_settings(spec: PipelineSpec, tokenizer_uri: str | None = None, *,
                     model_eos: ModelEos | None = None):
    """The data-prep settings of a spec (paths resolved against TRAINFORGE_HOME).

    ``tokenizer_uri`` replaces ``data.tokenizer.source`` (a downloaded ``models:/`` tokenizer);
    ``model_eos``: a pretrained model's tokenizer and EOS (``data.tokenizer.vocab_size`` is
    then not used: the tokenizer's ids set the size).
    """
    data = spec.data
    source = tokenizer_uri or data.tokenizer.source
    values: dict[str, Any] = dict(
        sources=tuple(resolve(s) for s in data.sources),
        format=data.format,
        compression=data.compression,
        text_field=data.text_field,
        on_malformed=data.on_malformed,
        strip_gutenberg_boilerplate=data.cleaning.strip_gutenberg_boilerplate,
        normalize_whitespace=data.cleaning.normalize_whitespace,
        unicode_normalization=data.cleaning.unicode_normalization,
        min_document_chars=data.cleaning.min_document_chars,
        max_document_chars=data.cleaning.max_document_chars,
        deduplicate=data.cleaning.deduplicate,
        vocab_size=data.tokenizer.vocab_size,
        tokenizer_uri=_tokenizer_location(source),
        validation_fraction=data.validation_fraction,
        shard_tokens=data.shard_tokens,
        encode_workers=data.encode_workers,
        memory_budget_mib=data.memory_budget_mib,
        s3_endpoint_url=spec.s3_endpoint_url,
    )
    if model_eos is not None:
        values.update(tokenizer_uri=model_eos.tokenizer_uri, eos_token=model_eos.eos_token,
                      eos_ids=model_eos.eos_ids, vocab_size=None)
    if data.format in EXAMPLE_FORMATS:
        values.update(messages_field=data.messages_field, prompt_field=data.prompt_field,
                      completion_field=data.completion_field, sequence_length=data.sequence_length,
                      over_length=data.over_length, chat_template=_chat_template(data.chat_template))
    return PrepareSettings(**values)


def _chat_template(path: str | None) -> str | None:
    """The text of ``data.chat_template`` (resolved against TRAINFORGE_HOME).

    Raises:
        AirflowFailException: the file cannot be read (permanent; names the field and path).
    """
    if path is None:
        return None
    location = resolve(path)
    try:
        return Path(location).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        shown = repr(path) if location == path else f"{path!r} ({location})"
        fail_permanently(f"data.chat_template {shown} cannot be read: {getattr(err, 'strerror', None) or err}; "
                         "expected a UTF-8 Jinja chat template file")
        raise  # unreachable


def connection_s3_client(spec: PipelineSpec) -> Any:
    """The data step's S3 client with the keys of Airflow connection ``storage.aws_conn_id``
    (trainforge.hooks.s3), or None without one (the data step then makes its own client on
    boto3's standard chain and the spec's endpoint).

    Raises:
        AirflowFailException: the connection cannot be used (missing, wrong type, incomplete,
            or its endpoint differs from the spec's); the message names the connection id.
    """
    if spec.storage.aws_conn_id is None:
        return None
    hook = S3Hook.for_spec(spec)
    try:
        return make_client(hook.endpoint_url, session=hook.session())
    except S3ConnectionError as err:
        fail_permanently(f"data preparation for {spec.dag_id}: {err}")
        raise  # unreachable


def _tokenizer_location(source: str | None) -> str | None:
    """A tokenizer source as the data library takes it: paths resolved, URIs as they are."""
    if source is None or source.startswith("models:/"):
        return source  # a models:/ URI is downloaded by the operator first
    return resolve(source)


def resolve_pretrained_model(spec: PipelineSpec, hook: MlflowHook, s3_client: Any = None
                             ) -> tuple[Any, ModelEos]:
    """Resolve ``model.pretrained`` once and read its tokenizer and EOS.

    Returns:
        (``trainforge.model_source.ResolvedModel``, the folder's :class:`ModelEos`).

    Raises:
        AirflowFailException: the URI does not resolve, or the folder's tokenizer files cannot
            be read or declare no usable EOS (permanent: the message names the URI and file).
    """
    from trainforge.model_source import PretrainedSourceError, resolve_pretrained

    uri = spec.model.pretrained
    try:
        resolved = resolve_pretrained(uri, engine=spec.training.engine, home=trainforge_home(),
                                      mlflow_hook=hook, s3_client=s3_client)
    except PretrainedSourceError as err:
        fail_permanently(f"data preparation for {spec.dag_id}: {err}")  # err names model.pretrained
        raise  # unreachable
    client = s3_client
    if client is None and resolved.folder.startswith("s3://"):
        client = make_client(spec.s3_endpoint_url)
    try:
        return resolved, load_model_eos(resolved.folder, client)
    except DataPrepError as err:
        fail_permanently(f"data preparation for {spec.dag_id}: the tokenizer of model.pretrained "
                         f"{uri!r} (folder {resolved.folder}): {err}")
        raise  # unreachable


def check_pretrained_folder(spec: PipelineSpec, resolved: Any, timeout_s: float = 600.0) -> None:
    """Refuse a model folder the trainer could not load before any job is launched: the trainer's
    own checks (config.json, the shards' headers against it) in a child process. An ``s3://``
    folder is left to the trainer (checking it here would download the whole model).

    Raises:
        AirflowFailException: the folder cannot build or fill its model (permanent; the message
            names the file and the tensor or field).
        RuntimeError: the check itself crashed (a retry may get past it).
    """
    if resolved.folder.startswith("s3://"):
        return
    proc = subprocess.run([sys.executable, "-m", "trainforge.trainer.pretrained", "--check", resolved.folder],
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if proc.returncode == EXIT_CONFIG:
        reason = (proc.stderr.strip().splitlines() or ["no reason given"])[-1]
        fail_permanently(f"data preparation for {spec.dag_id}: model.pretrained {resolved.source}: {reason}")
    if proc.returncode != 0:
        raise RuntimeError(f"checking model.pretrained {resolved.source} exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")


def pretrained_lineage(resolved: Any) -> str:
    """The ``data.tokenizer_source`` of a pretrained model: its URI, and what it resolved to."""
    if resolved.revision and resolved.revision != resolved.source:
        return f"{resolved.source} (revision {resolved.revision})"
    return resolved.source


def fetch_registered_tokenizer(hook: MlflowHook, uri: str, dest_root: Path) -> tuple[Path, str]:
    """Download the ``tokenizer.json`` of registered model version ``uri`` through ``hook``.

    ``uri`` is ``models:/<name>@<alias>`` or ``models:/<name>/<version>``. The artifacts of the
    version (its logged model, or the run path it was registered from) are searched breadth
    first, :data:`_TOKENIZER_SEARCH_DEPTH` folders deep; the shallowest ``tokenizer.json``
    wins. Versions are immutable, so a version already downloaded is not fetched again.

    Returns:
        (local path of tokenizer.json, ``"models:/<name>/<version>"`` it came from).

    Raises:
        TokenizerSourceError: no such model version, or no tokenizer.json in its artifacts.
        MlflowRequestError: the server or the artifact store failed a call.
    """
    from trainforge.model_source import PretrainedSourceError, registered_version

    try:  # the registry lookup every models:/ source shares (trainforge.model_source)
        name, version, resolved = registered_version(hook, uri, field="data.tokenizer.source")
    except PretrainedSourceError as err:
        raise TokenizerSourceError(uri, err.reason) from err
    dest = dest_root / safe_segment(name) / str(version.version)
    if (dest / "tokenizer.json").is_file():
        return dest / "tokenizer.json", resolved
    files = hook.model_version_files(version)
    found = files.find("tokenizer.json", _TOKENIZER_SEARCH_DEPTH)
    if found is None:
        raise TokenizerSourceError(uri, f"{resolved} has no tokenizer.json in its artifacts "
                                        f"(searched {_TOKENIZER_SEARCH_DEPTH} folders deep)")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        local = files.download_file(found, tmp)
        dest.mkdir(parents=True, exist_ok=True)
        local.replace(dest / "tokenizer.json")  # atomic: a reader sees all of it or nothing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "tokenizer.json", resolved


def _short(values: list[str]) -> str:
    text = ", ".join(values)
    if len(text) <= _TAG_VALUE_MAX:
        return text
    return text[:_TAG_VALUE_MAX - 20].rsplit(", ", 1)[0] + f", ... ({len(values)} in all)"


class PrepareDataOperator(TrainforgeStageOperator):
    """Prepare the spec's dataset (see the module doc).

    XCom: ``{"dataset_dir", "dataset_uri", "digest", "reused", "vocab_size", "documents",
    "tokens", ..., "mlflow_run_id", "tokenizer_source"}`` (see ``PreparedDataset.summary``).
    """

    ui_color = "#fff2cc"

    @staticmethod
    def asset_for(spec: PipelineSpec):
        """The outlet to declare when the DAG is built: :func:`dataset_asset`."""
        return dataset_asset(spec)

    def execute(self, context: Any) -> dict[str, Any]:
        from trainforge.data.prepare import prepare_dataset  # tokenizers: at run time only

        spec = self.resolved_spec(context)
        run_id = self.mlflow_run_id(context, spec)
        output = resolve(spec.data.output_uri)
        tokenizer_source = spec.data.tokenizer.source
        s3_client = connection_s3_client(spec)
        resolved, model_eos = None, None
        if spec.model.pretrained:
            resolved, model_eos = resolve_pretrained_model(spec, self.mlflow_hook, s3_client)
            check_pretrained_folder(spec, resolved)
            tokenizer_source = pretrained_lineage(resolved)
            self.log.info("Encoding with the tokenizer of %s (%s): EOS %r (from %s), EOS ids %s",
                          tokenizer_source, model_eos.tokenizer_uri, model_eos.eos_token,
                          model_eos.declared_in, list(model_eos.eos_ids))
        try:
            tokenizer_uri = None
            if model_eos is None and tokenizer_source and tokenizer_source.startswith("models:/"):
                path, tokenizer_source = fetch_registered_tokenizer(
                    self.mlflow_hook, tokenizer_source, trainforge_home() / "staging" / "tokenizers")
                tokenizer_uri = str(path)
                self.log.info("Reusing the tokenizer of %s (%s)", tokenizer_source, path)
            prepared = prepare_dataset(
                prepare_settings(spec, tokenizer_uri, model_eos=model_eos), output,
                staging_root=staging_root(output) if output.startswith("s3://") else None,
                log=self.log, s3_client=s3_client)
        except DataPrepError as err:
            fail_permanently(f"data preparation for {spec.dag_id} failed: {err}")
            raise  # unreachable
        summary = prepared.summary()
        summary["tokenizer_source"] = tokenizer_source
        if resolved is not None:
            summary["pretrained"] = resolved.job_section()
        self.log.info("Dataset %s %s in %.1f s: %s documents, %s tokens, at %s", prepared.digest,
                      f"reused ({prepared.reuse} copy)" if prepared.reused else "prepared",
                      prepared.elapsed_s, summary["documents"], summary["tokens"],
                      summary["dataset_uri"])
        self._log_lineage(spec, run_id, prepared, summary)
        self._set_asset_extra(context, summary)
        summary["mlflow_run_id"] = run_id
        return summary

    def _log_lineage(self, spec: PipelineSpec, run_id: str, prepared: Any,
                     summary: dict[str, Any]) -> None:
        stats = prepared.manifest["stats"]
        hook = self.mlflow_hook
        hook.log_params(run_id, {
            "data.sources": _short(spec.data.sources),
            "data.format": spec.data.format,
            "data.vocab_size": (summary["vocab_size"] if "pretrained" in summary
                                else spec.data.tokenizer.vocab_size),
            "data.tokenizer_source": summary["tokenizer_source"] or "trained",
            "data.sequence_length": spec.data.sequence_length,
            "data.validation_fraction": spec.data.validation_fraction,
        })
        metrics = {
            "data/train_tokens": summary["tokens"]["train"],
            "data/validation_tokens": summary["tokens"]["validation"],
            "data/train_documents": summary["documents"]["train"],
            "data/validation_documents": summary["documents"]["validation"],
            "data/documents_in": summary["documents_in"],
            "data/malformed": summary["malformed"],
        }
        metrics.update({f"data/removed_{k}": v for k, v in stats["removed"].items()})
        metrics.update({f"data/cleaning_{k}": v for k, v in stats["cleaning"].items()})
        if "examples" in summary:  # conversations: the tokens the loss counts, what over_length did
            metrics.update({f"data/{split}_loss_tokens": n for split, n in summary["loss_tokens"].items()})
            metrics.update({f"data/over_length_{k}": summary["examples"]["over_length"][k]
                            for k in ("dropped", "truncated")})
        hook.log_metrics(run_id, metrics)
        hook.set_tags(run_id, {
            "trainforge.dataset.digest": prepared.digest,
            "trainforge.dataset.dir": str(prepared.path),
            "trainforge.dataset.uri": summary["dataset_uri"],
            "trainforge.dataset.reused": str(prepared.reused).lower(),
        })
        tags = {
            "sources": _short([s["uri"] for s in prepared.manifest["sources"]]),
            "source_patterns": _short(spec.data.sources),
            "documents_in": summary["documents_in"],
            "malformed": summary["malformed"],
            "tokenizer": summary["tokenizer_source"] or "trained",
        }
        for split in ("train", "validation"):
            tags[f"tokens.{split}"] = summary["tokens"][split]
            tags[f"documents.{split}"] = summary["documents"][split]
        tags.update({f"removed.{k}": v for k, v in stats["removed"].items()})
        tags.update({f"cleaning.{k}": v for k, v in stats["cleaning"].items()})
        if "examples" in summary:
            tags["chat_template_sha256"] = summary["examples"]["chat_template_sha256"]
            tags.update({f"loss_tokens.{split}": n for split, n in summary["loss_tokens"].items()})
        hook.log_dataset_input(run_id, name=f"{spec.dag_id}-dataset", digest=prepared.digest,
                               source_uri=summary["dataset_uri"], context="training",
                               extra_tags=tags)
        hook.log_dict_artifact(run_id, prepared.manifest, "dataset/manifest.json")

    def _set_asset_extra(self, context: Any, summary: dict[str, Any]) -> None:
        """Put the dataset's identity on the event of each declared outlet asset."""
        events = context.get("outlet_events") if hasattr(context, "get") else None
        if events is None:
            return
        extra = {"digest": summary["digest"], "dataset_uri": summary["dataset_uri"],
                 "tokens_train": summary["tokens"]["train"],
                 "tokens_validation": summary["tokens"]["validation"],
                 "reused": summary["reused"]}
        for outlet in self.outlets or []:
            events[outlet].extra.update(extra)
