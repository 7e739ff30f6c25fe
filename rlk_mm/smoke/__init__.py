"""`rlk-mm smoke`: an image-text GRPO run that proves the pipeline before it trains.

What a VLM RL engineer runs first. With no download it:

1. draws seeded images in which one of four colours dominates (distractor shapes, varying
   sizes, sometimes two images) and asks "Which colour dominates the image? Answer with
   one word." (reward 1 for the right colour word); `--data DIR` runs on a Geo3K folder
   with a Geo3K-style reward instead (`--task geo3k` alone: the 3-problem sample in the package);
2. builds the real Qwen2.5-VL processor and a tiny random-weight
   `Qwen2_5_VLForConditionalGeneration` (or loads `--model-path`);
3. warms the policy up on the answer format with shuffled labels, so it answers with a
   colour word but at chance: it has not learned to look at the image;
4. samples G answers per prompt with `models.generate_on_policy` (KV cache, under
   `batch_invariant()`, each token drawn by `ops.sample_from_hidden`) and records the
   tokens, the positions the model was fed and the log-probs;
5. checks four gates before the first update, each printed PASS/FAIL: (a) layout parity
   of the rollout-side and training-side `RLBatch`; (b) rollout log-probs vs the training
   path (`selected_logprob`): bitwise equal under the invariant kernels (`--kernels default`:
   within the numerical contract); (c) loss masking: no prompt,
   image or padding token is scored, and changing every target id outside the loss spans
   leaves loss and gradients bitwise unchanged; (d) the importance ratio exp(logp - old)
   at the first update is 1 within the contract;
6. trains with GRPO through rlk_mm ops only: rewards -> `scatter_rewards` ->
   `group_advantages` -> `linear_policy_loss` (the LM head fused with the PPO loss, with
   `--kl-coef` a k3 KL to the warm-up reference; the frozen head's product is skipped) ->
   Adam step, with a live per-step table and the rollout-vs-training log-prob gap of every step;
7. writes `smoke_report.json`, `smoke_curves.png` and `smoke_layout.png` (one group) to
   `--out`, and exits non-zero when a gate or the learning check fails.

`--break {loss-shift,adv-sign,image-swap}` injects a known bug so one can see what
catches it: loss spans one token early (gates a-d), negated advantages (learning check),
image embeddings swapped between two prompts of the same image size (gates b and d).

Why it is built as it is:
- the rollout draws from the final hidden states (`sample_from_hidden`), so its log-probs
  are the training op's by construction and the old-log-prob recompute is not needed;
- the vision tower encodes each distinct image once, since a group repeats its prompt G
  times (the rollout prefills each prompt once and its sampler forms each distinct row's
  logits once);
- the token embeddings and LM head are frozen during GRPO: Adam would otherwise move every
  unsampled row of the 151k-row head at once, and the answer format collapses;
- `keep_freed_memory` (glibc mallopt, at the start of every run) keeps the big logits
  buffers on the heap instead of returning them to the OS on every step.

Modules, bottom up: ``tasks`` (a package: the base ``Task``, then one module per task:
colour, Geo3K, video-direction, point), ``policy`` (model, hooks, training
forward, warm-up), ``rollout``, ``gates``, ``learning`` (the learning check), ``report``
(versions, progress table, curves), ``tuning`` (``SmokeTuning``: the settings the command line
does not offer), ``train`` (``run_smoke``), ``options`` (argparse),
``cli`` (the sub-command and ``python -m rlk_mm.smoke``). ``task_settings`` holds the tasks' names
and settings without their code, so that the parser (``options``) imports no torch, and this
package serves its names on first use: ``rlk-mm smoke --help`` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy names below are, for IDEs, type checkers and the API reference
    from .cli import add_smoke_parser  # noqa: F401
    from .options import LR_FLOOR, parse_args  # noqa: F401
    from .policy import TINY_MODEL, load_policy  # noqa: F401
    from .tasks import COLOURS, colour_reward, colour_sample, geo3k_reward  # noqa: F401
    from .train import lr_factor, run_smoke  # noqa: F401
    from .tuning import SmokeTuning  # noqa: F401

#: name -> the module of this package that holds it
_EXPORTS = {"add_smoke_parser": "cli", "LR_FLOOR": "options", "parse_args": "options", "TINY_MODEL": "policy",
            "load_policy": "policy", "COLOURS": "tasks", "colour_reward": "tasks", "colour_sample": "tasks",
            "geo3k_reward": "tasks", "lr_factor": "train", "run_smoke": "train", "SmokeTuning": "tuning"}

__all__ = ["SmokeTuning", "add_smoke_parser", "parse_args", "run_smoke"]


#: the submodules, served as attributes before anything imported them (``smoke.tasks.TASKS``)
_SUBMODULES = ("cli", "gates", "learning", "options", "policy", "report", "rollout", "task_settings", "tasks", "train",
               "tuning")


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, submodules=_SUBMODULES)
