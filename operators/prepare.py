"""The ``prepare_data`` task: clean, split, tokenise and shard the corpus; log its lineage.

The work itself is :func:`operators.data.prepare.prepare_dataset` (pure Python, no Airflow);
this operator maps the spec onto its settings, opens the DAG run's MLflow run, records the
dataset there as an input (digest, sources, token and document counts), and returns a small
JSON summary as XCom. Re-running on the same inputs reuses the finished dataset.
"""

from __future__ import annotations

from typing import Any

from operators.base import TrainforgeStageOperator, fail_permanently
from operators.paths import resolve
from operators.spec.model import PipelineSpec


def prepare_settings(spec: PipelineSpec):
    """The data-prep settings of a spec (sources resolved against TRAINFORGE_HOME)."""
    from operators.data.settings import PrepareSettings

    data = spec.data
    return PrepareSettings(
        sources=tuple(resolve(s) for s in data.sources),
        strip_gutenberg_boilerplate=data.cleaning.strip_gutenberg_boilerplate,
        normalize_whitespace=data.cleaning.normalize_whitespace,
        unicode_normalization=data.cleaning.unicode_normalization,
        min_document_chars=data.cleaning.min_document_chars,
        vocab_size=data.tokenizer.vocab_size,
        validation_fraction=data.validation_fraction,
        shard_tokens=data.shard_tokens,
    )


class PrepareDataOperator(TrainforgeStageOperator):
    """Prepare the spec's dataset.

    XCom: ``{"dataset_dir", "digest", "reused", "vocab_size", "documents", "tokens", ...,
    "mlflow_run_id"}`` (see ``PreparedDataset.summary``).
    """

    ui_color = "#fff2cc"

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.data.errors import DataPrepError
        from operators.data.prepare import prepare_dataset

        spec = self.resolved_spec(context)
        run_id = self.mlflow_run_id(context, spec)
        try:
            prepared = prepare_dataset(prepare_settings(spec), resolve(spec.data.output_uri))
        except DataPrepError as err:
            fail_permanently(f"data preparation for {spec.dag_id} failed: {err}")
        summary = prepared.summary()
        self.log.info("Dataset %s %s in %.1f s: %s documents, %s tokens", prepared.digest,
                      "reused" if prepared.reused else "prepared", prepared.elapsed_s,
                      summary["documents"], summary["tokens"])
        hook = self.mlflow_hook
        hook.log_params(run_id, {
            "data.sources": ",".join(spec.data.sources)[:500],
            "data.vocab_size": spec.data.tokenizer.vocab_size,
            "data.sequence_length": spec.data.sequence_length,
            "data.validation_fraction": spec.data.validation_fraction,
        })
        hook.log_metrics(run_id, {
            "data/train_tokens": summary["tokens"]["train"],
            "data/validation_tokens": summary["tokens"]["validation"],
            "data/train_documents": summary["documents"]["train"],
            "data/validation_documents": summary["documents"]["validation"],
            "data/documents_in": summary["documents_in"],
        })
        hook.set_tags(run_id, {
            "trainforge.dataset.digest": prepared.digest,
            "trainforge.dataset.dir": str(prepared.path),
            "trainforge.dataset.reused": str(prepared.reused).lower(),
        })
        hook.log_dataset_input(
            run_id, name=f"{spec.dag_id}-dataset", digest=prepared.digest,
            source_uri=str(prepared.path), context="training",
            extra_tags={"tokens.train": str(summary["tokens"]["train"]),
                        "tokens.validation": str(summary["tokens"]["validation"])},
        )
        hook.log_dict_artifact(run_id, prepared.manifest, "dataset/manifest.json")
        summary["mlflow_run_id"] = run_id
        return summary
