"""verl 0.9.1's bypass mode (``algorithm.rollout_correction.bypass_mode=True``), the setting that
skips the old-log-prob recompute, as its trainer applies it (``apply_bypass_mode``, from the
installed wheel): it copies ``rollout_log_probs`` into ``old_log_probs`` and rewrites
``policy_loss.loss_mode`` to its own ``bypass_mode`` loss, so a ``loss_mode=rlk_mm`` set by the
user is switched off in that mode. The on-policy guide's verl section rests on this; if verl
changes it, this test says so."""

import pytest
import torch

from support.helpers import skip_module_without_verl

skip_module_without_verl()  # an installed verl that fails to import errors below, never skips
from omegaconf import OmegaConf  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode  # noqa: E402

from rlk_mm.integrations import verl  # noqa: E402


def test_bypass_mode_uses_rollout_log_probs_and_replaces_the_loss_mode():
    verl.register()
    rollout = torch.randn(2, 5)
    batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": torch.ones(2, 5)})
    policy_loss = OmegaConf.create({"loss_mode": "rlk_mm"})
    apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True, "loss_type": "ppo_clip"}), policy_loss)
    assert torch.equal(batch.batch["old_log_probs"], rollout)  # the recompute is skipped: rollout's numbers
    assert policy_loss.loss_mode == "bypass_mode"  # rlk_mm's loss mode is gone
    assert get_policy_loss_fn("rlk_mm") is not get_policy_loss_fn("bypass_mode")


def test_bypass_mode_needs_rollout_log_probs():
    batch = DataProto.from_dict(tensors={"response_mask": torch.ones(2, 5)})
    with pytest.raises(ValueError, match="bypass_mode=True requires rollout_log_probs"):
        apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True}), OmegaConf.create({"loss_mode": "rlk_mm"}))
