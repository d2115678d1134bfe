"""Conversations rendered with a model's chat template, and the loss mask fine-tuning trains on.

`messages_of` turns one record (``chat``: a list of ``{role, content}`` messages;
``prompt_completion``: two string fields) into messages, or raises `ChatRecordError` naming the
field. `ChatRenderer.render` renders them with the tokenizer's chat template (transformers'
``apply_chat_template``, or a template the spec gives) and returns the token ids with a mask that
is 1 on exactly what the assistant says: each assistant turn as the model generates it after the
template's generation prompt, and the end-of-turn token that closes it. How (docs/finetuning.md):

    text     = template(messages)
    prompt_i = template(messages[:i], add_generation_prompt=True)   # for each assistant turn i
    answer_i = text[len(prompt_i) : end of message i's content]      # what the model generates
    eot_i    = the special token that follows answer_i in text        # the end-of-turn token

The text is cut at those boundaries and each piece tokenized on its own, so the masked tokens
decode to the answers and end-of-turn tokens exactly, for templates with or without generation
markers. A template that renders earlier turns differently once later ones follow, changes an
answer's content, or closes a turn with no special token is refused: no mask would be right.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The roles a message may have (the template decides which it renders).
ROLES = ("system", "user", "assistant", "tool")


class ChatRecordError(ValueError):
    """A record that is not a conversation, or that the template cannot render.

    ``field`` names where in the record (``messages[2].role``), ``reason`` what is wrong with
    the value given and what was expected; the reader adds the file and line.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class ChatTemplateError(ValueError):
    """A chat template no loss mask can be built from, or no template at all (permanent)."""


