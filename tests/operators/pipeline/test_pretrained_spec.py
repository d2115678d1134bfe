"""``model.pretrained``: the URI forms accepted and refused, what it forbids elsewhere in the spec
(architecture fields, init_from, overrides beyond dropouts, data.tokenizer.source), and a dump
that validates again (the spec crosses Airflow as JSON)."""

from __future__ import annotations

import pytest

from trainforge.contract import PRETRAINED_OVERRIDABLE
from trainforge.pipeline import PipelineSpec, SpecError, parse_spec_text
from trainforge.pipeline.architecture import ARCHITECTURE_FIELDS
from tests.operators.pipeline.test_loader import MINIMAL

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _spec(model: str, data: str = "", training: str = ""):
    text = MINIMAL.replace("  sources: [corpus/*.txt]\n", "  sources: [corpus/*.txt]\n" + data)
    text = text.replace("training:\n", "training:\n" + training, 1)
    return parse_spec_text(text + "model:\n" + model, "spec.yaml")


def _issues(model: str, **kwargs) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        _spec(model, **kwargs)
    return {i.path: i.message for i in info.value.issues}


@pytest.mark.parametrize("uri", [
    "/srv/models/llama-3.2-1b", "models/qwen3", "s3://weights/llama/3.2-1b/", "s3://weights/x",
    "models:/base-llm@champion", "models:/base-llm/7", "hf://Qwen/Qwen3-0.6B",
    "hf://meta-llama/Llama-3.2-1B@main", f"hf://google/gemma-2-2b@{COMMIT}",
    "hf://org/name@refs/pr/1",
])
def test_every_form_is_accepted_and_survives_a_json_round_trip(uri):
    spec = _spec(f"  pretrained: {uri!r}\n  dropout: 0.1\n"
                 f"  config_overrides: {{hidden_dropout: 0.05}}\n")
    assert spec.model.pretrained == uri
    dumped = spec.model_dump(mode="json")
    assert dumped["model"] == {"pretrained": uri, "dropout": 0.1,
                               "config_overrides": {"hidden_dropout": 0.05}}
    assert PipelineSpec.model_validate(dumped) == spec


@pytest.mark.parametrize("uri,fragment", [
    ("''", "model.pretrained may not be empty (got ''"),
    ("hf://Qwen", "not a Hugging Face model URI (got 'hf://Qwen'"),
    ("hf://org/na--me", "not a Hugging Face model URI (got 'hf://org/na--me'"),
    ("hf://org/name@", "not a Hugging Face model URI (got 'hf://org/name@'"),
    ("hf:org/name", "not a Hugging Face model URI (got 'hf:org/name'"),
    ("models:/base-llm", "not a registered model URI (got 'models:/base-llm'"),
    ("s3://B/x", "not an s3://bucket/prefix URI (got 's3://B/x'"),
    ("gs://bucket/x", "not a pretrained model source trainforge reads (got 'gs://bucket/x'"),
    ("https://huggingface.co/Qwen/Qwen3-0.6B", "expected a local folder (absolute, or relative "
     "to TRAINFORGE_HOME), 's3://bucket/prefix/', 'models:/<name>@<alias>'"),
])
def test_bad_forms_are_refused_with_the_value_and_the_forms(uri, fragment):
    issues = _issues(f"  pretrained: {uri}\n")
    assert fragment in issues["model.pretrained"], issues


def test_each_architecture_field_set_is_refused_by_name():
    values = {"family": "llama", "hidden_size": 512, "num_layers": 2, "num_heads": 8,
              "num_kv_heads": 2, "intermediate_size": 1024, "rope_theta": 500000.0,
              "tie_word_embeddings": False}
    assert set(values) == set(ARCHITECTURE_FIELDS)
    body = "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n"
                   for k, v in values.items())
    issues = _issues("  pretrained: hf://Qwen/Qwen3-0.6B\n" + body)
    for name in ARCHITECTURE_FIELDS:
        message = issues[f"model.{name}"]
        assert message.startswith(f"{name} comes from the pretrained model's config.json (got "
                                  f"{name} "), message
        assert "with model.pretrained 'hf://Qwen/Qwen3-0.6B'; expected it unset" in message


def test_a_field_set_to_its_default_still_counts_as_set():
    issues = _issues("  pretrained: models/qwen3\n  hidden_size: 256\n")
    assert "got hidden_size 256" in issues["model.hidden_size"]


