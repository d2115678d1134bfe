"""Chat rendering and its loss mask (trainforge.data.chat) on the chat templates of four
families: ChatML (qwen3), Llama 3 (llama), one with no system role (gemma2) and one that closes
answers with the EOS token after a space (mistral). The reference is each template's own text:
the masked tokens decode to exactly the answers plus their end-of-turn tokens, the ids decode
to the whole rendered conversation, and every answer's prompt is tokenized as the model sees it
when it generates (the tokenizer run on the generation prompt alone)."""

from __future__ import annotations

import pytest

from tests.hf_models import END_OF_TURN, FAMILIES, save_tokenizer
from trainforge.data.chat import ChatRecordError, ChatRenderer, ChatTemplateError, messages_of


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


#: Conversations and the families whose templates render them (roles alternate for
#: mistral/gemma2; gemma2 has no system role; only the ChatML and Llama 3 templates take tools).
CONVERSATIONS = {
    "one turn": ([_m("user", "Where does the river start?"), _m("assistant", "High in the hills.")], FAMILIES),
    "multi-turn": ([_m("user", "How long is the bridge?"), _m("assistant", " 42 metres. "),
                    _m("user", "And the flood?"), _m("assistant", "In 1897 the water rose 3.5 metres.")],
                   FAMILIES),
    "system": ([_m("system", "Answer briefly."), _m("user", "Who knows?"), _m("assistant", "The keeper.")],
               ("llama", "qwen3", "mistral")),
    "tool": ([_m("user", "What is the price of grain?"), _m("assistant", "Let me look it up."),
              _m("tool", "{\"price\": 12}"), _m("assistant", "Twelve, today.")], ("llama", "qwen3")),
}


@pytest.fixture(scope="module")
def renderers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: ChatRenderer.from_folder(save_tokenizer(root / family, family)) for family in FAMILIES}


def _expected_answer(family: str, content: str) -> str:
    """The answer as the family's template writes it (what the model must generate)."""
    if family in ("llama", "gemma2"):  # these templates trim
        content = content.strip()
    if family == "mistral":  # "[/INST]" + " " + answer + eos
        content = " " + content
    return content + END_OF_TURN[family]


@pytest.mark.parametrize(("family", "name"), [(f, n) for n, (_, families) in CONVERSATIONS.items() for f in families])
def test_the_loss_mask_is_the_answers_and_their_end_of_turn_tokens(renderers, family, name):
    messages, _ = CONVERSATIONS[name]
    renderer = renderers[family]
    tok = renderer.tokenizer
    rendered = renderer.render(messages)
    assert len(rendered.ids) == len(rendered.mask)
    text = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(rendered.ids, skip_special_tokens=False) == text
    answers = [_expected_answer(family, m["content"]) for m in messages if m["role"] == "assistant"]
    masked = [i for i, keep in zip(rendered.ids, rendered.mask) if keep]
    assert tok.decode(masked, skip_special_tokens=False) == "".join(answers)
    assert rendered.answers == answers
    runs = sum(1 for i, keep in enumerate(rendered.mask) if keep and (i == 0 or not rendered.mask[i - 1]))
    assert runs == len(answers)  # one masked run per answer: nothing of the prompt in between
    eot = tok.convert_tokens_to_ids(END_OF_TURN[family])
    assert sum(1 for i, keep in zip(rendered.ids, rendered.mask) if keep and i == eot) == len(answers)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":  # the prompt tokens are those of generation time
            prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            assert rendered.ids[:len(prompt_ids)] == prompt_ids
            assert not rendered.mask[len(prompt_ids) - 1] and rendered.mask[len(prompt_ids)]


def test_prompt_completion_records_are_one_user_and_one_assistant_turn(renderers):
    messages = messages_of({"q": "Who knows?", "a": "The keeper."}, "prompt_completion",
                           prompt_field="q", completion_field="a")
    assert messages == [_m("user", "Who knows?"), _m("assistant", "The keeper.")]
    rendered = renderers["qwen3"].render(messages)
    assert rendered.answers == ["The keeper.<|im_end|>"]


def test_a_cut_inside_the_last_answer_truncates_and_a_cut_in_the_prompt_does_not(renderers):
    rendered = renderers["qwen3"].render(CONVERSATIONS["multi-turn"][0])
    last = max(i for i, keep in enumerate(rendered.mask) if keep and not rendered.mask[i - 1])
    cut = rendered.truncated(last + 2)
    assert cut.ids == rendered.ids[:last + 2] and cut.mask == [*rendered.mask[:last], 1, 1]
    assert rendered.truncated(last) is None  # the last answer would be gone: dropped instead
    assert rendered.truncated(len(rendered.ids)) is rendered


@pytest.mark.parametrize(("record", "kind", "field", "says"), [
    ({"messages": [_m("user", "hi")]}, "chat", "messages", "no assistant turn"),
    ({"messages": [_m("user", "hi"), _m("narrator", "so")]}, "chat", "messages[1].role", "'narrator'"),
    ({"messages": [_m("user", "hi"), {"role": "assistant", "content": 3}]}, "chat", "messages[1].content",
     "int 3 is not a string"),
    ({"messages": "hello"}, "chat", "messages", "not a non-empty list"),
    ({"conversation": []}, "chat", "messages", "missing"),
    (["not", "an", "object"], "chat", "record", "expected a JSON object"),
    ({"prompt": "hi"}, "prompt_completion", "completion", "missing"),
    ({"prompt": None, "completion": "x"}, "prompt_completion", "prompt", "NoneType None is not a string"),
])
def test_a_record_that_is_not_a_conversation_names_its_field(record, kind, field, says):
    with pytest.raises(ChatRecordError) as caught:
        messages_of(record, kind)
    assert caught.value.field == field and says in caught.value.reason


def test_a_conversation_the_template_refuses_is_a_record_error(renderers):
    with pytest.raises(ChatRecordError, match="System role not supported"):
        renderers["gemma2"].render([_m("system", "Be brief."), _m("user", "hi"), _m("assistant", "hello")])


def test_templates_no_mask_can_be_built_from_are_refused(renderers):
    tok = renderers["qwen3"].tokenizer
    messages = CONVERSATIONS["one turn"][0]
    no_end = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ChatTemplateError, match="never learns to stop"):
        ChatRenderer(tok, no_end).render(messages)
    changes = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="turn 1's content does not follow the generation prompt"):
        ChatRenderer(tok, changes).render(messages)
    history = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant (last)\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="differently once that turn follows"):
        ChatRenderer(tok, history).render(messages)
    tok_without = renderers["qwen3"].tokenizer.__class__.from_pretrained(tok.name_or_path)
    tok_without.chat_template = None
    with pytest.raises(ChatTemplateError, match="data.chat_template"):
        ChatRenderer(tok_without)
    # the same no-template tokenizer with a template given: renders
    assert ChatRenderer(tok_without, tok.chat_template).render(messages).answers == ["High in the hills.<|im_end|>"]