def messages_of(record: Any, kind: str, *, messages_field: str = "messages", prompt_field: str = "prompt",
                completion_field: str = "completion") -> list[dict[str, str]]:
    """The conversation in ``record`` (a parsed JSON object or a Parquet row as a dict).

    ``kind`` ``chat``: ``record[messages_field]`` is a list of objects with a ``role`` in
    `ROLES` and a string ``content``, holding at least one assistant turn. ``prompt_completion``:
    ``record[prompt_field]`` and ``record[completion_field]`` are strings; they become a user
    and an assistant turn.

    Raises:
        ChatRecordError: naming the field, the value given and what was expected.
    """
    if not isinstance(record, Mapping):
        raise ChatRecordError("record", f"a {type(record).__name__} was given, expected a JSON object")
    if kind == "prompt_completion":
        turns = []
        for name, role in ((prompt_field, "user"), (completion_field, "assistant")):
            if name not in record:
                raise ChatRecordError(name, f"missing; expected a string field {name!r} "
                                            f"(fields present: {sorted(record)[:10]})")
            if not isinstance(record[name], str):
                raise ChatRecordError(name, f"{_shown(record[name])} is not a string")
            turns.append({"role": role, "content": record[name]})
        return turns
    if kind != "chat":
        raise ValueError(f"kind={kind!r}: expected 'chat' or 'prompt_completion'")
    if messages_field not in record:
        raise ChatRecordError(messages_field, f"missing; expected a list of {{role, content}} messages "
                                              f"(fields present: {sorted(record)[:10]})")
    given = record[messages_field]
    if not isinstance(given, Sequence) or isinstance(given, str | bytes) or not given:
        raise ChatRecordError(messages_field, f"{_shown(given)} is not a non-empty list of messages")
    messages = []
    for i, message in enumerate(given):
        where = f"{messages_field}[{i}]"
        if not isinstance(message, Mapping):
            raise ChatRecordError(where, f"{_shown(message)} is not an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatRecordError(f"{where}.role", f"{_shown(role)} is not a known role; expected one of "
                                                   f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatRecordError(f"{where}.content", f"{_shown(content)} is not a string")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatRecordError(messages_field, f"no assistant turn among the {len(messages)} messages "
                                              "(roles: " + ", ".join(m["role"] for m in messages) +
                              "); nothing to learn from it")
    return messages


@dataclass(frozen=True)
class Rendered:
    """One rendered conversation: ``ids`` and ``mask`` (1: the token is trained on) of equal
    length, and ``answers``, the text the masked tokens decode to, one entry per assistant turn
    (its answer followed by its end-of-turn token)."""

    ids: list[int]
    mask: list[int]
    answers: list[str]

    @property
    def loss_tokens(self) -> int:
        return sum(self.mask)

    def truncated(self, length: int) -> Rendered | None:
        """The first ``length`` tokens when the cut falls inside the last assistant turn (the
        answer is cut short, the prompt is whole), else None."""
        if len(self.ids) <= length:
            return self
        last_start = _last_run_start(self.mask)
        if last_start is None or length <= last_start:
            return None
        return Rendered(self.ids[:length], self.mask[:length], self.answers)


def _last_run_start(mask: list[int]) -> int | None:
    """Where the last run of 1s in ``mask`` starts."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    if not end:
        return None
    start = end
    while start and mask[start - 1]:
        start -= 1
    return start


class ChatRenderer:
    """A tokenizer and the chat template it renders with; `render` gives ids and loss mask."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template if template is not None else getattr(tokenizer, "chat_template", None)
        if not isinstance(self.template, str) or not self.template.strip():
            raise ChatTemplateError("the tokenizer has no chat template; give one with data.chat_template "
                                    "(a Jinja file in the format of tokenizer_config.json's chat_template)")
        self.template_sha256 = hashlib.sha256(self.template.encode()).hexdigest()
        self._special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}

    @classmethod
    def from_folder(cls, folder: str | Path, template: str | None = None) -> ChatRenderer:
        """The tokenizer of a Hugging Face model folder (local; nothing is downloaded)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return cls(tokenizer, template)

    def _text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # noqa: BLE001 - jinja's errors, the template's raise_exception
            roles = ", ".join(m["role"] for m in messages)
            raise ChatRecordError("messages", f"the chat template does not render this conversation "
                                              f"(roles: {roles}): {type(err).__name__}: {err}") from err

    def _ids(self, piece: str) -> list[int]:
        return list(self.tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else []

    def render(self, messages: list[dict[str, str]]) -> Rendered:
        """Token ids and loss mask of ``messages`` (see the module docstring).

        Raises:
            ChatRecordError: the template does not render these messages (a role it refuses,
                roles out of order).
            ChatTemplateError: the template changes an answer, renders a prefix differently, or
                closes an assistant turn without a special token (no record renders right).
        """
        text = self._text(messages, False)
        cuts: list[tuple[int, int]] = []  # (answer start, answer end) in text, one per assistant turn
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._text(messages[:i], True)
            if not text.startswith(prompt) or len(prompt) < cursor:
                raise ChatTemplateError(
                    f"the chat template renders the conversation before assistant turn {i} differently once "
                    f"that turn follows (with the generation prompt: ...{prompt[-60:]!r}; in the whole "
                    f"conversation: ...{text[max(0, len(prompt) - 60):len(prompt)]!r}); no loss mask can "
                    "match what the model sees when it answers")
            start = len(prompt)
            content = message["content"]
            end = _content_end(text, start, content)
            if end is None:
                raise ChatTemplateError(
                    f"assistant turn {i}'s content does not follow the generation prompt (expected {content[:60]!r}, "
                    f"found {text[start:start + 60]!r}): the chat template changes the content, or what it renders "
                    "with add_generation_prompt does not end where the answer begins")
            cuts.append((start, end))
            cursor = end
        ids: list[int] = []
        mask: list[int] = []
        answers: list[str] = []
        at = 0
        for n, (start, end) in enumerate(cuts):
            ids += self._ids(text[at:start])
            mask += [0] * (len(ids) - len(mask))
            answer = self._ids(text[start:end])
            following = self._ids(text[end:cuts[n + 1][0] if n + 1 < len(cuts) else len(text)])
            if not following or following[0] not in self._special:
                raise ChatTemplateError(
                    f"the chat template closes an assistant turn with no special end-of-turn token (it renders "
                    f"{text[end:end + 40]!r} after the answer): a model trained on it never learns to stop "
                    "(expected e.g. the tokenizer's eos token after each assistant turn)")
            ids += answer + following
            mask += [1] * (len(answer) + 1) + [0] * (len(following) - 1)
            answers.append(self.tokenizer.decode(answer + following[:1], skip_special_tokens=False))
            at = cuts[n + 1][0] if n + 1 < len(cuts) else len(text)
        return Rendered(ids, mask, answers)


def _content_end(text: str, start: int, content: str) -> int | None:
    """Where ``content`` ends in ``text`` when it follows ``start`` after nothing but
    whitespace (the template's own spacing), as given or trimmed (templates often trim)."""
    for wanted in (content, content.strip()):
        pos = text.find(wanted, start)
        if pos >= 0 and not text[start:pos].strip():
            return pos + len(wanted)
    return None


def _shown(value: Any) -> str:
    """A value as an error message shows it: its JSON type and its start."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
