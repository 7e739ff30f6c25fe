"""Multi-turn: ``assistant_turns=True`` scores every assistant turn of a chat (its content
tokens and its ``<|im_end|>``, as a response is scored) in from_messages, from_qwen_vl and
from_token_lists, on the real Qwen-VL chat template and processor; it equals the
``assistant_mask`` a user had to build by hand."""

import pytest
import torch
from PIL import Image

from rlk_mm import RLBatch, SchemaError
from rlk_mm.fixtures import IM_END_TOKEN_ID, IM_START_TOKEN_ID
from rlk_mm.schema.turns import ChatMarkers, assistant_turn_spans

IMAGE = Image.new("RGB", (56, 84), (200, 30, 30))
CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes, it is red."}]},
    ],
    [
        {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "Name it."}]},
        {"role": "assistant", "content": ""},  # an empty turn: only its end token
        {"role": "user", "content": "Again, please."},
        {"role": "assistant", "content": "\n\nA red square."},  # content whitespace merges with the header's newline
    ],
]
SCORED = [["Red.<|im_end|>", "Yes, it is red.<|im_end|>"], ["<|im_end|>", "\n\n\nA red square.<|im_end|>"]]


def scored_text(processor, batch, b):
    tokens = batch.sample_tokens(b)
    return [processor.tokenizer.decode(tokens[s.start : s.end].tolist()) for s in batch.loss_spans_of(b)]


def hand_made_mask(input_ids, tokenizer):
    """What a user wrote for assistant_mask: each <|im_start|>assistant\\n ... <|im_end|> turn."""
    assistant = tokenizer.encode("assistant", add_special_tokens=False)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, row in enumerate(input_ids.tolist()):
        for p, token in enumerate(row):
            if token == IM_START_TOKEN_ID and row[p + 1 : p + 1 + len(assistant)] == assistant:
                start = p + 1 + len(assistant)
                if tokenizer.decode([row[start]]) == "\n":
                    start += 1
                if start >= len(row):
                    continue
                end = row.index(IM_END_TOKEN_ID, start)
                mask[b, start : end + 1] = True
    return mask


def test_from_messages_scores_each_assistant_turn(processor):
    batch = RLBatch.from_messages(CHATS, processor=processor, add_generation_prompt=False, assistant_turns=True)
    for b, want in enumerate(SCORED):
        assert scored_text(processor, batch, b) == want
    plain = RLBatch.from_messages(CHATS, processor=processor, add_generation_prompt=False)
    assert plain.loss_spans.num_spans == 0 and torch.equal(plain.input_ids, batch.input_ids)


def test_it_equals_the_hand_made_assistant_mask(processor):
    from rlk_mm.schema.messages import vision_process  # noqa: F401  (qwen-vl-utils' resize is what from_messages used)

    batch = RLBatch.from_messages(CHATS, processor=processor, add_generation_prompt=False, assistant_turns=True)
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in CHATS]
    out = processor(text=texts, images=[IMAGE, IMAGE], padding=True, padding_side="left", return_tensors="pt")
    by_turns = RLBatch.from_qwen_vl(out, processor=processor, assistant_turns=True)
    by_mask = RLBatch.from_qwen_vl(out, processor=processor,
                                   assistant_mask=hand_made_mask(out["input_ids"], processor.tokenizer))
    assert by_turns == by_mask
    assert by_turns.loss_spans == batch.loss_spans and torch.equal(by_turns.input_ids, batch.input_ids)


def test_earlier_turns_and_the_new_response(processor):
    """A rollout continues a conversation: earlier assistant turns and the generated response are scored."""
    history = CHATS[0][:4]
    response = processor.tokenizer.encode("Yes.") + [IM_END_TOKEN_ID]
    batch = RLBatch.from_messages([history], processor=processor, responses=[response], assistant_turns=True)
    assert scored_text(processor, batch, 0) == ["Red.<|im_end|>", "Yes.<|im_end|>"]
    only_response = RLBatch.from_messages([history], processor=processor, responses=[response])
    assert scored_text(processor, only_response, 0) == ["Yes.<|im_end|>"]
    assert batch.loss_spans_of(0)[-1] == only_response.loss_spans_of(0)[0]
    # the prompt ends at the first scored turn
    assert batch.prompt_lengths.tolist() == [batch.loss_spans_of(0)[0].start]


def test_from_token_lists(processor):
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    out = processor(text=texts, images=[IMAGE, IMAGE], padding=True, padding_side="right", return_tensors="pt")
    ids = [row[mask.bool()].tolist() for row, mask in zip(out["input_ids"], out["attention_mask"])]
    responses = [processor.tokenizer.encode(t) + [IM_END_TOKEN_ID] for t in ("Bye.", "OK")]
    batch = RLBatch.from_token_lists(ids, responses, processor=processor, image_grid_thw=out["image_grid_thw"],
                                     pixel_values=out["pixel_values"], assistant_turns=True)
    assert scored_text(processor, batch, 0) == SCORED[0] + ["Bye.<|im_end|>"]
    assert scored_text(processor, batch, 1) == SCORED[1] + ["OK<|im_end|>"]


def test_turn_spans_of_token_ids(processor):
    markers = ChatMarkers.of(processor)
    tok = processor.tokenizer
    ids = torch.tensor(tok.encode(processor.apply_chat_template(CHATS[0][2:], tokenize=False,
                                                                add_generation_prompt=True)))
    spans = assistant_turn_spans(ids, markers, name="ids", sample=0)
    # the generation prompt holds no turn
    assert [tok.decode(ids[s.start : s.end].tolist()) for s in spans] == SCORED[0]
    other_role = torch.tensor(tok.encode("<|im_start|>assistant_tool\nhi<|im_end|>\n"))
    assert assistant_turn_spans(other_role, markers, name="ids", sample=0) == []


def test_bad_use_is_refused(processor):
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in CHATS]
    out = processor(text=texts, images=[IMAGE, IMAGE], padding=True, padding_side="left", return_tensors="pt")
    with pytest.raises(SchemaError, match="assistant_mask and assistant_turns=True both say what to score"):
        RLBatch.from_qwen_vl(out, processor=processor, assistant_turns=True, assistant_mask=out["attention_mask"])
    with pytest.raises(TypeError, match="assistant_turns must be True or False"):
        RLBatch.from_messages(CHATS, processor=processor, assistant_turns="yes")
    cut = processor.tokenizer.encode(texts[1])[:-3]  # the last turn loses its <|im_end|>
    with pytest.raises(SchemaError,
                       match=r"prompt_token_ids: sample 0, the assistant turn at position \d+ has no <\|im_end\|>"):
        RLBatch.from_token_lists([cut], processor=processor, image_grid_thw=out["image_grid_thw"][1:],
                                 pixel_values=out["pixel_values"][out["pixel_values"].shape[0] // 2 :],
                                 assistant_turns=True)
    with_image = [[{"role": "user", "content": "Draw it."},
                   {"role": "assistant",
                    "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "Here."}]}]]
    with pytest.raises(SchemaError,
                       match=r"input_ids: sample 0, position \d+ is a media placeholder inside an assistant turn"):
        RLBatch.from_messages(with_image, processor=processor, add_generation_prompt=False, assistant_turns=True)
