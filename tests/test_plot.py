import json

import numpy as np

from jaxlm import cli


def _fake_run(run_dir, slope):
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, 201):
            r = {"step": s, "loss": 4.0 * np.exp(-s / (60 * slope)) + 1.0, "lr": 1e-3}
            if s % 20 == 0:
                r.update(tokens_per_s=1000.0 * slope + s, mfu=0.1 * slope, val_loss=r["loss"] + 0.1)
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps({"step": 200, "goodput": 0.8, "goodput_wall_s": 10.0}) + "\n")


def test_plot_writes_a_png_with_each_runs_curves(tmp_path, capsys):
    import matplotlib.image

    _fake_run(tmp_path / "a", 1.0)
    _fake_run(tmp_path / "b", 2.0)
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(out)[..., :3]
    h, w, _ = img.shape
    # Matplotlib's first two colors, C0 (31, 119, 180) and C1 (255, 127, 14), drawn in each of the three panels.
    for rgb in ((31, 119, 180), (255, 127, 14)):
        hit = np.all(np.abs(img * 255 - rgb) < 8, axis=-1)
        for panel in range(3):
            assert hit[:, panel * w // 3:(panel + 1) * w // 3].sum() > 100, (rgb, panel)


def test_plot_of_a_folder_without_metrics_fails_with_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl not found" in err and err.count("\n") == 1
