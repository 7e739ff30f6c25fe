"""The image-text GRPO smoke test as a script: the same run as `rlk-mm smoke` (`make smoke`).

    python examples/grpo_smoke.py                      # colour task, tiny Qwen2.5-VL, CPU
    python examples/grpo_smoke.py --data ../shared/geo3k --steps 2
    python examples/grpo_smoke.py --break adv-sign     # watch the learning check catch it

Options: `python examples/grpo_smoke.py --help`. The code lives in `rlk_mm/smoke/`:
rollout with `generate`, the four gates, and GRPO through `selected_logprob`,
`scatter_rewards`, `group_advantages` and `policy_loss`.
"""

import argparse
import sys

from rlk_mm.smoke import add_smoke_parser

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="grpo_smoke.py")
    add_smoke_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["smoke", *sys.argv[1:]])
    sys.exit(args.func(args))