def test_init_from_is_refused_naming_the_new_field():
    issues = _issues("  pretrained: models/qwen3\n  init_from: models:/base-llm/3\n",
                     data="  tokenizer:\n    source: models:/base-llm/3\n")
    assert ("expected only pretrained, which takes a registered model too: pretrained: "
            "'models:/base-llm/3'") in issues["model.init_from"]


@pytest.mark.parametrize("key", sorted(PRETRAINED_OVERRIDABLE))
def test_dropout_overrides_are_allowed(key):
    spec = _spec(f"  pretrained: models/qwen3\n  config_overrides: {{{key}: 0.1}}\n")
    assert spec.model.config_overrides == {key: 0.1}


@pytest.mark.parametrize("override,fragment", [
    ("rms_norm_eps: 1e-5", "rms_norm_eps comes from the pretrained model's config.json (got "
     "'rms_norm_eps' with model.pretrained 'models/qwen3'; expected one of: attention_dropout, "
     "attn_pdrop, embd_pdrop, hidden_dropout, resid_pdrop)"),
    ("vocab_size: 10", "vocab_size comes from the pretrained model's config.json"),
    ("hidden_dropout: 1.5", "hidden_dropout is a dropout probability (got 1.5; expected a number "
     ">= 0 and < 1)"),
    ("hidden_dropout: 'x'", "hidden_dropout is a dropout probability (got 'x'"),
])
def test_other_overrides_are_refused(override, fragment):
    issues = _issues(f"  pretrained: models/qwen3\n  config_overrides: {{{override}}}\n")
    key = override.split(":")[0]
    assert fragment in issues[f"model.config_overrides.{key}"], issues


def test_dropout_and_attention_dropout_together_are_refused():
    issues = _issues("  pretrained: models/qwen3\n  dropout: 0.1\n"
                     "  config_overrides: {attention_dropout: 0.2}\n")
    assert "attention_dropout is set by model.dropout (got both, 0.1 and 0.2" in (
        issues["model.config_overrides.attention_dropout"])


def test_tokenizer_source_is_refused():
    issues = _issues("  pretrained: hf://Qwen/Qwen3-0.6B\n",
                     data="  tokenizer:\n    source: tokenizers/tok.json\n")
    assert issues["data.tokenizer.source"] == (
        "model.pretrained 'hf://Qwen/Qwen3-0.6B' brings its own tokenizer, which the data is "
        "encoded with (got data.tokenizer.source 'tokenizers/tok.json'; expected it unset)")


def test_an_engine_without_the_shared_disk_needs_the_weights_on_s3():
    kube = "  engine: kubernetes\n  resources:\n    image: trainer:1\n"
    data = "  output_uri: s3://bucket/datasets\n"
    issues = _issues("  pretrained: hf://Qwen/Qwen3-0.6B\n", data=data, training=kube)
    assert "model.pretrained must be on S3 with the kubernetes engine" in (
        issues["model.pretrained"])


@pytest.mark.parametrize("uri", ["s3://weights/qwen3/", "models:/base-llm/3"])
def test_an_engine_without_the_shared_disk_takes_s3_and_registered_models(uri):
    text = MINIMAL.replace("  checkpoint:\n", "  checkpoint:\n    uri: s3://bucket/ckpt\n")
    text = text.replace("  sources: [corpus/*.txt]\n",
                        "  sources: [corpus/*.txt]\n  output_uri: s3://bucket/datasets\n")
    text = text.replace("training:\n", "training:\n  engine: kubernetes\n  resources:\n"
                        "    image: trainer:1\n", 1)
    spec = parse_spec_text(text + f"model:\n  pretrained: {uri}\n", "spec.yaml")
    assert spec.model.pretrained == uri


def test_init_from_keeps_working_without_pretrained():
    spec = _spec("  init_from: models:/base-llm@champion\n  hidden_size: 64\n",
                 data="  tokenizer:\n    source: models:/base-llm@champion\n")
    assert spec.model.init_from == "models:/base-llm@champion" and spec.model.pretrained is None
    assert spec.model_dump(mode="json")["model"]["hidden_size"] == 64


