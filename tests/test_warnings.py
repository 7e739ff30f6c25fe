"""A user's run is quiet: importing rlk_mm and running its ops (a forward, the fused loss, group
scoring with the KV cache under ``batch_invariant()``, a vocabulary-parallel log-prob over a
one-rank gloo group) raises no warning with warnings as errors, and transformers logs no
deprecation. The fix for a warning is the call that caused it, never a filter."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

RUN = r"""
import os
import torch
import torch.distributed as dist
from rlk_mm import RLBatch
from rlk_mm.fixtures import IM_END_TOKEN_ID, processor_inputs, qwen_vl_processor, synthetic_image_text, tiny_qwen2_5_vl
from rlk_mm.models import batch_logprobs, forward_hidden, group_logprobs
from rlk_mm.ops import batch_invariant, group_advantages, linear_policy_loss, selected_logprob

processor = qwen_vl_processor()
samples = [s for s in synthetic_image_text(1, seed=0, max_images=1) for _ in range(2)]
responses = [processor.tokenizer.encode(a) + [IM_END_TOKEN_ID] for a in ["5", "4"]]
batch = RLBatch.from_qwen_vl(processor_inputs(processor, samples, padding_side="left"), processor=processor,
                             responses=responses, group_ids=[s.id for s in samples], rewards=[1.0, 0.0])
model = tiny_qwen2_5_vl()
hidden = forward_hidden(model, batch)
adv = group_advantages(batch.rewards, batch=batch)[batch.loss_token_sample()]
linear_policy_loss(hidden, model.lm_head.weight, batch, old_log_probs=None, advantages=adv).loss.backward()
with torch.no_grad(), batch_invariant():
    assert torch.equal(batch_logprobs(model, batch), group_logprobs(model, batch))  # the KV-cache path
dist.init_process_group("gloo", rank=0, world_size=1)
h, w = hidden.detach(), model.lm_head.weight.detach()
rows, targets = batch.loss_token_index()
assert torch.equal(selected_logprob(h, w, index=rows, targets=targets),
                   selected_logprob(h, w, index=rows, targets=targets, tp_group=dist.group.WORLD))
dist.destroy_process_group()
print("done")
"""


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_ops_run_without_a_warning():
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    env.pop("PYTHONWARNINGS", None)
    p = subprocess.run([sys.executable, "-W", "error", "-c", RUN], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stdout + p.stderr
    assert "deprecated" not in p.stderr.lower(), p.stderr
