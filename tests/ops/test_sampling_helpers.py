"""The sampling kernels' arithmetic helpers, each against its reference. The integer masses
(``masses``): exp to within 1e-6, the same bits in Triton as in torch. The plain draw's fp32
screen (``best_noise_block``): float64 noise only for the noise blocks whose fp32 score is near
the best, and still the block an argmax over every block's float64 score picks (the first on a
tie); adversarial rows make every block's fp32 score nearly equal, so the screen keeps them all
and the float64 scores decide. Runs under Triton's interpreter on the CPU and natively where
CUDA is present."""

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.ops._torch import sampling as ref
from rlk_mm.ops._triton.sampling.noise import best_noise_block, gumbel32, masses

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, NB, FIRST = 8, 16, 40  # rows, noise blocks, the first block's index


@triton.jit
def _best_kernel(ell_ptr, ka_ptr, kb_ptr, best_ptr, block_ptr, M: tl.constexpr, NB: tl.constexpr, FIRST: tl.constexpr):
    r, c = tl.arange(0, M), tl.arange(0, NB)
    ell = tl.load(ell_ptr + r[:, None] * NB + c[None, :])
    ka, kb = tl.load(ka_ptr + r).to(tl.uint32), tl.load(kb_ptr + r).to(tl.uint32)
    best, block = best_noise_block(ell, (FIRST + c)[None, :], ka, kb)
    tl.store(best_ptr + r, best)
    tl.store(block_ptr + r, block)


@triton.jit
def _gumbel32_kernel(out_ptr, ka, kb, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + i, gumbel32(i, ka.to(tl.uint32), kb.to(tl.uint32)))


@triton.jit
def _masses_kernel(z_ptr, m, out_ptr, n, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, masses(tl.load(z_ptr + i, mask=i < n, other=0.0), m), mask=i < n)


def _triton_masses(z: torch.Tensor, m: float) -> torch.Tensor:
    out = torch.empty(z.numel(), dtype=torch.int64, device=DEVICE)
    _masses_kernel[(1,)](z.to(DEVICE), m, out, z.numel(), N=triton.next_power_of_2(z.numel()), enable_fp_fusion=False)
    return out.cpu()


def test_masses_are_exp_to_1e6_and_the_same_bits_in_triton():
    d = torch.cat([torch.linspace(-40, 0, 4096), torch.tensor([0.0, -0.0, -1e-30, -31.9, -32.0, -32.1, -math.inf]),
                   -torch.rand(4096) * 30])
    got = ref.masses(d)
    exact = torch.exp(d.double()) * 2.0**ref.FIXED_BITS
    assert got[d.numel() - 4096 - 7] == 2**ref.FIXED_BITS and bool((got[d < -32] == 0).all())
    big = exact >= 2**20  # where truncation is below 1e-6 of the mass
    assert ((got.double() - exact).abs() / exact)[big].max() < 1e-6
    assert bool(((got.double() - exact).abs() <= 1e-6 * exact + 1)[~big].all())
    assert torch.equal(_triton_masses(d, 0.0), got)


@settings(max_examples=30, deadline=None)
@given(m=st.floats(-1e4, 1e4, width=32), spread=st.floats(0.125, 100, width=32), seed=st.integers(0, 2**31 - 1))
def test_masses_bits_match_between_torch_and_triton(m, spread, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.tensor(m, dtype=torch.float32) - torch.rand(256, generator=g) * spread
    z[0] = m  # the row's max
    assert torch.equal(_triton_masses(z, m), ref.masses(z - torch.tensor(m, dtype=torch.float32)))


def _keys(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**32, (M,), generator=g), torch.randint(0, 2**32, (M,), generator=g)


def _by_argmax(ell, ka, kb):
    """The reference: every block's float64 score, NaN as -inf, the first best by argmax."""
    blocks = FIRST + torch.arange(NB)
    s = ell.double() + torch.stack([ref.gumbel(blocks, ka[r], kb[r]) for r in range(M)])
    s = torch.where(torch.isnan(s), -math.inf, s)
    best, arg = s.max(1)
    return best, FIRST + s.argmax(1), arg


def _screened(ell, ka, kb):
    best = torch.empty(M, dtype=torch.float64, device=DEVICE)
    block = torch.empty(M, dtype=torch.int32, device=DEVICE)
    _best_kernel[(1,)](ell.to(DEVICE), ka.to(DEVICE), kb.to(DEVICE), best, block, M=M, NB=NB, FIRST=FIRST,
                       enable_fp_fusion=False)
    return best.cpu(), block.cpu().long()


def _near_ties(ka, kb, level: float) -> torch.Tensor:
    """Rows whose fp32 scores all but tie: ell = fp32(level - float64 noise)."""
    blocks = FIRST + torch.arange(NB)
    return torch.stack([(level - ref.gumbel(blocks, ka[r], kb[r])).float() for r in range(M)])


@pytest.mark.parametrize("case", ["random", "near ties", "near ties at 1e4", "masked", "nan", "equal"])
def test_screen_picks_the_argmax_block(case):
    ka, kb = _keys(hash(case) % 1000)
    g = torch.Generator().manual_seed(7)
    ell = torch.randn(M, NB, generator=g) * 3
    if case == "near ties":
        ell = _near_ties(ka, kb, 2.5)
    elif case == "near ties at 1e4":
        ell = _near_ties(ka, kb, 1e4)
    elif case == "masked":
        ell[0] = -math.inf  # a row masked whole: -inf at its first block
        ell[1, ::2] = -math.inf
    elif case == "nan":
        ell[2, 3] = math.nan
    elif case == "equal":
        ell[:] = 0.0
    best, block = _screened(ell, ka, kb)
    want_best, want_block, _ = _by_argmax(ell, ka, kb)
    assert torch.equal(block, want_block), (case, block, want_block)
    assert torch.equal(best, want_best), case


def test_the_fp32_noise_is_within_the_screen_of_the_float64_noise():
    n, ka, kb = 1 << 14, 0x1234567, 0x89ABCDE
    got = torch.empty(n * 4, dtype=torch.float32, device=DEVICE)
    _gumbel32_kernel[(4,)](got, ka, kb, N=n)
    want = ref.gumbel(torch.arange(n * 4), torch.tensor(ka), torch.tensor(kb))
    err = (got.cpu().double() - want).abs().max().item()
    assert err < 1e-5, err  # the screen's margin is 1e-4: ten times this