def test_stages_are_refused_until_a_stage_can_start_from_open_weights():
    text = MINIMAL + "model:\n  pretrained: hf://Qwen/Qwen3-0.6B\n" + (
        "stages:\n  - name: a\n  - name: b\n    depends_on: [a]\n    init_from: a\n")
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "spec.yaml")
    issues = {i.path: i.message for i in info.value.issues}
    assert issues["stages"].startswith("model.pretrained 'hf://Qwen/Qwen3-0.6B' with stages is not supported "
                                       "yet")
    assert "(got 2 stages; expected none" in issues["stages"]


def test_chat_data_is_accepted_with_open_weights_and_refused_without():
    chat = ("  format: chat\n  messages_field: conversation\n  chat_template: templates/chat.jinja\n"
            "  over_length: truncate\n")
    spec = _spec("  pretrained: models/qwen3\n", data=chat)
    assert (spec.data.format, spec.data.messages_field, spec.data.chat_template, spec.data.over_length) == (
        "chat", "conversation", "templates/chat.jinja", "truncate")
    assert PipelineSpec.model_validate(spec.model_dump(mode="json")) == spec
    with pytest.raises(SpecError) as info:
        parse_spec_text(MINIMAL.replace("  sources: [corpus/*.txt]\n", "  sources: [corpus/*.txt]\n"
                                        "  format: prompt_completion\n"), "spec.yaml")
    issues = {i.path: i.message for i in info.value.issues}
    assert "format 'prompt_completion' fine-tunes a pretrained model" in issues["data.format"], issues
    assert "got no model.pretrained" in issues["data.format"]


@pytest.mark.parametrize("data,path,fragment", [
    ("  chat_template: t.jinja\n", "data.chat_template", "only read with format chat or prompt_completion "
     "(got format 'text')"),
    ("  format: chat\n  chat_template: s3://b/t.jinja\n", "data.chat_template", "a local Jinja file"),
    ("  packing: true\n", "data.packing", "packing is only read with format chat or prompt_completion "
     "(got format 'text')"),
    ("  format: jsonl\n  packing: true\n", "data.packing", "(got format 'jsonl')"),
    ("  format: chat\n  packing: sometimes\n", "data.packing", "expected true or false (got 'sometimes')"),
    ("  format: chat\n  over_length: cut\n", "data.over_length", "'drop' or 'truncate'"),
    ("  format: dialog\n", "data.format", "'chat' or 'prompt_completion'"),
    ("  format: chat\n  messages_field: ''\n", "data.messages_field", "at least 1 character"),
])
def test_bad_chat_settings_name_the_field(data, path, fragment):
    issues = _issues("  pretrained: models/qwen3\n", data=data)
    assert fragment in issues[path], issues


def test_lora_needs_open_weights_and_names_its_bad_fields():
    spec = _spec("  pretrained: models/qwen3\n", training="  peft: {r: 8, target_modules: [q_proj, v_proj]}\n")
    assert (spec.training.peft.r, spec.training.peft.target_modules, spec.training.peft.merge) == (
        8, ["q_proj", "v_proj"], True)
    with pytest.raises(SpecError) as info:
        parse_spec_text(MINIMAL.replace("training:\n", "training:\n  peft: {}\n", 1), "spec.yaml")
    issues = {i.path: i.message for i in info.value.issues}
    assert "LoRA adapters train on pretrained weights (got no model.pretrained" in issues["training.peft"], issues
    for peft, path, fragment in (("{r: 0}", "training.peft.r", "greater than or equal to 1"),
                                 ("{target_modules: []}", "training.peft.target_modules", "may not be an empty list"),
                                 ("{target_modules: ['q.proj']}", "training.peft.target_modules", "not module names"),
                                 ("{method: dora}", "training.peft.method", "'lora'")):
        issues = _issues("  pretrained: models/qwen3\n", training=f"  peft: {peft}\n")
        assert any(fragment in message for p, message in issues.items() if p.startswith(path)), (peft, issues)


def test_lora_merge_false_registers_the_adapter_of_a_base_in_a_local_folder():
    for uri in ("models/qwen3", "hf://Qwen/Qwen3-0.6B", "models:/base-llm@champion"):
        assert _spec(f"  pretrained: {uri}\n", training="  peft: {merge: false}\n").training.peft.merge is False
    issues = _issues("  pretrained: s3://weights/qwen3/\n", training="  peft: {merge: false}\n")
    assert "reference to its base model's local folder" in issues["training.peft.merge"], issues
