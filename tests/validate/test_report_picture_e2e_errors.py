"""What the validation report shows when the end-to-end child cannot run, how the picture draws
every part of the report against its own thresholds, and what ``validate -q`` still prints.

The zero-token and no-kernel cases run the real child on real copies of the tiny checkpoint; the
SIGTERM case runs ``run_end_to_end`` in a subprocess with a stand-in child that reports through a
FIFO, so every step is ordered by a pipe, not by time."""
from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_build.pipeline.cli import main
from hybrid_build.validate import transformers_forward
from hybrid_build.validate.report import FAIL_COLOR, PASS_COLOR, render_figure, validate_artifact

SE = "model.language_model.layers.{}.mlp.shared_expert.{}_proj"
ESC = "\x1b"


# ------------------------------------------------------------------------------------- item 9: e2e errors


def test_source_without_tokenizer_is_one_sentence_in_the_report(tiny_copy, build_from, tmp_path, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_copy / name).unlink()
    art = build_from(tiny_copy, tmp_path / "hybrid")
    rc = main(["validate", str(art), "--source", str(tiny_copy), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 1 and not rep["passed"]
    error = rep["end_to_end"]["error"]
    assert error.startswith("the source has no tokenizer files (tokenizer.json"), error
    assert "tokenize to 0 tokens" in error and "--no-e2e" in error
    assert "\n" not in error and ESC not in error and "FloatTensor" not in error
    # exactly one end-to-end line, and only the end-to-end check fails: the rest of the build is sound
    assert [f for f in rep["failures"] if f.startswith("end_to_end:")] == [f"end_to_end: {error}"]
    assert [c["name"] for c in rep["checks"] if not c["passed"]] == ["end_to_end"]
    folder = art / "hybrid_build"
    on_disk = (folder / "validation.json").read_text()
    assert json.loads(on_disk)["end_to_end"]["error"] == error and ESC not in on_disk
    md = (folder / "validation.md").read_text()
    assert f"Failed to run: {error}." in md and ESC not in md


def test_int4_layer_without_cpu_kernel_is_one_sentence(tiny_copy):
    # Routed experts 112 wide: auto-round's CPU backends want widths that are multiples of 32
    # (torch) or of the group size 128 (auto_round_kernel), so no backend takes the up/gate (out
    # 112) or down (in 112) projections. Backend selection reads the layer shapes from config.json
    # before any weight is loaded, so the unchanged weights never matter. Which of auto-round's two
    # failures comes first (a ValueError naming the layer, or a coloured error log asking for
    # auto-round-lib, then exit(-1)) depends on the order it visits layers, which varies per run.
    cfg_path = tiny_copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    (cfg.get("text_config") or cfg)["moe_intermediate_size"] = 112
    cfg_path.write_text(json.dumps(cfg))
    r = transformers_forward.run_end_to_end(tiny_copy, tiny_copy, ["lm_head"], max_tokens=16)
    error = r["error"]
    assert set(r) == {"error"}
    assert ESC not in error and "\n" not in error
    assert error.startswith(("auto-round has no CPU kernel for the source's INT4 layer model.layers.",
                             "auto-round's CPU kernel for an INT4 layer of the source is not installed: "
                             "run `pip install \"auto-round-lib\"`")), error
    assert "--no-e2e" in error


# auto-round's own lines, as its logger and its ValueError print them (colours included)
AUTO_ROUND_NEEDS_PACKAGE = (
    "\x1b[38;20m2026-12-01 05:11:07 INFO replace_modules.py L390: Found 4 modules to replace\x1b[0m\n"
    "\x1b[31;1m2026-12-01 05:14:32 ERROR backend.py L1176: Inference requires the following libraries. "
    "Please install all of them.\x1b[0m\n"
    "\x1b[31;1m2026-12-01 05:14:32 ERROR backend.py L1176: `pip install \"auto-round-lib\"`\x1b[0m\n")
AUTO_ROUND_NO_BACKEND = (
    "\x1b[33;1m2026-12-01 05:11:07 WARNING modeling_utils.py L4635: `loss_type=None` was set\x1b[0m\n"
    "Traceback (most recent call last):\n"
    '  File "auto_round/inference/convert_model.py", line 471, in _replace_by_quant_layers\n'
    '    raise ValueError(f"No compatible backend found for layer {layer_name} with config {config}")\n'
    "ValueError: No compatible backend found for layer model.layers.3.mlp.experts.2.down_proj with config "
    "QuantizationScheme(bits=4, group_size=128, sym=True, data_type='int')\n")


def test_known_auto_round_failures_become_sentences():
    assert transformers_forward.describe_failure(255, AUTO_ROUND_NEEDS_PACKAGE) == (
        "auto-round's CPU kernel for an INT4 layer of the source is not installed: run "
        "`pip install \"auto-round-lib\"`, or pass --no-e2e to skip the end-to-end forward")
    msg = transformers_forward.describe_failure(1, AUTO_ROUND_NO_BACKEND)
    assert msg.startswith("auto-round has no CPU kernel for the source's INT4 layer "
                          "model.layers.3.mlp.experts.2.down_proj ") and msg.endswith("every other check still runs")
    # anything else: the last line, without its colours
    assert transformers_forward.describe_failure(1, "noise\n\x1b[31;1mRuntimeError: out of memory\x1b[0m\n\n") == (
        "the transformers forward failed (exit 1): RuntimeError: out of memory")


@pytest.mark.parametrize("coded, plain", [
    ("\x1b[31;1mred\x1b[0m", "red"),
    ("\x1b[38;5;208mx\x1b[39m \x1b[1;4my", "x y"),                  # 256 colours, reset, bold+underline
    ("\x1b]8;;https://example.org\x1b\\link\x1b]8;;\x1b\\", "link"),  # OSC 8 hyperlink
    ("\x1b[2K\x1b[1Gdone", "done"),                                  # erase line, cursor column
    ("no codes [31m here", "no codes [31m here"),                    # brackets without ESC stay
])
def test_strip_ansi(coded, plain):
    assert transformers_forward.strip_ansi(coded) == plain


def test_colour_codes_from_the_child_never_reach_the_report(artifact_copy, tiny_checkpoint, monkeypatch):
    planted = "\x1b[31;1m2026-12-01 05:14:32 ERROR backend.py L1176: something broke\n  in two lines\x1b[0m"
    monkeypatch.setattr(transformers_forward, "run_end_to_end", lambda *a, **k: {"error": planted})
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=True, engine="transformers")
    expected = "2026-12-01 05:14:32 ERROR backend.py L1176: something broke in two lines"
    assert report.end_to_end == {"error": expected, "engine": "transformers"}
    assert f"end_to_end: {expected}" in report.failures
    for name in ("validation.json", "validation.md"):
        text = (artifact_copy / "hybrid_build" / name).read_text()
        assert expected in text and ESC not in text


STAND_IN = """\
import os, signal, sys, tempfile
d = tempfile.mkdtemp(prefix="stand-in-")  # under TMPDIR, as a library's temp file would be
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {d}\\n")
signal.pause()  # a forward that would take hours
"""

PARENT = """\
import sys
from pathlib import Path
from hybrid_build.validate import transformers_forward

fifo, stand_in = sys.argv[1], sys.argv[2]
transformers_forward._child_command = lambda *args: [sys.executable, stand_in, fifo]
transformers_forward.run_end_to_end(Path("artifact"), Path("source"), ["lm_head"])
print("run_end_to_end returned")
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_removes_the_temp_folders_and_the_child(tmp_path):
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (tmp_path / "parent.py").write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(fifo), str(tmp_path / "stand_in.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child_pid = None
    try:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            # the line arrives once the stand-in runs inside run_end_to_end; the timeout only
            # turns a parent that died early into a failure instead of a hang
            if not select.select([fd], [], [], 120)[0]:
                proc.kill()
                pytest.fail(f"the stand-in child never started: {proc.communicate()[1]}")
            pid, child_tmp = os.read(fd, 4096).decode().split()
        finally:
            os.close(fd)
        child_pid, child_tmp = int(pid), Path(child_tmp)
        parent_tmp = child_tmp.parents[1]
        assert child_tmp.is_dir() and parent_tmp.name.startswith("hybrid-build-e2e-")
        assert (parent_tmp / "modules.json").exists()

        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGTERM, err  # still ends as SIGTERM: the caller sees what it sent
        assert "returned" not in out
        assert not parent_tmp.exists() and not child_tmp.exists()
        assert not _alive(child_pid)  # killed and reaped before the parent went
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------- item 10: the picture


def _thresholds_drawn(fig) -> dict[str, list[float]]:
    """threshold name -> the y values of the lines tagged ``threshold:<name>``."""
    drawn: dict[str, list[float]] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            gid = line.get_gid() or ""
            if gid.startswith("threshold:"):
                y = set(line.get_ydata())
                assert len(y) == 1, gid  # horizontal
                drawn.setdefault(gid.removeprefix("threshold:"), []).append(float(y.pop()))
    return drawn


def _failed_x(ax) -> list[float]:
    return sorted(float(x) for c in ax.collections if c.get_gid() == "failed" for x, _ in c.get_offsets())


def test_picture_of_a_clean_build(artifact_copy, tiny_checkpoint, test_recipe):
    from hybrid_build.recipes.schema import ValidateSpec, load_recipe

    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=True, write=False)
    assert report.passed, report.failures
    fig = render_figure(report)
    assert len(fig.axes) == 9  # 3 FP8 per-layer panels, 3 lm-head, 3 end to end
    titles = [ax.get_title() for ax in fig.axes]
    assert all(t.split("\n")[1].startswith("PASS") for t in titles), titles
    assert all(ax.title.get_color() == PASS_COLOR for ax in fig.axes)
    assert "validation passed" in fig.get_suptitle()

    # every metric against its own threshold, at the recipe's value (the test recipe's
    # e2e_min_top1 differs from the schema default, so a default drawn instead would show)
    t = report.thresholds
    recipe_value = load_recipe(test_recipe).validate_.e2e_min_top1
    assert t["e2e_min_top1"] == recipe_value != ValidateSpec().e2e_min_top1
    drawn = _thresholds_drawn(fig)
    for name in ("fp8_max_rel_error", "fp8_max_block_rel_error", "mlp_max_rel_error", "int8_max_rel_error",
                 "int8_max_row_rel_error", "head_min_top1", "head_min_top5_overlap", "head_max_kl", "e2e_min_top1",
                 "e2e_max_kl"):
        assert drawn.pop(name) == [t[name]], name
    assert sorted(drawn.pop("e2e_max_ppl_change")) == [-t["e2e_max_ppl_change"], t["e2e_max_ppl_change"]]
    assert drawn == {}

    layer_axes = [ax for ax in fig.axes if ax.get_xlabel() == "layer"]
    assert len(layer_axes) == 3
    for ax in layer_axes:
        ticks = [x for x in ax.get_xticks() if ax.get_xlim()[0] <= x <= ax.get_xlim()[1]]
        assert ticks == [0, 1, 2, 3] and all(float(x).is_integer() for x in ticks)
    # the four layers' points, per projection
    weights_ax = layer_axes[0]
    assert {ln.get_label(): list(ln.get_xdata()) for ln in weights_ax.get_lines() if not ln.get_gid()} == {
        p: [0, 1, 2, 3] for p in ("gate_proj", "up_proj", "down_proj")}
    assert all(_failed_x(ax) == [] for ax in fig.axes)

    # legends sit under their axes, never over the lines
    fig.draw_without_rendering()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent().y1 <= ax.get_window_extent().y0 + 0.5


def test_picture_marks_the_failing_layer(artifact_copy, tiny_checkpoint, plant):
    module = SE.format(1, "down")
    plant.patch(artifact_copy, module + ".weight_scale_inv",
                lambda s: s.index_put_((torch.tensor(1), torch.tensor(0)), s[1, 0] * 4))
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=False, write=False)
    assert not report.passed
    fig = render_figure(report)
    # the end-to-end row is one panel saying it was skipped
    assert len(fig.axes) == 7
    skipped = fig.axes[-1]
    assert skipped.get_title().endswith("skipped") and "skipped: turned off for this run" in skipped.texts[0].get_text()
    weights, blocks, mlp = (ax for ax in fig.axes if ax.get_xlabel() == "layer")
    for ax in (weights, blocks, mlp):
        assert ax.title.get_color() == FAIL_COLOR and "FAIL: 1 layer(s)" in ax.get_title()
        assert _failed_x(ax) == [1.0]  # only layer 1 is ringed
    # a x4 block scale: block error 3, so the block panel's worst point sits far above its 0.1 line
    assert weights.get_yscale() == "log" and blocks.get_yscale() == "log"
    assert all(ax.title.get_color() == PASS_COLOR for ax in fig.axes[3:6])  # lm-head untouched
    assert "validation FAILED" in fig.get_suptitle()


def test_picture_of_a_report_whose_end_to_end_failed_to_run(artifact_copy, tiny_checkpoint, monkeypatch):
    sentence = "the source has no tokenizer files (tokenizer.json, ...): copy them or pass --no-e2e"
    monkeypatch.setattr(transformers_forward, "run_end_to_end", lambda *a, **k: {"error": sentence})
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=True, write=False, engine="transformers")
    fig = render_figure(report)
    note = fig.axes[-1]
    assert note.title.get_color() == FAIL_COLOR and note.get_title().endswith("FAIL")
    assert " ".join(note.texts[0].get_text().split()) == f"failed to run: {sentence}"


# ------------------------------------------------------------------------------------- item 6: -q


def test_quiet_prints_only_the_first_failure(artifact_copy, tiny_checkpoint, plant, capsys):
    name = SE.format(3, "gate") + ".weight_scale_inv"
    plant.patch(artifact_copy, name, lambda s: s.index_put_((torch.tensor(0), torch.tensor(1)), torch.tensor(math.nan)))
    rc = main(["validate", str(artifact_copy), "--source", str(tiny_checkpoint), "--no-e2e", "-q"])
    out, err = capsys.readouterr()
    assert rc == 1
    failures = json.loads((artifact_copy / "hybrid_build" / "validation.json").read_text())["failures"]
    assert len(failures) >= 2  # the NaN scale, and the weight it makes NaN
    assert out == ""
    where = artifact_copy / "hybrid_build" / "validation.md"
    assert err == f"validation FAILED: {failures[0]} (+{len(failures) - 1} more in {where})\n"


def test_quiet_prints_nothing_when_validation_passes(artifact_copy, tiny_checkpoint, capsys):
    rc = main(["validate", str(artifact_copy), "--source", str(tiny_checkpoint), "--no-e2e", "-q"])
    assert rc == 0
    assert capsys.readouterr() == ("", "")
