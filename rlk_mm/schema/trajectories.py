"""The builder from GUI / computer-use episodes: ``RLBatch.from_trajectories`` (``fields_from_trajectories``).

An episode is a task and its steps; a step is a screenshot, the model's action (text or
action JSON, scored) and the environment's observation or tool result (text, never scored)
that precedes the next screenshot. The chat is the processor's chat template:

    user: [screenshot 0] task | assistant: action 0 | user: observation 0 [screenshot 1] | assistant: action 1 | ...

- ``history=None``: one sample per episode (the whole chat); every action is an action span.
  Exact for every step, since M-RoPE positions of a prefix do not depend on what follows.
- ``history=k``: one sample per step (episode by episode, step by step): the chat up to the
  step's action with only the last ``k`` screenshots kept (older ones dropped, their actions
  and observations kept as text), as a model with a k-screenshot window sees it; positions
  are computed on that truncated sequence. Only the step's own action is scored.

Loss spans are the action spans (the action's tokens and its ``<|im_end|>``): the prompt,
screenshots and observations are never scored. ``turn_rewards`` hold each step's reward, on
its action span; ``group_ids`` each episode's group (episodes of one task). Each distinct
screenshot is processed once and named by its content key (``media_cache_keys``), so equal
screenshots, within an episode's windows or across episodes, share one vision-tower input;
the key ends with its resize settings and original size (``media.settings_key``), so each
action's coordinates convert with the size of the screenshot it answers
(``RLBatch.media_original_sizes``, ``parse_grounding``).
``step_group_index`` gives the GiGPO step groups: actions taken from identical states.
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ._build import LayoutInfo, build
from ._inputs import chat_markers, check_image_size, check_plain_text, processor_limits, vl_processor_arg
from .checks import int_arg, sequence_arg
from .media import ResizeSettings, content_key, settings_key
from .spans import SchemaError, Span, SpanTable

if TYPE_CHECKING:  # Pillow is the [vl] extra's: imported where screenshots are read, not with the schema
    from PIL import Image

__all__ = ["Step", "step_group_index", "Trajectory"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Step:
    """One step: the screenshot the model saw, its action text, the step reward, and the
    environment's observation after the action (None: nothing to report)."""

    screenshot: "Image.Image"
    action: str
    reward: float = 0.0
    observation: Optional[str] = None


@dataclass(frozen=True)
class Trajectory:
    """One episode: its id, its group (episodes of one task share it), the task text and the steps."""

    id: str
    task: str
    steps: Sequence[Step]
    group_id: str = ""


def _check_trajectories(trajectories, markers: Sequence[str]) -> list[Trajectory]:
    """The episodes, checked: unique ids, text fields without chat markers (``markers``),
    screenshots the image processor can resize, finite rewards; errors name episode, step and field."""
    from PIL import Image

    items = sequence_arg("trajectories", trajectories, "Trajectory", ordered=True)
    if not items:
        raise SchemaError("trajectories is empty: give at least one episode")
    seen: dict[str, int] = {}
    for e, traj in enumerate(items):
        if not isinstance(traj, Trajectory):
            raise TypeError(f"trajectories[{e}] is {type(traj).__name__}; expected a rlk_mm.schema.trajectories.Trajectory")
        for name in ("id", "task", "group_id"):
            if not isinstance(getattr(traj, name), str):
                raise TypeError(f"trajectories[{e}].{name} must be a str, got {type(getattr(traj, name)).__name__}")
        first = seen.setdefault(traj.id, e)
        if first != e:
            raise SchemaError(f"trajectories[{e}] has the id {traj.id!r} of trajectories[{first}]: episode ids name "
                              "the media ids (<episode id>/step<t>), so each episode needs its own id")
        check_plain_text(f"trajectories[{e}] ({traj.id!r}).task", traj.task, markers)
        if not traj.steps:
            raise SchemaError(f"trajectories[{e}] ({traj.id!r}) has no steps: an episode has at least one action")
        for t, step in enumerate(traj.steps):
            where = f"trajectories[{e}] ({traj.id!r}), step {t}"
            if not isinstance(step, Step):
                raise TypeError(f"{where} is {type(step).__name__}; expected a Step")
            if not isinstance(step.screenshot, Image.Image):
                raise TypeError(f"{where}: screenshot must be a PIL image, got {type(step.screenshot).__name__}")
            check_image_size(f"{where}: the screenshot", *step.screenshot.size)
            if not isinstance(step.action, str) or not step.action.strip():
                raise SchemaError(f"{where}: action must be a non-empty str (the model's action text), got {step.action!r}")
            check_plain_text(f"{where}: action", step.action, markers)
            if step.observation is not None and not isinstance(step.observation, str):
                raise TypeError(f"{where}: observation must be a str or None, got {type(step.observation).__name__}")
            if step.observation is not None:
                check_plain_text(f"{where}: observation", step.observation, markers)
            reward = step.reward
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not float(reward) == float(reward) \
                    or abs(float(reward)) == float("inf"):
                raise SchemaError(f"{where}: reward is {reward!r}; a step reward is a finite number")
    return items


