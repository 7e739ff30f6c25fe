"""Test-only shims for verl 0.9.1's GPU assumptions, so that its actor worker runs on a CPU.

verl's and rlk_mm's code run unmodified; each shim stands in only where verl assumes an
accelerator:

* ``CPUPlatform``: verl asks its platform registry (CUDA, NPU, ROCm) for the device name, the
  device module (memory statistics, RNG, caches) and the collective backend. Registered as
  ``cpu`` on import and chosen by ``VERL_PLATFORM=cpu``; verl imports this module itself, in
  the driver and in every Ray worker, before it loads its plugins
  (``VERL_USE_EXTERNAL_MODULES=verl_cpu``).
* ``CPUEngine`` (``install()``): verl's ``FSDPEngineWithLMHead`` without the FSDP wrapping
  (FSDP1 needs an accelerator; FSDP2 shards ``lm_head`` apart, which verl's fused LM-head path
  cannot read), registered for the ``cpu`` device. Everything else is verl's engine, its
  default bf16 autocast included.
* ``flash_attn_varlen_func`` (``install()``): verl's packed (``use_remove_padding``) Qwen2-VL
  attention calls flash-attn's variable-length kernel, which needs a GPU; the stand-in runs
  torch's SDPA on each sequence of the pack, in the model's dtype (verl's cast of fp32
  queries, keys and values to bf16, which flash-attn needs, is left out).

The worker test adds two more: a one-rank gloo process group made before verl makes its own
(verl asks for ``cpu:gloo,<device>:<backend>``, which torch refuses when the device is the
CPU), and ``attn_implementation=sdpa`` in the model config (verl's default is flash-attn 2).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _zero(*args, **kwargs) -> int:
    return 0


def _nothing(*args, **kwargs) -> None:
    return None


#: ``torch.cpu`` plus the ``torch.cuda`` calls verl makes on its device module (no caches, no statistics)
_DEVICE_MODULE = SimpleNamespace(
    **{name: getattr(torch.cpu, name) for name in ("synchronize", "current_stream", "stream", "Stream", "Event")},
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: "cpu",
    set_device=_nothing,
    empty_cache=_nothing,
    get_device_name=lambda *args: "cpu",
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    reset_peak_memory_stats=_nothing,
    mem_get_info=lambda *args: (0, 0),
    set_per_process_memory_fraction=_nothing,
)


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    """The host CPU as verl's device: gloo collectives, no accelerator resources in Ray."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # verl passes it to .to(); "cpu" is the one CPU device

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, **unused):
    """flash-attn's ``flash_attn_varlen_func`` for ``[T, heads, dim]`` packs, by torch's SDPA
    on each sequence (``cu_seqlens`` bounds; queries and keys alike)."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("the stand-in attends within each sequence: cu_seqlens_q must equal cu_seqlens_k")
    bounds = cu_seqlens_q.tolist()
    pieces = [
        F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1) for t in (q, k,
                                                     v)), dropout_p=dropout_p, is_causal=causal, scale=softmax_scale
        ).transpose(0, 1)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces)


def _keep_dtype(query, key, value, target_dtype=None):
    """verl casts fp32 queries, keys and values to bf16 before flash-attn (which takes half
    precision only); the SDPA stand-in takes them in the model's dtype."""
    return query, key, value


_ENGINES: list = []  # CPUEngine, once registered


def install() -> None:
    """In this process: the attention stand-in in verl's Qwen2-VL module (which reads these
    names only where flash-attn is installed), and ``CPUEngine`` for the ``cpu`` device."""
    from verl.models.transformers import qwen2_vl
    from verl.utils.torch_dtypes import PrecisionType
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    qwen2_vl.flash_attn_varlen_func = flash_attn_varlen_func
    qwen2_vl.fa_peft_integration_check = _keep_dtype
    qwen2_vl._flash_supports_window_size = False
    qwen2_vl._flash_supports_deterministic = False
    qwen2_vl._flash_use_top_left_mask = False
    if not _ENGINES:

        class CPUEngine(FSDPEngineWithLMHead):
            """verl's FSDP engine with the model left unwrapped: one rank holds it all, and
            FSDP's mixed-precision compute dtype is the autocast dtype of verl's forward."""

            def _build_fsdp_module(self, module):
                precision = self.engine_config.mixed_precision or {}
                self._autocast_dtype = PrecisionType.to_dtype(precision.get("param_dtype", "bf16"))
                return module

        _ENGINES.append(EngineRegistry.register(model_type="language_model", backend="fsdp", device="cpu")(CPUEngine))
