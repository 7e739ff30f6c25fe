"""Can the smoke policy learn a smoke task at all? Supervised steps on the task's right
answers, and every ``--eval-every`` steps the share of held-out prompts whose right answer the
policy scores highest among the task's candidate answers (chance: one over their number).

A task that GRPO does not learn but this probe learns points at the RL loop (exploration,
reward, schedule); a task this probe does not learn either is beyond the policy as built.
Candidates: ``colour``: the four answer colours; ``point``: the centre of the screen's one
shape moved to each of the three strips; ``point-three``: the centre of each of the screen's
three shapes; ``video``: the four directions.

    python -m bench.supervised_probe --task point --steps 800 --device cuda --out $OUT
    python -m bench.supervised_probe --task point-three --size 512,8,4,256 --rope-theta 10 --out $OUT

Writes a ``supervised_probe`` result labelled with the task (settings and the accuracy curve)
under ``--out``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlk_mm import RLBatch
from rlk_mm.fixtures import Sample, processor_inputs
from rlk_mm.fixtures.palette import ANSWER_COLOURS
from rlk_mm.grounding import Convention
from rlk_mm.smoke.policy import TINY_MODEL, load_policy, policy_logprobs
from rlk_mm.smoke.tasks import colour, point, video

from .common import add_output_args, write_result

SIZE_KEYS = ("hidden_size", "num_layers", "vision_depth", "vision_hidden_size")


def point_candidates(sample: Sample) -> tuple[list[str], int]:
    """``point-three``: the centre of each shape of the screen, and the index of the named one;
    ``point`` (one shape): its centre moved to each third, and the index of its own third."""
    convention = Convention(sample.meta["convention"])
    masks = sample.meta["masks"]
    if len(masks) == 3:
        names = sorted(masks)
        texts = [point.answer_point(point.mask_centre(masks[c]), sample.meta["size"], convention) for c in names]
        return texts, names.index(sample.meta["colour"])
    mask = masks[sample.meta["colour"]]
    (cx, cy), width = point.mask_centre(mask), sample.meta["size"][0]
    edges = point.third_edges(width)
    own = next(k for k in range(3) if mask[:, edges[k]:edges[k + 1]].any())
    texts = [point.answer_point((cx + edges[k] - edges[own], cy), sample.meta["size"], convention) for k in range(3)]
    return texts, own


def examples(task: str, rng: random.Random, n: int, stream: str) -> list[tuple[Sample, list[str], int]]:
    """``n`` (sample, candidate answers, index of the right one) of ``task``."""
    if task.startswith("point"):
        shapes = 3 if task == "point-three" else 1
        return [(s, *point_candidates(s)) for s in point.point_task(shapes=shapes).batch(rng, n, stream)]
    if task == "video":
        return [(s, list(video.DIRECTIONS), video.DIRECTIONS.index(s.answer))
                for s in video.video_direction_task().batch(rng, n, stream)]
    labels = list(ANSWER_COLOURS)
    return [(s, labels, labels.index(s.answer)) for s in colour.colour_task().batch(rng, n, stream)]


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("colour", "point", "point-three", "video"), default="point")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3, the warm-up's)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--size", default=",".join(str(TINY_MODEL[k]) for k in SIZE_KEYS),
                    help="policy sizes: hidden, layers, vision blocks, vision width (default: the smoke policy's)")
    ap.add_argument("--rope-theta", type=float, default=1e6, help="the LM's rotary base (default 1e6, Qwen2.5-VL's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.size.split(",")]
    if len(sizes) != 4 or min(sizes) < 1 or args.steps < 0 or args.eval_every < 1:
        ap.error("--size takes 4 positive integers (hidden, layers, vision blocks, vision width); --steps >= 0, "
                 "--eval-every >= 1")
    args.sizes = dict(zip(SIZE_KEYS, sizes))
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    torch.manual_seed(args.seed)
    policy = load_policy(None, args.seed, torch.device(args.device), torch.float32,
                         tiny={**args.sizes, "rope_theta": args.rope_theta})
    model = policy.model
    model.requires_grad_(True)
    model.get_input_embeddings().weight.requires_grad_(False)  # as the smoke warm-up trains
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def answer_logprobs(samples: list[Sample], answers: list[str]) -> torch.Tensor:
        """Each answer's summed log-prob (its tokens and EOS) after its prompt."""
        responses = [policy.tokenizer.encode(point_or_word(a)) + policy.eos_ids for a in answers]
        inputs = processor_inputs(policy.processor, samples, padding_side="left")
        batch = RLBatch.from_qwen_vl(inputs, processor=policy.processor, responses=responses)
        per_token = policy_logprobs(policy, model, batch, 1.0)
        return torch.stack([t.sum() for t in per_token.split([len(r) for r in responses])])

    point_or_word = (lambda a: '{"point_2d": [%s]}' % a) if args.task.startswith("point") else (lambda a: a)
    held_out = examples(args.task, random.Random(f"{args.seed}:eval"), args.eval_prompts, "eval")

    def accuracy() -> float:
        with torch.no_grad():
            samples = [s for s, texts, _ in held_out for _ in texts]
            scores = answer_logprobs(samples, [t for _, texts, _ in held_out for t in texts])
        right, start = 0, 0
        for _, texts, index in held_out:
            right += int(scores[start : start + len(texts)].argmax()) == index
            start += len(texts)
        return right / len(held_out)

    rng, curve, t0 = random.Random(f"{args.seed}:train"), [], time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            curve.append([step, round(accuracy(), 4)])
            print(f"step {step}: held-out accuracy {curve[-1][1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if step == args.steps:
            break
        batch = examples(args.task, rng, args.prompts, f"train{step}")
        loss = -answer_logprobs([s for s, _, _ in batch], [texts[i] for _, texts, i in batch]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    data = {"task": args.task, "chance": round(1 / len(held_out[0][1]), 4),
            "settings": {"steps": args.steps, "lr": args.lr, "prompts": args.prompts, "eval_prompts": args.eval_prompts,
                         "sizes": args.sizes, "rope_theta": args.rope_theta, "device": args.device, "seed": args.seed},
            "curve": curve, "seconds": round(time.perf_counter() - t0, 1)}
    write_result(args.out, "supervised_probe", data, shapes=data["settings"],
                 label=args.task if args.label == "default" else args.label,
                 card="cpu" if str(args.device).startswith("cpu") else None)
    return data


if __name__ == "__main__":
    main()
