"""rlk_mm as verl's fused-kernel backend, switched on with four overrides.

In a verl 0.9.1 run, the overrides of the verl guide (``docs/guides/verl.md``) select rlk_mm's
loss, turn on verl's fused kernels with the ``torch`` backend and set ``RLK_MM_VERL_FUSED=1`` in
every Ray worker's environment; rlk_mm's ``verl.plugins`` entry point then replaces
``FusedLinearForPPO`` in every worker and scores only response tokens::

    python -m verl.trainer.main_ppo \\
        actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm \\
        actor_rollout_ref.model.use_fused_kernels=True \\
        actor_rollout_ref.model.fused_kernel_options.impl_backend=torch \\
        '+ray_kwargs.ray_init.runtime_env.env_vars.RLK_MM_VERL_FUSED="1"' \\
        ...                                        # the rest of your config

(the value in double quotes for Hydra, which would read a bare ``1`` as a number where Ray takes
only strings; the override in single quotes for the shell), or, in a YAML config::

    actor_rollout_ref:
      actor:
        policy_loss:
          loss_mode: rlk_mm
      model:
        use_fused_kernels: true
        fused_kernel_options:
          impl_backend: torch
    ray_kwargs:
      ray_init:
        runtime_env:
          env_vars:
            RLK_MM_VERL_FUSED: "1"

In your own code, ``rlk_mm.integrations.verl.enable()`` / ``disable()`` do the same.

This script runs verl's own model patch (``patch_forward_with_backends``, as verl's FSDP
engine applies it) on a tiny randomly initialised Qwen2 model on the CPU, first with
verl's ``FusedLinearForPPO`` and then with rlk_mm's, and prints both outputs side by side.

    python examples/verl_fused_kernels.py
"""

from __future__ import annotations

import torch


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    from rlk_mm.integrations import verl as rlk_verl

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    input_ids = torch.randint(0, config.vocab_size, (2, 16))

    def run():
        model.zero_grad()
        out = model(input_ids=input_ids, temperature=0.7, return_dict=True)
        (out.log_probs.sum() + 0.01 * out.entropy.sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()

    verl_logp, verl_ent, verl_grad = run()
    rlk_verl.enable()  # what RLK_MM_VERL_FUSED=1 does through the plugin entry point
    try:
        ours_logp, ours_ent, ours_grad = run()
    finally:
        rlk_verl.disable()
    print("log-probs, first sample (verl | rlk_mm):")
    for a, b in zip(verl_logp[0, :6].tolist(), ours_logp[0, :6].tolist()):
        print(f"  {a:10.5f}  {b:10.5f}")
    print(f"max |Δ log-prob| = {(verl_logp - ours_logp).abs().max():.2e}, "
          f"max |Δ entropy| = {(verl_ent - ours_ent).abs().max():.2e}, "
          f"LM-head grad rel. diff = {((verl_grad - ours_grad).norm() / verl_grad.norm()):.2e}")


if __name__ == "__main__":
    main()