class _Screens:
    """Each distinct screenshot processed once: its pixel rows, grid and cache key (its content
    key with its resize settings and original size, ``media.settings_key``)."""

    def __init__(self, processor, info: LayoutInfo):
        self.image_processor, self.info = processor.image_processor, info
        self.limits = processor_limits(processor)
        self.index: dict[bytes, int] = {}
        self.rows: list[Tensor] = []
        self.grids: list[Tensor] = []
        self.keys: list[str] = []

    def add(self, image: "Image.Image") -> int:
        image = image.convert("RGB")
        digest = hashlib.sha256(repr(image.size).encode() + image.tobytes()).digest()
        if digest not in self.index:
            out = self.image_processor(images=[image], return_tensors="pt")
            grid = out["image_grid_thw"][0].long()
            patch = int(self.image_processor.patch_size)
            settings = ResizeSettings(*self.limits, int(grid[1]) * patch, int(grid[2]) * patch,
                                      original_height=image.height, original_width=image.width)
            self.rows.append(out["pixel_values"])
            self.grids.append(grid)
            self.keys.append(settings_key(content_key(out["pixel_values"], grid.tolist(), "image", self.info.fingerprint), settings))
            self.index[digest] = len(self.keys) - 1
        return self.index[digest]

    def tokens(self, s: int) -> int:
        return int(self.grids[s].prod()) // self.info.merge_size**2


def _chat(traj: Trajectory, upto: int, kept: set[int]) -> list[dict]:
    """Messages of ``traj`` up to step ``upto``'s action; screenshots of steps outside ``kept`` dropped."""
    messages = []
    for t in range(upto + 1):
        content = []
        if t == 0:
            content.append({"type": "text", "text": traj.task})
        elif traj.steps[t - 1].observation is not None:
            content.append({"type": "text", "text": traj.steps[t - 1].observation})
        if t in kept:
            content.insert(0 if t == 0 else len(content), {"type": "image"})
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": traj.steps[t].action})
    return messages


def _tokens(processor, messages: list[dict], images: list[int], screens: _Screens, scored: list[int], episode: str):
    """(ids, loss mask, action spans) of one chat; ``scored``: the assistant turns to score;
    ``episode`` names the episode in errors."""
    text = processor.apply_chat_template(messages, tokenize=False)
    pad = "<|image_pad|>"
    pieces = text.split(pad)
    if len(pieces) - 1 != len(images):
        raise SchemaError(f"{episode}: the chat template wrote {len(pieces) - 1} image placeholders for {len(images)} "
                          "screenshots")
    text = pieces[0] + "".join(pad * screens.tokens(s) + rest for s, rest in zip(images, pieces[1:]))
    enc = processor.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    starts = torch.tensor([a for a, _ in offsets])
    ends = torch.tensor([b for _, b in offsets])
    spans, cursor = [], 0
    for turn, message in enumerate(m for m in messages if m["role"] == "assistant"):
        marker = "<|im_start|>assistant\n" + message["content"] + "<|im_end|>"
        at = text.find(marker, cursor)
        if at < 0:
            raise SchemaError(f"{episode}, step {turn}: the action {message['content']!r} was not written verbatim "
                              "by the chat template")
        lo, hi = at + len("<|im_start|>assistant\n"), at + len(marker)
        cursor = hi
        if turn not in scored:
            continue
        first = int(torch.searchsorted(starts, lo))
        last = int(torch.searchsorted(ends, hi))
        if first >= len(ids) or int(starts[first]) != lo or last >= len(ids) or int(ends[last]) != hi:
            raise SchemaError(f"{episode}, step {turn}: action {message['content']!r}: a token straddles the action's "
                              "boundary (e.g. leading whitespace merges with the turn header), so the action cannot be "
                              "scored exactly; strip the action's leading and trailing whitespace")
        spans.append(Span(first, last + 1))
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for s in spans:
        mask[s.start : s.end] = True
    return torch.tensor(ids, dtype=torch.int64), mask, spans


