"""Assistant turns of a chat in token ids: what the builders' ``assistant_turns=True`` scores.

Qwen-VL chat templates (ChatML) write each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.
An assistant turn is scored as a response is: its content tokens and its ``<|im_end|>``
(the token that ends generation), not the ``<|im_start|>assistant\\n`` header and not the
newline after ``<|im_end|>``. Where the content starts with whitespace that the tokenizer
merged with the header's newline (``"\\n\\n"`` is one token), that token is content and is
scored. The generation prompt (a header with nothing after it, at the end) holds no turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .spans import SchemaError, Span

Tensor = torch.Tensor

__all__: list[str] = []


@dataclass(frozen=True)
class ChatMarkers:
    """The token ids that delimit ChatML turns, and the tokenizer (to read a header's newline)."""

    im_start: int
    im_end: int
    assistant: tuple[int, ...]  # the role's tokens after <|im_start|>
    newline: int  # the header's "\n"
    tokenizer: Any

    @classmethod
    def of(cls, processor) -> "ChatMarkers":
        tokenizer = getattr(processor, "tokenizer", processor)
        vocab = tokenizer.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in vocab]
        if missing:
            raise SchemaError(f"assistant_turns=True reads ChatML turns (<|im_start|>role\\n ... <|im_end|>), but the "
                              f"tokenizer has no {' or '.join(missing)}: mark the scored tokens with a mask instead")
        (newline,) = tokenizer.encode("\n", add_special_tokens=False)
        return cls(vocab["<|im_start|>"], vocab["<|im_end|>"], tuple(tokenizer.encode("assistant", add_special_tokens=False)),
                   newline, tokenizer)


def assistant_turn_spans(ids: Tensor, markers: ChatMarkers, *, name: str, sample: int) -> list[Span]:
    """The scored spans ``[content start, <|im_end|> + 1)`` of every assistant turn of one
    unpadded sequence ``ids``. A turn with content but no ``<|im_end|>`` (cut by truncation)
    is refused, naming ``name``, the sample and the position."""
    values = ids.tolist()
    L, head = len(values), len(markers.assistant)
    spans = []
    for p in (i for i, t in enumerate(values) if t == markers.im_start):
        if tuple(values[p + 1 : p + 1 + head]) != markers.assistant:
            continue
        start = p + 1 + head
        if start < L and values[start] == markers.newline:
            start += 1
        elif start < L and not markers.tokenizer.decode([values[start]]).startswith("\n"):
            continue  # another role that starts with "assistant"
        if start >= L:
            continue  # the generation prompt: nothing after the header
        try:
            end = values.index(markers.im_end, start)
        except ValueError:
            raise SchemaError(f"{name}: sample {sample}, the assistant turn at position {p} has no <|im_end|> (it was cut, "
                              "e.g. by truncation): a turn is scored with its end token; end the turn, or drop it") from None
        spans.append(Span(start, end + 1))
    return spans


def assistant_turn_mask(ids: Tensor, markers: ChatMarkers, *, name: str, sample: int) -> Tensor:
    """bool [L]: True at the scored tokens of ``ids``' assistant turns (``assistant_turn_spans``)."""
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    for span in assistant_turn_spans(ids, markers, name=name, sample=sample):
        mask[span.start : span.end] = True
    return mask
