"""rlk_mm's fused policy loss and vectorized GRPO inside verl 0.9.1.

Installing rlk-mm declares a ``verl.plugins`` entry point; verl imports it in the driver and
in every worker, so a run only needs the names on its command line::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm \\
        algorithm.adv_estimator=rlk_mm_grpo

(``rlk_mm_gspo`` and ``rlk_mm_rloo`` likewise; ``RLK_MM_VERL_FUSED=1`` also turns on the
fused LM-head log-probs.) This script makes the same calls verl's trainer and actor make,
on a synthetic GRPO step, and checks them against verl's own ``grpo`` and ``vanilla``.

    python examples/verl_policy_loss.py
"""

from __future__ import annotations

import numpy as np
import torch
import verl  # noqa: F401  (loads the rlk_mm entry point when rlk-mm is installed)
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

import rlk_mm.integrations.verl  # noqa: F401  (registers explicitly, e.g. from a source checkout)


def main() -> None:
    torch.manual_seed(0)
    prompts, n, R = 4, 4, 12  # 4 prompts x 4 responses of up to 12 tokens
    B = prompts * n
    uid = np.array([f"prompt-{i // n}" for i in range(B)], dtype=object)
    lengths = torch.randint(3, R + 1, (B,))
    response_mask = (torch.arange(R)[None] < lengths[:, None]).float()
    token_level_rewards = torch.zeros(B, R)
    token_level_rewards[torch.arange(B), lengths - 1] = (torch.rand(B) > 0.5).float()  # reward on the last token

    # trainer side: algorithm.adv_estimator=rlk_mm_grpo
    estimator = core_algos.get_adv_estimator_fn("rlk_mm_grpo")
    advantages, _ = estimator(token_level_rewards=token_level_rewards, response_mask=response_mask, index=uid,
                              config=AlgoConfig(norm_adv_by_std_in_grpo=True))
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(token_level_rewards.clone(), response_mask, uid)
    print(f"advantages: max |rlk_mm_grpo - verl grpo| = {(advantages - verl_adv).abs().max().item():.2e}")

    # actor side: actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm
    config = ActorConfig(strategy="fsdp", rollout_n=n, ppo_micro_batch_size_per_gpu=B, clip_ratio_high=0.28,
                         policy_loss=PolicyLossConfig(loss_mode="rlk_mm"))
    old_log_prob = -torch.rand(B, R) * 3
    log_prob = (old_log_prob + 0.1 * torch.randn(B, R)).requires_grad_()
    loss_fn = core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)  # as verl's ppo_loss does
    loss, metrics = loss_fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                            response_mask=response_mask.bool(), loss_agg_mode=config.loss_agg_mode, config=config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    ref_loss, ref_metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask.bool(), config.loss_agg_mode, config)
    (ref_grad,) = torch.autograd.grad(ref_loss, log_prob)
    print(f"loss {loss.item():.6f} (verl vanilla {ref_loss.item():.6f}), "
          f"max |grad diff| {(grad - ref_grad).abs().max().item():.2e}")
    print("metrics", {k: round(v, 6) for k, v in metrics.items()}, "verl",
          {k: round(v, 6) for k, v in ref_metrics.items()})


if __name__ == "__main__":
    main()
