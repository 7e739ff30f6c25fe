"""The image-text GRPO smoke test as a script: the same run as `rlk-mm smoke` (`make smoke`).

    python examples/grpo_smoke.py                      # colour task, tiny Qwen2.5-VL, CPU
    python examples/grpo_smoke.py --task geo3k --steps 2       # the 3 Geo3K problems in the package (or --data DIR)
    python examples/grpo_smoke.py --break adv-sign     # watch the learning check catch it

Options: `python examples/grpo_smoke.py --help`. The code lives in `rlk_mm/smoke/`:
rollout with `generate`, the four gates, and GRPO through `selected_logprob`,
`scatter_rewards`, `group_advantages` and `policy_loss`.
"""

import sys

from rlk_mm.smoke.cli import main

if __name__ == "__main__":
    sys.exit(main())  # exit codes as `rlk-mm smoke`: 0 passed, 1 a gate or learning failed, 2 bad input, 3 internal
