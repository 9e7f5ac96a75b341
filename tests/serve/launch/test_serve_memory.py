"""`hybrid-build serve` prints the KV pool, the largest context and the streams that fit before it
starts (``serve/launch/memory.py`` on ``memory_plan``), and once vLLM is up compares the pool vLLM
logged ("GPU KV cache size: N tokens") with the plan: beyond 2% a warning names both. vLLM is the
stand-in on PATH (``serve_env``); ``--kv-pool-tokens`` makes it log a pool line as vLLM does."""
from __future__ import annotations

import json
import signal

import pytest
from serve_cli import CliRun

from hybrid_build.pipeline.cli import main
from hybrid_build.recipes.schema import load_recipe
from hybrid_build.serve.launch.memory import engine_for
from hybrid_build.serve.speed import memory_plan as mp


def _dry_run_memory(art, capsys, *extra: str) -> dict:
    assert main(["serve", str(art), "--profile", "dense", "--hardware", "gb10", "--dry-run", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["memory"]


def test_dry_run_prints_the_pool_and_the_streams_that_fit(tiny_artifact, capsys):
    m = _dry_run_memory(tiny_artifact, capsys)
    assert m["planned"] and m["hardware"] == "gb10"
    plan = m["plan"]
    prof = load_recipe("tiny").serve.profiles["dense"]
    # the budget is the profile's share of the GB10's 128 GB less the weights, the drafter and the reserve
    assert plan["gpu_memory_utilization"] == prof.gpu_memory_utilization and plan["total_bytes"] == 128 * 10**9
    assert 0 < plan["weights_bytes"] < 10**9 and 0 < plan["drafter_bytes"] < 10**9
    assert plan["num_speculative_tokens"] == prof.speculative.num_speculative_tokens
    assert plan["kv_pool_bytes"] <= 0.3 * 128e9 - plan["weights_bytes"] - plan["reserve_bytes"]
    assert m["max_context_tokens"] == prof.max_model_len
    (fit,) = m["fit"]
    assert fit["context"] == prof.max_model_len and fit["whole"] >= prof.max_num_seqs
    assert main(["serve", str(tiny_artifact), "--profile", "dense", "--hardware", "gb10", "--dry-run"]) == 0
    text = capsys.readouterr().out.splitlines()
    mem_lines = [ln for ln in text if ln.startswith("# memory: ")]
    assert mem_lines[0].startswith(f"# memory: KV pool {m['pool_tokens']:,} tokens (vLLM ")
    assert f"streams that fit: {fit['whole']:,} x {fit['context']:,}" in mem_lines[1]
    # without a known device there is no pool to state, and the line says what would give one
    assert main(["serve", str(tiny_artifact), "--profile", "dense", "--dry-run"]) == 0
    assert "# memory: not planned (the device's memory is not known here: --hardware" in capsys.readouterr().out


def test_the_planning_version_follows_the_served_one():
    assert engine_for("0.33.0+cu130")[0] == "0.33.0"
    assert engine_for("0.33.1")[0] == "0.33.0" and "nearest" in engine_for("0.33.1")[1]
    assert engine_for("0.34.0")[0] == "0.34.0" and engine_for("0.35.2")[0] == "0.34.0"
    assert engine_for("0.25.2")[0] == "0.25.1"
    assert engine_for(None)[0] == engine_for("0.0.0-standin")[0] == "0.26.0"


def _serve(art, c, flags: str) -> CliRun:
    argv = ["serve", str(art), "--profile", "dense", "--hardware", "gb10", "--port", str(c["port"]),
            "--ready-timeout", "120", "--no-verify", "--no-smoke", "--log", str(c["cwd"] / "serve.log")]
    return CliRun(argv, dict(c["env"], HB_STANDIN_FLAGS=flags), c["cwd"])


def _stop(run: CliRun) -> str:
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=60) == 130
    return run.output()


@pytest.mark.slow
@pytest.mark.parametrize("drift", [0.5, 0.01])
def test_serve_compares_the_pool_vllm_logs_with_the_plan(tiny_artifact, serve_env, capsys, drift):
    pool = _dry_run_memory(tiny_artifact, capsys)["pool_tokens"]
    logged = int(pool * (1 + drift))
    run = _serve(tiny_artifact, serve_env, f"--kv-pool-tokens {logged}")
    try:
        first = run.wait_for("memory: KV pool", 60)
        assert first.startswith(f"memory: KV pool {pool:,} tokens")
        run.wait_for("READY", 120)
        said = [ln for ln in run.seen if ln.startswith("memory: ")]
        assert said[1].startswith("memory: largest context one stream holds")
    finally:
        out = _stop(run)
    warning = [ln for ln in out.splitlines() if ln.startswith("warning: vLLM's KV pool")]
    if drift > mp.LOG_DRIFT:
        assert len(warning) == 1 and f"{logged:,} tokens" in warning[0] and f"the plan said {pool:,}" in warning[0]
    else:
        assert not warning
        assert f"memory: vLLM logged a KV pool of {logged:,} tokens; the plan said {pool:,} (+1.0%)" in said


def test_a_kv_cache_memory_bytes_in_the_profile_sizes_the_pool(tiny_artifact, tmp_path, capsys):
    """vLLM's --kv-cache-memory-bytes replaces the gpu_memory_utilization budget (what the GPU driver's
    agent starts pass): the printed pool follows it, so the comparison with vLLM's log holds there too."""
    import yaml

    data = load_recipe("tiny").model_dump(mode="json")
    data["serve"]["profiles"]["dense"]["extra_args"] = ["--kv-cache-memory-bytes", str(2 << 30)]
    path = tmp_path / "kv-bytes.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    small = _dry_run_memory(tiny_artifact, capsys, "--recipe", str(path))
    whole = _dry_run_memory(tiny_artifact, capsys)
    assert small["plan"]["kv_pool_bytes"] <= 2 << 30 < whole["plan"]["kv_pool_bytes"]
    assert small["plan"]["kv_pool_bytes"] > (2 << 30) - small["plan"]["block_bytes"]


def test_the_start_check_names_a_layout_fix_the_plugin_left_out():
    """The fine_grained layout with the real (sliding-window) drafter rests on the runtime fix
    sliding_window_partial_hits: the pool vLLM logs is the same without it, so the start check also reads
    the plugin's line for a fix it did not apply (its anchors did not hold) and warns."""
    import sys
    from pathlib import Path

    from hybrid_build.serve.launch.memory import LaunchMemory

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "gpu"))
    from agent_steps import drafter_config

    from hybrid_build.pipeline.generators import synthetic as syn

    prof = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"]
    tc = dict(syn.QWEN35_122B_TEXT_CONFIG)
    pool = "GPU KV cache size: {:,} tokens\n"
    refused = ("WARNING hybrid-build: runtime fix sliding_window_partial_hits not applied: this vLLM's "
               "SlidingWindowManager is not the source the fix was written against\n")
    for shape, warns in (("mixed", True), ("full6", False)):
        plan = mp.plan_memory(mp.profile_inputs(tc, prof, "0.26.0", drafter_config(shape),
                                                kv_cache_memory_bytes=547 * 55_050_240))
        assert plan.inputs.layout == "fine_grained"
        launch = LaunchMemory(plan, None, "gb10", "vLLM 0.26.0's planning", 4, 64)
        agree, warning, logged = launch.check_log(pool.format(plan.pool_tokens))
        assert agree and warning is None and logged == plan.pool_tokens
        agree, warning, _ = launch.check_log(refused + pool.format(plan.pool_tokens))
        assert (warning is not None) is warns and (agree is None) is warns, shape
        if warns:
            assert "sliding_window_partial_hits" in warning and "fine_grained" in warning and "\n" not in warning
    aligned = mp.plan_memory(mp.profile_inputs(tc, prof, "0.26.0", drafter_config("mixed"), layout="prefix_align",
                                               kv_cache_memory_bytes=547 * 55_050_240))
    said = LaunchMemory(aligned, None, "gb10", "", 4).check_log(
        "hybrid-build: runtime fix prefix_align not applied: ...\n" + pool.format(aligned.pool_tokens))[1]
    assert said and "runtime fix prefix_align was not applied" in said


