"""Swapping rlk_mm's fused loss and vectorized advantages into EasyR1.

EasyR1 has no plugin registry; its actor imports ``compute_policy_loss``, ``compute_kl`` and
``average_loss`` from ``verl.trainer.core_algos`` by name, its trainer keeps its own
``compute_kl`` and looks estimators up in ``ADV_ESTIMATOR_MAP``.
``rlk_mm.integrations.easyr1.patch()`` replaces all of them (and any copy a module made);
settings rlk_mm does not implement (``loss_type`` cispo/sapo, ``kl_penalty=full``) run
EasyR1's own functions, said once in the log. EasyR1's trainer and actors run in Ray
workers, so patch() must run there, before EasyR1's code: make it Ray's
``worker_process_setup_hook``. Without editing EasyR1, for its single-node launch::

    RAY_RUNTIME_ENV_HOOK=rlk_mm.integrations.easyr1.runtime_env_hook \
        python3 -m verl.trainer.main config=examples/config.yaml ...

(adds the hook to the ``runtime_env`` of EasyR1's own ``ray.init``), or, with
``ray job submit --runtime-env=examples/runtime_env.yaml``, one more line in that file::

    worker_process_setup_hook: rlk_mm.integrations.easyr1.patch

Nothing else changes: ``worker.actor.loss_type``, ``loss_avg_mode``,
``clip_ratio_low/high/dual`` and ``algorithm.adv_estimator`` keep their meaning. This script
runs one micro-step the way EasyR1's ``dp_actor.update_policy`` does, with rlk_mm's
functions, on synthetic data (EasyR1 itself need not be installed).

    python examples/easyr1_swap.py
"""

from __future__ import annotations

import numpy as np
import torch

from rlk_mm.integrations.easyr1 import (
    average_loss,
    compute_grpo_outcome_advantage,
    compute_kl,
    compute_policy_loss,
    runtime_env_hook,
)


def main() -> None:
    torch.manual_seed(0)
    B, R, n = 8, 10, 4  # 2 prompts x 4 responses
    index = np.array([f"q{i // n}" for i in range(B)], dtype=object)
    response_mask = (torch.arange(R)[None] < torch.randint(2, R + 1, (B,))[:, None]).long()
    token_level_rewards = torch.zeros(B, R)
    token_level_rewards[:, 0] = torch.rand(B)

    # ray_trainer.compute_advantage -> ADV_ESTIMATOR_MAP["grpo"]
    advantages, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)

    # dp_actor.update_policy, one micro-batch, EasyR1's defaults (clip high 0.3, token averaging)
    old_log_probs = -torch.rand(B, R) * 2
    ref_log_probs = old_log_probs + 0.05 * torch.randn(B, R)
    log_probs = (old_log_probs + 0.1 * torch.randn(B, R)).requires_grad_()
    pg_loss, pg_metrics = compute_policy_loss(
        old_log_probs=old_log_probs, log_probs=log_probs, advantages=advantages, response_mask=response_mask,
        clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_dual=3.0, tau_positive=1.0, tau_negative=1.05,
        loss_type="default", loss_avg_mode="token",
    )
    kld = compute_kl(log_probs=log_probs, ref_log_probs=ref_log_probs, kl_penalty="low_var_kl")
    kl_loss = average_loss(kld, response_mask, mode="token")
    loss = pg_loss + kl_loss * 0.01
    loss.backward()
    print(f"pg_loss {pg_loss.item():.6f}  kl_loss {kl_loss.item():.6f}  grad norm {log_probs.grad.norm().item():.6f}")
    print("metrics", {k: round(v, 6) for k, v in pg_metrics.items()})
    # what RAY_RUNTIME_ENV_HOOK makes of the runtime_env EasyR1's main passes to ray.init
    print("runtime_env", runtime_env_hook({"env_vars": {"TOKENIZERS_PARALLELISM": "true"}}))


if __name__ == "__main__":
    main()
