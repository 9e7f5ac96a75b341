"""The GPU harness's agent steps (``scripts/gpu/agent_steps.py``, ``driver.py --steps starts,ttft,tools``)
on CPU: the driver's arguments, the config-only drafters it serves (read by transformers and by
vLLM 0.25.1's / 0.26.0's own DFlash layer resolution), the recipe each case serves with, the exact
``hybrid-build serve`` command, and how a case's log becomes its verdict."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
GPU = HERE.parent.parent / "scripts" / "gpu"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(GPU))
import agent_steps  # noqa: E402
import driver  # noqa: E402
import lease_steps  # noqa: E402
import vllm_sources  # noqa: E402

BASE = ["--hb", "h", "--src", "s", "--work", "w", "--out", "o", "--deadline", "0"]


def test_driver_parses_the_agent_arguments():
    a = driver.build_parser().parse_args(BASE + ["--steps", "starts,ttft,tools", "--agent-cases",
                                                 "dense:mixed:on,dflash:full6:off", "--contexts", "1024,4096"])
    assert [c.key for c in a.agent_cases] == ["dense_mixed_on", "dflash_full6_off"]
    assert a.contexts == [1024, 4096] and a.ttft_runs == 3
    d = driver.build_parser().parse_args(BASE)
    assert [c.key for c in d.agent_cases] == ["dense_full6_on", "dense_mixed_on"]
    assert d.contexts == [8192, 32768, 65536]
    assert len(agent_steps.parse_cases("all")) == 8


@pytest.mark.parametrize("flag, value", [("--agent-cases", "dense:mixed"), ("--agent-cases", "base:full6:on"),
                                         ("--agent-cases", "dense:mixed:yes"), ("--contexts", "8k"),
                                         ("--contexts", "32")])
def test_driver_refuses_bad_agent_arguments(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        driver.build_parser().parse_args(BASE + [flag, value])
    assert e.value.code == 2 and value in capsys.readouterr().err


def test_drafters_have_the_real_shape(tmp_path):
    from transformers import Qwen3Config

    written = agent_steps.write_drafters(tmp_path)
    assert [p.name for p in written] == ["drafter-mixed", "drafter-full6"]
    for p, types in zip(written, (["sliding_attention"] * 5 + ["full_attention"], ["full_attention"] * 6)):
        raw = json.loads((p / "config.json").read_text())
        assert raw["layer_types"] == types and raw["architectures"] == ["DFlashDraftModel"]
        assert raw["dflash_config"] == {"mask_token_id": 248077, "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]}
        cfg = Qwen3Config(**raw)
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.head_dim, raw["sliding_window"], raw["block_size"]) == (3072, 6, 32, 8, 128, 4096, 16)
        assert list(p.iterdir()) == [p / "config.json"]


def _resolve(version: str, cases: list[tuple[str, bool | None]]) -> list:
    """vLLM's own ``_resolve_layer_attention`` for each drafter layer, per case ``(shape, v2)``, in
    one process (vLLM's import is most of its time). ``v2``: the engine's ``use_v2_model_runner``
    (0.26+ read it from the current config, which needs a GPU platform to build here; the engine's
    own choice is checked on its source in test_engine_check). A case that raises gives
    ``{"error": "Type: message"}``."""
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    code = ("import json, sys, types; sys.path.insert(0, sys.argv[1]); import agent_steps\n"
            "from transformers import Qwen3Config\n"
            "from vllm.model_executor.models import qwen3_dflash as q\n"
            "out = []\n"
            "for shape, v2 in json.loads(sys.argv[2]):\n"
            "    if v2 is not None:\n"
            "        q.get_current_vllm_config = lambda v2=v2: types.SimpleNamespace(use_v2_model_runner=v2)\n"
            "    cfg = Qwen3Config(**agent_steps.drafter_config(shape))\n"
            "    try:\n        out.append([q._resolve_layer_attention(cfg, i) for i in range(6)])\n"
            "    except Exception as e:\n        out.append({'error': f'{type(e).__name__}: {e}'})\n"
            "print(json.dumps(out))\n")
    r = vllm_sources.run_python(version, ["-c", code, str(GPU), json.dumps(cases)],
                                dict(os.environ, **vllm_sources.cache_env(version), PYTHONPATH=pp,
                                     VLLM_LOGGING_LEVEL="ERROR"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_vllms_own_dflash_layers_take_the_drafters_as_measured():
    """0.25.1 raises for the mixed drafter (what the H200 run printed) and builds the all-full one
    non-causal; 0.26.0 builds the mixed one on the V2 runner: SWA layers causal with the window;
    0.34.0, whose only runner is V2, builds it so without asking."""
    mixed, full6 = _resolve("0.25.1", [("mixed", None), ("full6", None)])
    assert mixed["error"].startswith("NotImplementedError: DFlash does not yet support mixed sliding/full attention")
    assert full6 == [[None, False]] * 6
    on_v2, on_v1 = _resolve("0.26.0", [("mixed", True), ("mixed", False)])
    assert on_v2 == [[4096, True]] * 5 + [[None, False]]
    assert "V2 model runner" in on_v1["error"]
    assert _resolve("0.34.0", [("mixed", None), ("full6", None)]) == [on_v2, full6]


def test_case_recipe_and_command(tmp_path):
    import yaml

    from hybrid_build.recipes.schema import load_recipe

    on = agent_steps.gpu_recipe(tmp_path, True, 67712, 32 << 30)
    off = agent_steps.gpu_recipe(tmp_path, False, 67712, 32 << 30)
    for path, caching in ((on, True), (off, False)):
        rec = load_recipe(str(path))  # the product's own schema takes it
        for name in ("dense", "dflash"):
            prof = rec.serve.profiles[name]
            assert prof.enable_prefix_caching is caching and prof.load_format == "dummy"
            assert prof.max_model_len == 67712 and "--enforce-eager" in prof.extra_args
            assert prof.speculative.method == "dflash" and prof.tool_call_parser == "qwen3_xml"
        assert rec.serve.smoke_expect is None
    assert yaml.safe_load(on.read_text())["name"] == "qwen3.5-122b-a10b"
    case = agent_steps.Case("dflash", "mixed", True)
    cmd = agent_steps.serve_command(case, Path("/f"), on, 8200, 540, Path("/o/x.log"))
    assert cmd[:5] == ["hybrid-build", "serve", "/f/L48-base", "--profile", "dflash"]
    assert cmd[cmd.index("--drafter") + 1] == "/f/drafter-mixed" and "--no-verify" in cmd and "--json" in cmd
    assert "--force" not in cmd  # a config-only target is a plain checkpoint: nothing for --force to wave through


@pytest.fixture(scope="module")
def floor_targets(tmp_path_factory, tiny_checkpoint) -> Path:
    """The harness's config-only targets as ``floor_configs.py`` writes them (its own functions), at 4
    layers (3 GDN + 1 full attention, the model's mix) instead of 48: the 48-layer sources take minutes to
    write and hash on two cores, and nothing serve checks depends on the depth. Named as the harness
    names the full-depth ones (``agent_steps.TARGETS``), with the drafters of the real shape."""
    import floor_configs

    root = tmp_path_factory.mktemp("floor")
    work, floor = root / "work", root / "floor"
    src = floor_configs.write_source(work, "L4", floor_configs.types_of(4))
    floor_configs.copy_config(src, floor / agent_steps.TARGETS["dflash"], tiny_checkpoint)
    floor_configs.write_dense(src, floor / agent_steps.TARGETS["dense"], work / "unwritten", tiny_checkpoint)
    agent_steps.write_drafters(floor)
    return floor


def _installed_vllm(root: Path, version: str) -> Path:
    """A PYTHONPATH folder holding the real vLLM wheel's package metadata alone: what ``serve --dry-run``
    reads to know the local engine's version (no import)."""
    import zipfile

    wheel = vllm_sources.wheel_path(version)
    if wheel is None:
        pytest.skip(f"vLLM {version} wheel not downloaded (run .ci/vllm_sources.sh)")
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"vllm-{version}.dist-info/METADATA", root)
    return root


def _dry_run(cmd: list[str], pythonpath: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pythonpath)] + sys.path))
    return subprocess.run(cmd + ["--dry-run", "--hardware", "h100"], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.vllm
def test_every_agent_case_is_served_by_serve_itself(floor_targets, tmp_path):
    """``hybrid-build serve --dry-run`` takes every case of the harness (dense|dflash x mixed|full6 x
    on|off) on the targets floor_configs.py writes, with vLLM 0.26.0 installed: no refusal, the argv the
    GPU machine runs. The config-only targets hold no half-made build records, so serve needs no --force."""
    from hybrid_build.core.bound import open_artifact

    for name in agent_steps.TARGETS.values():
        assert not (floor_targets / name / "hybrid_build").exists()
        assert open_artifact(floor_targets / name, missing_ok=True) is None  # a plain checkpoint to serve
    meta = _installed_vllm(tmp_path / "meta", "0.26.0")
    cases = agent_steps.parse_cases("all")
    assert len(cases) == 8
    for case in cases:
        recipe = agent_steps.gpu_recipe(tmp_path, case.caching, 67712, 0)
        cmd = agent_steps.serve_command(case, floor_targets, recipe, 8200, 540, tmp_path / f"{case.key}.log")
        r = _dry_run(cmd, meta)
        assert r.returncode == 0, f"{case.key}: {r.stderr[-1500:]}"
        plan = json.loads(r.stdout)
        argv = plan["argv"]
        assert argv[:3] == ["vllm", "serve", str(floor_targets / agent_steps.TARGETS[case.profile])], case.key
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert spec["method"] == "dflash" and spec["model"] == str(floor_targets / f"drafter-{case.shape}")
        assert ("--enable-prefix-caching" in argv) is case.caching, case.key
        assert argv[argv.index("--load-format") + 1] == "dummy" and plan["profile"] == case.profile


@pytest.mark.slow
@pytest.mark.vllm
def test_the_lease_server_is_served_by_serve_itself(floor_targets, tmp_path):
    """The server the GPU lease keeps up (``lease_steps.py up``: the dflash case with the watch and restart
    flags, eager or with CUDA graphs) is taken by ``serve --dry-run`` as the machine will launch it."""
    meta = _installed_vllm(tmp_path / "meta", "0.26.0")
    case = agent_steps.Case("dflash", "mixed", True)
    for graphs in (False, True):
        work = tmp_path / f"graphs-{graphs}"
        work.mkdir()
        cmd, max_len, _ = lease_steps.serve_command(case, floor_targets, work, [8192, 32768, 65536], 0, graphs)
        assert "--restart" in cmd and "--no-verify" not in cmd
        r = _dry_run(cmd + ["--json"], meta)
        assert r.returncode == 0, f"graphs={graphs}: {r.stderr[-1500:]}"
        argv = json.loads(r.stdout)["argv"]
        assert argv[argv.index("--max-model-len") + 1] == str(max_len)
        assert ("--enforce-eager" in argv) is not graphs, argv


@pytest.mark.slow
@pytest.mark.vllm
def test_a_half_made_build_folder_in_a_target_is_refused(floor_targets, tmp_path):
    """What the harness once wrote (a ``hybrid_build/`` folder and no provenance) is refused, --force or
    not: the check above would catch floor_configs.py writing it again."""
    import shutil

    target = tmp_path / "L48-dense"
    shutil.copytree(floor_targets / "L48-dense", target)
    (target / "hybrid_build").mkdir()
    (target / "hybrid_build" / "recipe.yaml").write_text("name: x\n")
    recipe = agent_steps.gpu_recipe(tmp_path, True, 67712, 0)
    cmd = agent_steps.serve_command(agent_steps.Case("dense", "mixed", True), floor_targets, recipe, 8200, 540,
                                    tmp_path / "x.log")
    cmd[2] = str(target)
    for extra in ([], ["--force"]):
        r = _dry_run(cmd + extra, _installed_vllm(tmp_path / "meta", "0.26.0"))
        assert r.returncode != 0 and "did not finish" in r.stderr, r.stderr[-800:]


def test_cut_experts_leaves_build_records_behind(tmp_path):
    """A floor made before the config-only targets lost their ``hybrid_build/`` folder comes out of
    cut-experts servable: the folder is not copied, the expert count is cut, the rest is kept."""
    src, out = tmp_path / "src", tmp_path / "out"
    (src / "L48-dense" / "hybrid_build").mkdir(parents=True)
    (src / "L48-dense" / "hybrid_build" / "recipe.yaml").write_text("name: x\n")
    (src / "L48-dense" / "config.json").write_text(json.dumps({"text_config": {"num_experts": 256, "x": 1}}))
    (src / "L48-dense" / "tokenizer.json").write_text("{}")
    agent_steps.write_drafters(src)
    made = agent_steps.cut_experts(src, out, 64)
    assert [p.name for p in made] == ["L48-dense", "drafter-mixed", "drafter-full6"]
    assert sorted(p.name for p in (out / "L48-dense").iterdir()) == ["config.json", "tokenizer.json"]
    assert json.loads((out / "L48-dense" / "config.json").read_text())["text_config"] == {"num_experts": 64, "x": 1}


def test_first_error_is_the_exception_line():
    log = ("INFO 12-03 loading\nTraceback (most recent call last):\n  File \"x.py\", line 3, in f\n"
           "    raise NotImplementedError(\nNotImplementedError: DFlash does not yet support mixed sliding/full\n"
           "ERROR 12-03 EngineCore failed to start.\nRuntimeError: Engine core initialization failed.\n")
    assert agent_steps.first_error(log) == "NotImplementedError: DFlash does not yet support mixed sliding/full"
    assert agent_steps.first_error("    assert new_spec.page_size_bytes == max_page_size\nAssertionError\n") == \
        "AssertionError"
    assert agent_steps.first_error("all fine\n") is None


def test_prefixes_never_share_a_block_by_chance():
    a, b = agent_steps.token_ids(65536, 1), agent_steps.token_ids(65536, 2)
    assert all(150 <= t < 3950 for t in a) and a[:16] != b[:16]


def test_cache_fault_finds_the_cache_block_in_each_kv_layout():
    """The cache-hit fault (``cache_fault.py``) overwrites whole cache blocks: in vLLM's K/V view the
    block dimension counts kernel blocks, ``r`` to a cache block, followed by their tokens (FlashAttention:
    2, blocks, tokens, heads, dim) or by the K/V pair first (blocks, 2, tokens, heads, dim)."""
    import cache_fault

    assert cache_fault.block_dim((2, 100, 48, 2, 64), 100, 48) == (1, 1)
    assert cache_fault.block_dim((2, 300, 16, 2, 64), 100, 48) == (1, 3)   # 48-token blocks in 16-token kernel blocks
    assert cache_fault.block_dim((300, 2, 16, 2, 64), 100, 48) == (0, 3)
    assert cache_fault.block_dim((2, 100, 32, 2, 64), 100, 48) is None     # no dimension makes a 48-token block