def test_a_config_only_target_is_checked_at_the_budget_vllm_logged(tmp_path):
    """A target with no weights to read (config-only, dummy weights: the GPU harness's) gets no plan of its
    budget, but its KV layout is checked at the budget vLLM logs. The inputs and log lines are Run 17's
    (lab/gpu_runs.md: the 122B's 48 layers, 64 experts, the mixed drafter, the dense profile, one H100):
    each layout's logged pool agrees with its own layout and not with the others (0.7% to 33% apart)."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "gpu"))
    from agent_steps import gpu_recipe

    from hybrid_build.serve.launch.engine import plan_launch
    from hybrid_build.serve.launch.memory import plan_for_launch

    golden = Path(__file__).resolve().parents[1] / "golden" / "run17_dense_l48_e64"
    target, drafter = tmp_path / "L48-dense", tmp_path / "drafter-mixed"
    target.mkdir()
    drafter.mkdir()
    shutil.copy(golden / "config.json", target / "config.json")
    shutil.copy(golden / "drafter-mixed.json", drafter / "config.json")
    recipe = str(gpu_recipe(tmp_path, True, 67712, 0))
    logs = {k: "\n".join(v) + "\n" for k, v in json.loads((golden / "vllm_log_lines.json").read_text()).items()}
    off = {"fine_grained": (), "prefix_align": ("sliding_window_partial_hits",),
           "stock": ("prefix_align", "sliding_window_partial_hits")}
    for layout, disabled in off.items():
        launch = plan_launch(str(target), "dense", recipe=recipe, drafter=str(drafter), disable_fixes=disabled,
                             vllm_version="0.26.0")
        memory = plan_for_launch(launch, "0.26.0", "h100", frozenset(disabled))
        assert memory.plan is None and "headers cannot be read" in memory.why
        assert memory.layout is not None and memory.layout.layout == layout
        assert memory.lines()[0].endswith(f"; the {layout} KV layout is checked at the budget vLLM logs")
        for logged_as, text in logs.items():
            agree, warning, logged = memory.check_log(text)
            if logged_as == layout:
                assert warning is None, (layout, warning)
                assert agree.startswith(f"memory: vLLM logged a KV pool of {logged:,} tokens; at the KV budget vLLM "
                                        f"logged (41.72 GiB) the {layout} layout gives "), agree
                assert memory.to_json()["at_logged_budget"]["logged_pool_tokens"] == logged
            else:
                assert agree is None and warning.startswith(f"vLLM's KV pool is {logged:,} tokens, but at the KV "
                                                            "budget vLLM logged"), (layout, logged_as, warning)
    # without the budget line there is nothing to compare
    assert memory.check_log(logs["stock"].splitlines()[1] + "\n")[:2] == (None, None)
