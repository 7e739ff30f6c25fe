"""The invariance sweep on the tiny Qwen2.5-VL with the real processor: bitwise in every
case under batch_invariant() (torch path; Triton path under TRITON_INTERPRET=1 on a
subset, scoring hidden states since the interpreted LM head over V=151669 takes minutes);
a planted drift is located by the probe; report files and the CLI."""

import json

import pytest

from rlk_mm import fixtures
from rlk_mm.cli import main as cli_main
from rlk_mm.parity.invariance import CASES, MODES, VIDEO_CASES, InvarianceReport, invariance_sweep

#: the torch reference matmul is many small fixed-shape products: one thread is fastest
pytestmark = pytest.mark.usefixtures("one_thread")


def test_sweep_torch_path_is_bitwise_in_every_case(tiny_model, processor, tmp_path):
    model = tiny_model
    samples = fixtures.synthetic_image_text(3, seed=0)
    report = invariance_sweep(model, processor, samples, backend="torch", group_size=3, response_length=6)
    rows = {(r.case, r.detail, r.mode) for r in report.results}
    assert {r.case for r in report.results} == set(CASES) - set(VIDEO_CASES)  # image samples: the video cases do not apply
    assert {r.mode for r in report.results} == set(MODES)
    assert len(rows) == len(report.results) == 2 * (len(CASES) - len(VIDEO_CASES) + 2)  # neighbour_images has 3 rows
    for r in report.results:
        assert r.tokens > 0
        if r.mode == "batch_invariant":
            assert r.bitwise and r.max_abs_diff == 0.0 and r.divergence is None, r
        elif not r.bitwise:  # the control may drift on CPU; when it does the probe says where
            assert r.divergence is not None and r.max_abs_diff > 0
    assert report.invariant
    data = json.loads(report.save_json(tmp_path / "inv.json").read_text())
    assert data["invariant"] and len(data["results"]) == len(report.results)
    assert InvarianceReport.from_dict(data).results == report.results
    assert report.save_png(tmp_path / "inv.png").stat().st_size > 10_000
    assert "group_cache" in report.table()


def test_video_case_whole_vs_frame_by_frame_is_bitwise(tiny_model, processor):
    samples = fixtures.synthetic_video_text(2, seed=0, num_frames=4, with_image=True) + fixtures.synthetic_image_text(1, seed=1)
    report = invariance_sweep(tiny_model, processor, samples, cases=["video_frames"], backend="torch", response_length=4)
    by_mode = {r.mode: r for r in report.results}
    assert set(by_mode) == set(MODES) and all(r.case == "video_frames" and r.detail == "2 with video" for r in report.results)
    invariant = by_mode["batch_invariant"]
    assert invariant.bitwise and invariant.max_abs_diff == 0.0 and invariant.tokens == 2 * 4
    control = by_mode["default"]
    assert control.bitwise or control.divergence is not None  # a CPU drift, if any, is located
    with pytest.raises(ValueError, match=r"\['video_frames'\] need samples with videos"):
        invariance_sweep(tiny_model, processor, fixtures.synthetic_image_text(2, seed=0), cases=["video_frames"])


def test_sweep_triton_path_is_bitwise(tiny_model, processor):
    model = tiny_model
    samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    report = invariance_sweep(model, processor, samples, backend="triton", score="hidden", control=False,
                              cases=["batch_size", "packed", "padding_side", "group_cache"],
                              group_size=2, response_length=4)
    assert [r.case for r in report.results] == ["batch_size", "padding_side", "packed", "group_cache"]
    assert report.invariant and all(r.tokens > 0 for r in report.results)


def _perturb_when(module, rows_over: int):
    """Planted drift: add 1e-3 to the module's output whenever it sees more rows than ``rows_over``
    (i.e. only in the batched run of a case, never for a sample alone)."""

    def hook(mod, args, output):
        rows = output.shape[0] * output.shape[1] if output.dim() == 3 else output.shape[0]
        return output + 1e-3 if rows > rows_over else output

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("where", ["model.language_model.layers.1.mlp", "model.visual.blocks.0.mlp.down_proj"])
def test_probe_names_the_planted_layer(own_tiny_model, processor, where):
    model = own_tiny_model  # the test hooks its modules
    samples = fixtures.synthetic_image_text(2, seed=1, max_images=1, sizes=((56, 56),))
    module = model.get_submodule(where)
    # one 56x56 image is 16 patches; a sample alone has < 60 tokens; the batch of 2 exceeds both
    handle = _perturb_when(module, rows_over=16 if "visual" in where else 60)
    try:
        report = invariance_sweep(model, processor, samples, backend="torch", control=False,
                                  cases=["batch_size"], response_length=4)
    finally:
        handle.remove()
    (result,) = report.results
    assert not result.bitwise and result.max_abs_diff > 0
    assert result.divergence.module == where
    assert result.divergence.op == type(module).__name__
    assert result.divergence.max_abs_diff == pytest.approx(1e-3, rel=1e-2)


def test_invariance_cli(tmp_path, capsys):
    argv = ["invariance", "--samples", "2", "--cases", "packed", "prefix_cache", "--no-control",
            "--response-length", "3", "--backend", "torch",
            "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")]
    assert cli_main(argv) == 0
    assert "prefix_cache" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["invariant"] is True
    assert (tmp_path / "r.png").exists()


def test_sweep_rejects_bad_arguments(tiny_model, processor):
    model = tiny_model
    samples = fixtures.synthetic_image_text(2, seed=0)
    with pytest.raises(ValueError, match="unknown invariance cases"):
        invariance_sweep(model, processor, samples, cases=["bogus"])
    with pytest.raises(ValueError, match="score must be"):
        invariance_sweep(model, processor, samples, score="logits")
    with pytest.raises(ValueError, match="at least 2 samples"):
        invariance_sweep(model, processor, samples[:1])
