"""rlk_mm's EasyR1 adapter against EasyR1's own functions, read from an EasyR1 checkout.

    python tests/integrations/frameworks/easyr1_equivalence.py /path/to/EasyR1 [--json out.json]

EasyR1 is not on PyPI and CI cannot fetch it, so this runs where a checkout is at hand
(``tests/integrations/test_easyr1.py`` runs it when ``RLK_MM_EASYR1_SRC`` names one). The checkout goes
first on ``sys.path``, so ``verl`` is EasyR1's package here, whatever else is installed.
Compared, fp32, over seeded batches with clamped ratios, dual clip and empty rows:
``compute_policy_loss`` (loss, gradient, metrics), ``compute_kl``, ``average_loss``, GRPO
and RLOO advantages; then ``patch()`` on EasyR1's module: its fallbacks must return exactly
what EasyR1's own functions return. It also lists which EasyR1 modules import names from
``core_algos`` (what ``patch()`` must reach). Prints a JSON report; exits 1 when a
difference exceeds the numerical contract (``rlk_mm.parity.contract``), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import numpy as np
import torch


def batch(seed: int, B: int, R: int, near: float):
    """log-probs, old log-probs (``near``: spread of the log-ratio), advantages and an int mask,
    with one log-ratio beyond the ±20 clamp, one in the dual-clip region and one empty row."""
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, R, generator=g) * 0.5 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, R, generator=g) * near
    old[0, :2] = logp[0, :2].detach() + torch.tensor([22.0, -1.2])
    adv = torch.randn(B, R, generator=g)
    mask = (torch.arange(R)[None] < torch.randint(1, R + 1, (B,), generator=g)[:, None]).long()
    mask[B // 2] = 0
    return logp, old, adv, mask


def max_abs(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


def compare_policy_loss(core, easyr1) -> dict:
    out = {}
    for loss_type in ("default", "gspo", "gspo_token"):
        for mode in ("token", "seq"):
            worst = {"loss": 0.0, "grad": 0.0, "metrics": 0.0}
            for seed, (B, R) in enumerate([(6, 17), (16, 64), (32, 200), (3, 2)]):
                logp, old, adv, mask = batch(seed, B, R, 0.3 if loss_type == "default" else 0.05)
                args = (old, logp, adv, mask, 0.2, 0.3, 3.0, 1.0, 1.05, loss_type, mode)
                theirs, m_theirs = core.compute_policy_loss(*args)
                (g_theirs,) = torch.autograd.grad(theirs, logp)
                ours, m_ours = easyr1.compute_policy_loss(*args)
                (g_ours,) = torch.autograd.grad(ours, logp)
                if m_ours.keys() != m_theirs.keys():
                    raise AssertionError(f"metric names differ: {sorted(m_ours)} vs {sorted(m_theirs)}")
                worst["loss"] = max(worst["loss"], max_abs(ours.detach(), theirs.detach()))
                worst["grad"] = max(worst["grad"], max_abs(g_ours, g_theirs))
                worst["metrics"] = max(worst["metrics"], *(abs(m_ours[k] - m_theirs[k]) for k in m_theirs))
            out[f"{loss_type}/{mode}"] = worst
    return out


def compare_kl_and_average(core, easyr1) -> dict:
    out = {}
    logp, old, _, mask = batch(7, 16, 64, 3.0)
    old[1, :3] = logp[1, :3].detach() + torch.tensor([-25.0, 25.0, 15.0])  # the ±20 and ±10 clamps of low_var_kl
    for kind in ("kl", "abs", "mse", "low_var_kl"):
        for dtype in (torch.float32, torch.bfloat16):
            a, b = logp.detach().to(dtype), old.to(dtype)
            key = f"compute_kl/{kind}/{str(dtype)[6:]}"
            out[key] = max_abs(easyr1.compute_kl(a, b, kind), core.compute_kl(a, b, kind))
    for mode in ("token", "seq"):
        out[f"average_loss/{mode}"] = max_abs(easyr1.average_loss(logp.detach(), mask, mode),
                                              core.average_loss(logp.detach(), mask, mode))
    return out


def compare_advantages(core, easyr1) -> dict:
    out = {}
    g = torch.Generator().manual_seed(11)
    for name in ("grpo", "rloo"):
        for case, n in (("binary", 8), ("float", 5), ("float_ties", 7)):
            groups = 64
            B, R = groups * n, 9
            if case == "binary":
                scores = torch.randint(0, 2, (B,), generator=g).float()
            elif case == "float":
                scores = torch.rand(B, generator=g)
            else:  # equal scores in each group: EasyR1's GRPO turns the rounding of its mean into an
                # advantage (~0.06 for 7 scores of 0.7); rlk_mm centres on the first score and gives 0
                scores = torch.tensor([0.1, 0.2, 0.3, 0.7,
                                       0.9])[torch.randint(0, 5, (groups,), generator=g)].repeat_interleave(n)
            order = torch.randperm(B, generator=g)  # groups in any order
            scores = scores[order]
            index = np.array([f"uid-{int(b) // n}" for b in order], dtype=object)
            mask = (torch.arange(R)[None] < torch.randint(1, R + 1, (B,), generator=g)[:, None]).long()
            rewards = torch.zeros(B, R)
            rewards[torch.arange(B), mask.sum(-1) - 1] = scores
            theirs, _ = core.ADV_ESTIMATOR_MAP[name](token_level_rewards=rewards.clone(), response_mask=mask,
                                                     index=index)
            estimator = getattr(easyr1, f"compute_{name}_outcome_advantage")
            ours, _ = estimator(token_level_rewards=rewards, response_mask=mask, index=index)
            out[f"{name}/{case}"] = max_abs(ours, theirs)
    return out


def check_patch(core, easyr1) -> dict:
    """After ``patch()``: rlk_mm's functions for the supported settings, EasyR1's own (bitwise) for the rest."""
    originals = {name: getattr(core, name) for name in easyr1.SUPPORTED}
    original_map = dict(core.ADV_ESTIMATOR_MAP)
    replaced = easyr1.patch()
    logp, old, adv, mask = batch(3, 6, 17, 0.3)
    for loss_type in ("cispo", "sapo"):
        args = dict(old_log_probs=old, log_probs=logp, advantages=adv, response_mask=mask, clip_ratio_low=0.2,
                    clip_ratio_high=0.3, clip_ratio_dual=3.0, tau_positive=1.0, tau_negative=1.05, loss_type=loss_type,
                    loss_avg_mode="token")
        (theirs, m_theirs), (patched,
                             m_patched) = originals["compute_policy_loss"](**args), core.compute_policy_loss(**args)
        assert torch.equal(theirs, patched) and m_theirs == m_patched, loss_type
    full = (torch.randn(4, 5, 7).log_softmax(-1), torch.randn(4, 5, 7).log_softmax(-1))
    assert torch.equal(core.compute_kl(*full, kl_penalty="full"), originals["compute_kl"](*full, kl_penalty="full"))
    values = logp.detach()
    assert torch.equal(core.average_loss(values, mask, "seq", eps=1e-6),
                       originals["average_loss"](values, mask, "seq", eps=1e-6))
    args = dict(old_log_probs=old, log_probs=logp, advantages=adv, response_mask=mask, clip_ratio_low=0.2,
                clip_ratio_high=0.3,
                clip_ratio_dual=3.0, tau_positive=1.0, tau_negative=1.05, loss_type="gspo", loss_avg_mode="seq")
    assert torch.equal(core.compute_policy_loss(**args)[0], easyr1.compute_policy_loss(**args)[0])
    assert core.compute_advantage_return.__module__ == core.__name__  # EasyR1's lookup, now reaching rlk_mm's GRPO
    assert core.ADV_ESTIMATOR_MAP["grpo"] is not original_map["grpo"]
    assert all(core.ADV_ESTIMATOR_MAP[k] is v for k, v in original_map.items() if k not in easyr1.ADVANTAGES)
    assert easyr1.patch() == replaced  # idempotent
    return {"replaced": replaced, "fallbacks": "cispo, sapo, kl_penalty='full', eps=1e-6: bitwise EasyR1's own"}


def core_algos_importers(root: Path) -> dict[str, list[str]]:
    """EasyR1 modules that import names from ``core_algos``, and the names."""
    out = {}
    for path in sorted((root / "verl").rglob("*.py")):
        names = [alias.name for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("core_algos")
                 for alias in node.names]
        if names:
            out[".".join(path.relative_to(root).with_suffix("").parts)] = sorted(names)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("easyr1", type=Path, help="an EasyR1 checkout (holds verl/trainer/core_algos.py)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if not (args.easyr1 / "verl" / "trainer" / "core_algos.py").is_file():
        parser.error(f"{args.easyr1} holds no verl/trainer/core_algos.py: pass an EasyR1 checkout")
    sys.path.insert(0, str(args.easyr1.resolve()))
    import verl.trainer.core_algos as core

    from rlk_mm.integrations import easyr1
    from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS

    torch.backends.cuda.matmul.allow_tf32 = False
    tolerance = ELEMENTWISE_LOSS_MAX_ABS.fp32
    report = {
        "easyr1": str(args.easyr1), "core_algos": core.__file__, "tolerance_fp32": tolerance,
        "policy_loss": compare_policy_loss(core, easyr1), "kl_and_average": compare_kl_and_average(core, easyr1),
        "advantages": compare_advantages(core, easyr1), "core_algos_importers": core_algos_importers(args.easyr1),
    }
    report["patch"] = check_patch(core, easyr1)
    checked = [v for case in report["policy_loss"].values() for v in case.values()]
    checked += list(report["kl_and_average"].values())
    checked += [v for k, v in report["advantages"].items() if not k.endswith("float_ties")]  # a documented difference
    report["within_contract"] = max(checked) <= tolerance
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["within_contract"] else 1


if __name__ == "__main__":
    sys.exit(main())
