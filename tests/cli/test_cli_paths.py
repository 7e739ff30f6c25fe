"""The CLI's output paths: a --png path is a file name with a picture suffix
in an existing folder, checked at parse time (exit 2 naming the option); the file written is
the path given."""

import pytest

from rlk_mm import RLBatch
from rlk_mm.cli import main


@pytest.fixture(scope="module")
def saved(processor, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "batch.safetensors"
    RLBatch.from_token_lists([[1, 2, 3]], [[4, 151645]], processor=processor).save(path)
    return path


@pytest.mark.parametrize("png, match", [
    ("{dir}", r"argument --png: .* is a folder: give a file name inside it"),
    ("", r"argument --png: an empty path"),
    ("{dir}/out", r"argument --png: .*out: give a file name ending in .png, .pdf, .svg, .jpg, .jpeg"),
    ("{dir}/x.xyz", r"argument --png: .*x.xyz: give a file name ending in .png"),
    ("{dir}/missing/x.png", r"argument --png: .*the folder .*missing does not exist"),
])
def test_bad_png_paths_exit_2_at_parse_time(saved, tmp_path, capsys, png, match):
    code = main(["inspect", str(saved), "--png", png.format(dir=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert pytest.importorskip("re").search(match, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("name", ["layout.png", "layout.PNG", "layout.svg"])
def test_the_file_written_is_the_path_given(saved, tmp_path, capsys, name):
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    assert main(["inspect", str(saved), "--png", str(path)]) == 0
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [name]
    assert str(path) in capsys.readouterr().out


def test_invariance_png_checked_before_the_sweep(tmp_path, capsys):
    code = main(["invariance", "--png", str(tmp_path / "chart.xyz")])
    assert code == 2 and "argument --png" in capsys.readouterr().err