def fields_from_trajectories(trajectories: Sequence[Trajectory], *, processor, history: Optional[int] = None,
                             tokens_per_second: Optional[float] = None) -> dict:
    """The fields of an RLBatch (``RLBatch.from_trajectories``) from GUI episodes (``Trajectory``).

    ``history=None``: one sample per episode, every action scored; ``history=k`` (>= 1): one
    sample per step with the last k screenshots, its own action scored. ``processor``: a
    Qwen-VL processor (its chat template, tokenizer and image processor). Sets action
    spans (= loss spans), ``turn_rewards`` (the step rewards), ``group_ids`` (each episode's
    ``group_id``, else its id), ``screen_size`` (each sample's last screenshot), one media id
    per screenshot, ``<episode id>/step<t>``, and each screenshot's original size and resize
    settings in its cache key (``RLBatch.media_original_sizes`` reads the sizes).

    Raises
    ------
    TypeError
        ``processor`` is not a Qwen-VL processor, or an episode, step or field has the wrong type.
    SchemaError
        Naming the episode, step and field: two episodes with one id; episodes of one group with
        another task or first screenshot; a task, action or observation holding a chat marker
        (``<|im_start|>``, ``<|image_pad|>``, ...); a screenshot of a zero side or an aspect ratio
        above 200; an empty action, a non-finite reward; an action whose tokens straddle its turn.
    ValueError
        The processor's image processor names no min/max pixels (recorded with each screenshot)."""
    processor = vl_processor_arg(processor)
    trajectories = _check_trajectories(trajectories, chat_markers(processor))
    if history is not None:
        history = int_arg("history", history, min=1)
    info = LayoutInfo.of(processor, tokens_per_second)
    screens = _Screens(processor, info)
    samples = []  # (ids, mask, action spans, screenshot list, media ids, rewards, group, screen size)
    prompts: dict[str, tuple[int, str, str]] = {}  # group -> (episode, task, first screenshot's key)
    for e, traj in enumerate(trajectories):
        shot = [screens.add(step.screenshot) for step in traj.steps]
        _check_group(prompts, e, traj, screens.keys[shot[0]])
        steps = [len(traj.steps) - 1] if history is None else range(len(traj.steps))
        for upto in steps:
            kept = set(range(upto + 1)) if history is None else set(range(max(0, upto + 1 - history), upto + 1))
            images = [shot[t] for t in sorted(kept)]
            scored = list(range(upto + 1)) if history is None else [upto]
            ids, mask, spans = _tokens(processor, _chat(traj, upto, kept), images, screens, scored,
                                       f"trajectories[{e}] ({traj.id!r})")
            samples.append(dict(
                ids=ids, mask=mask, spans=spans, images=images, media_ids=[f"{traj.id}/step{t}" for t in sorted(kept)],
                rewards=[float(traj.steps[t].reward) for t in scored], group=traj.group_id or traj.id,
                screen=list(traj.steps[upto].screenshot.size),
            ))
    order = [s for sample in samples for s in sample["images"]]
    fields = build(
        [s["ids"] for s in samples], [None] * len(samples), info,
        image_grid_thw=torch.stack([screens.grids[s] for s in order]),
        pixel_values=torch.cat([screens.rows[s] for s in order]),
        loss_masks=[s["mask"] for s in samples],
        group_ids=[s["group"] for s in samples],
        media_ids=[m for s in samples for m in s["media_ids"]],
        media_cache_keys=[screens.keys[s] for s in order],
    )
    fields.update(
        action_spans=SpanTable.from_lists([s["spans"] for s in samples]),
        turn_rewards=torch.tensor([r for s in samples for r in s["rewards"]], dtype=torch.float32),
        screen_size=torch.tensor([s["screen"] for s in samples], dtype=torch.int64),
    )
    return fields


def _check_group(prompts: dict, e: int, traj: Trajectory, first_key: str) -> None:
    """Episodes of one group answer one prompt: the same task and the same first screenshot."""
    group = traj.group_id or traj.id
    other, task, key = prompts.setdefault(group, (e, traj.task, first_key))
    if (task, key) != (traj.task, first_key):
        what = "task" if task != traj.task else "first screenshot"
        raise SchemaError(f"trajectories[{e}] ({traj.id!r}) is in group {group!r} with trajectories[{other}] but its "
                          f"{what} differs: a group's episodes answer one task from one start screen; give them "
                          "different group_ids")


def step_group_index(batch) -> Tensor:
    """int64 [num action spans]: GiGPO step groups, dense in first-appearance order.

    Two actions share a group when they were taken from identical states: the same tokens
    before the action and the same screenshots (media cache keys) among them, whichever
    episode or sample they come from. Use it next to the episode groups (``group_ids``),
    e.g. ``group_advantages(batch.turn_rewards, step_group_index(batch))``. Reads the batch
    on the host."""
    if type(batch).__name__ != "RLBatch":  # duck-typed: batch.py imports this module
        raise TypeError(f"batch must be an RLBatch (one from RLBatch.from_trajectories), got {type(batch).__name__}")
    if batch.action_spans is None:
        raise SchemaError("step_group_index needs action_spans (a batch from RLBatch.from_trajectories)")
    seen: dict[bytes, int] = {}
    out = []
    media_sample = [] if batch.media_sample is None else batch.media_sample.tolist()
    for b in range(batch.num_samples):
        tokens = batch.sample_tokens(b).cpu()
        media = [batch.media_cache_keys[g] for g, owner in enumerate(media_sample) if owner == b]
        media_starts = [s.start for s in batch.modality_spans_of(b) if s.media_index >= 0]
        text, screens, cursor = hashlib.sha256(), hashlib.sha256(), 0  # fed in order: chunking does not matter
        for span in batch.action_spans.spans_of(b):
            text.update(tokens[cursor : span.start].numpy().tobytes())
            for key, at in zip(media, media_starts):
                if cursor <= at < span.start:
                    screens.update(key.encode() + b"\0")
            cursor = span.start
            out.append(seen.setdefault(text.digest() + screens.digest(), len(seen)))
    return torch.tensor(out, dtype=torch.int64, device=batch.device)
