"""The runtime-fix registry and its switch (``HYBRID_BUILD_DISABLE_FIXES`` / ``--disable-fix``), and
serve's warning for a vLLM outside the tested set.

Plain tests run the plugin's ``register()`` against stand-in vLLM modules (each fix on, then off),
the CLI's dry run, ``patches/apply.py``'s refusal of an unknown id, and the version check with
stand-in ``vllm`` / ``docker`` executables on PATH. The ``vllm``-marked test applies the patches,
one switched off, to vLLM 0.23.0's real source (``python -S``: as in the container, without
hybrid-build installed). The plugin's switches on vLLM's real code are in ``test_vllm_plugin.py``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hybrid_build.pipeline.cli import main
from hybrid_build.recipes.profiles import DOCKER_IMAGE
from hybrid_build.serve.launch import launcher
from hybrid_build.serve.launch.engine import LaunchPlan
from hybrid_build.serve.runtime import fixes as runtime_fixes
from hybrid_build.serve.runtime import plugin as vllm_plugin
from hybrid_build.serve.runtime.fixes import ENV_DISABLE, FIX_IDS, FIXES, TESTED_VERSIONS, UnknownFixError
from hybrid_build.serve.runtime.patches import apply as apply_mod

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import vllm_sources  # noqa: E402

PLUGIN_LOG = "hybrid_build.serve.runtime.plugin"


# ---- the registry

def test_every_fix_has_its_hook_or_its_patch():
    """Each entry of FIXES is a fix some mechanism applies: a plugin hook that exists in the runtime
    package, a patch module of patches/ that holds a PATCH, or both; and nothing else is applied."""
    assert len(set(FIX_IDS)) == len(FIX_IDS)
    assert all(f.fixes and f.needed_on and (f.hook or f.patch) for f in FIXES)
    for hook, ids in runtime_fixes.hooks().items():
        assert callable(vllm_plugin._hook(hook)), hook
        assert set(ids) <= set(FIX_IDS)
    for fix_id, module in runtime_fixes.patches().items():
        assert apply_mod.patch_of(fix_id).edits, module
    runtime = Path(apply_mod.__file__).parent
    assert {p.stem for p in runtime.glob("*.py")} - {"__init__", "anchors", "apply"} == \
        set(runtime_fixes.patches().values()), "a patch module no fix names is never applied"
    assert [p.name for p in apply_mod.all_patches()] == [apply_mod.patch_of(i).name for i in runtime_fixes.patches()]


ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("calibration", "core", "pipeline", "recipes", "serve", "validate", "scripts", "benchmarks")


def _listed_ids(path: Path) -> list[tuple[int, list[str]]]:
    """The literal collections in a file (tuple, list, set, dict keys) that hold two fix ids or more."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List,
                                                                                           ast.Set)) else []
        ids = [i.value for i in items if isinstance(i, ast.Constant) and i.value in FIX_IDS]
        if len(ids) > 1:
            out.append((node.lineno, ids))
    return out


def _owners() -> dict[str, set[str]]:
    """The module (file name in serve/runtime) that implements each fix: its hook's or its patch's."""
    owners: dict[str, set[str]] = {}
    for f in FIXES:
        if f.hook:
            owners.setdefault(f"serve/runtime/{f.hook.split(':')[0]}.py", set()).add(f.id)
        if f.patch:
            owners.setdefault(f"serve/runtime/patches/{f.patch}.py", set()).add(f.id)
    return owners


def test_no_module_lists_fix_ids_but_the_registry():
    """The ids live in FIXES alone: elsewhere a module names together only the fixes it implements
    (its own parts); the plugin, the patches and the CLI switch derive theirs from FIXES."""
    owners = _owners()
    found = {}
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "serve/runtime/fixes.py":
                continue
            bad = [(line, ids) for line, ids in _listed_ids(path) if not set(ids) <= owners.get(rel, set())]
            if bad:
                found[rel] = bad
    assert found == {}


def test_a_second_list_of_ids_is_caught(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text(f"PATCH_MODULES = {FIX_IDS[:3]!r}\n")
    assert _listed_ids(planted) == [(1, list(FIX_IDS[:3]))]


def test_tested_versions_are_the_checked_sources_and_the_docker_image():
    assert [t.version for t in TESTED_VERSIONS] == list(vllm_sources.VERSIONS)
    for t in TESTED_VERSIONS:
        assert set(t.fixes) <= set(FIX_IDS), t.version
        assert all(t.version in next(f for f in FIXES if f.id == i).needed_on for i in t.fixes), t.version
    assert runtime_fixes.tested_image(DOCKER_IMAGE).version == "0.23.0"


def test_unknown_id_is_one_line_listing_the_valid_ids():
    with pytest.raises(UnknownFixError) as e:
        runtime_fixes.disabled_fixes({ENV_DISABLE: "marlin_moe_scale,kv_unfiy"})
    msg = str(e.value)
    assert "\n" not in msg and "'kv_unfiy'" in msg and all(i in msg for i in FIX_IDS)


def test_ids_parse():
    assert runtime_fixes.disabled_fixes({}) == frozenset()
    assert runtime_fixes.disabled_fixes({ENV_DISABLE: " kv-unify, marlin_moe_scale ,"}) == {"kv_unify",
                                                                                           "marlin_moe_scale"}
    assert runtime_fixes.disabled_fixes({ENV_DISABLE: "all"}) == set(FIX_IDS)


# ---- the plugin's register() against stand-in vLLM modules

@pytest.fixture
def fake_vllm(monkeypatch):
    """Stand-ins for the vLLM modules register() touches: the Marlin MoE scale function, INC's config
    and its registry, the layer classes and the FP8 scheme the plugin picks."""
    def stock_permute(s, size_k, size_n, group_size, is_a_8bit=False):
        return "stock"

    class INCConfig:
        def __init__(self, extra):
            self.extra_config = extra
            self.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

        @classmethod
        def from_config(cls, config):
            return cls(config.get("extra_config"))

        def get_quant_method(self, layer, prefix):
            return "stock-inc"

    class Scheme:
        def __init__(self, **kw):
            self.kw = kw

    class INCLinearMethod:
        def __init__(self, scheme):
            self.scheme = scheme

    registered = []

    def register_quantization_config(name):
        def put(cls):
            registered.append((name, cls))
            return cls
        return put

    mods = {
        "vllm.model_executor.layers.fused_moe.oracle.int_wna16": dict(marlin_moe_permute_scales=stock_permute),
        "vllm.model_executor.layers.quantization": dict(register_quantization_config=register_quantization_config),
        "vllm.model_executor.layers.quantization.inc": dict(INCConfig=INCConfig),
        "vllm.model_executor.layers.quantization.inc.inc_linear": dict(INCLinearMethod=INCLinearMethod),
        "vllm.model_executor.layers.quantization.inc.schemes.inc_fp8_linear": dict(INCFp8LinearScheme=Scheme),
        "vllm.model_executor.layers.linear": dict(LinearBase=type("LinearBase", (), {})),
        "vllm.model_executor.layers.vocab_parallel_embedding": dict(ParallelLMHead=type("ParallelLMHead", (), {})),
    }
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe",
                 "vllm.model_executor.layers.fused_moe.oracle", "vllm.model_executor.layers.quantization.inc.schemes"):
        mods.setdefault(name, {})
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    for name in mods:  # `from a.b import c` needs c as an attribute of a.b
        parent, _, child = name.rpartition(".")
        if parent in mods:
            monkeypatch.setattr(sys.modules[parent], child, sys.modules[name], raising=False)
    monkeypatch.setattr(vllm_plugin, "_registered", None)
    monkeypatch.setattr(vllm_plugin, "_done", False)
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    monkeypatch.delenv(vllm_plugin.ENV_LM_HEAD, raising=False)
    return types.SimpleNamespace(int_wna16=sys.modules["vllm.model_executor.layers.fused_moe.oracle.int_wna16"],
                                 stock_permute=stock_permute, registered=registered, INCConfig=INCConfig,
                                 linear=sys.modules["vllm.model_executor.layers.linear"].LinearBase)


FP8 = {"bits": 8, "data_type": "fp", "weight_block_size": [128, 128]}
HYBRID_CONFIG = {"extra_config": {"m.mlp.shared_expert.gate_proj": FP8, "m.mlp.shared_expert.up_proj": FP8}}


def _fp8_answer(cls, fake) -> object:
    return cls.from_config(HYBRID_CONFIG).get_quant_method(fake.linear(), "m.mlp.shared_expert.gate_up_proj")


@pytest.fixture(autouse=True)
def _plugin_warnings_reach_caplog(caplog):
    # an earlier in-process CLI run (`-q`) leaves the root logger at ERROR: the plugin's warnings
    # are what these tests read, so its logger is set to pass them whatever ran before
    caplog.set_level(logging.WARNING, logger=PLUGIN_LOG)


def _off_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PLUGIN_LOG and "is off" in r.getMessage()]


def test_register_installs_every_plugin_fix_by_default(fake_vllm, caplog):
    vllm_plugin.register()
    assert fake_vllm.int_wna16.marlin_moe_permute_scales is not fake_vllm.stock_permute
    [(name, cls)] = fake_vllm.registered
    assert name == "inc" and cls.__name__ == "HybridINCConfig"
    assert type(_fp8_answer(cls, fake_vllm)).__name__ == "INCLinearMethod"
    assert not _off_lines(caplog)


def test_marlin_fix_switched_off_leaves_the_function_untouched(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv(ENV_DISABLE, "marlin_moe_scale")
    caplog.set_level(logging.WARNING, logger=PLUGIN_LOG)
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent: still one line
    assert fake_vllm.int_wna16.marlin_moe_permute_scales is fake_vllm.stock_permute
    assert [n for n, _ in fake_vllm.registered] == ["inc"]  # the other fixes stay on
    assert _off_lines(caplog) == [runtime_fixes.off_line("marlin_moe_scale")]


def test_fp8_dispatch_switched_off_gives_incs_own_answer(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv(ENV_DISABLE, "inc_fp8_dispatch")
    vllm_plugin.register()
    [(_, cls)] = fake_vllm.registered  # the int8 head still needs the subclass
    assert _fp8_answer(cls, fake_vllm) == "stock-inc"
    assert fake_vllm.int_wna16.marlin_moe_permute_scales is not fake_vllm.stock_permute
    assert _off_lines(caplog) == [runtime_fixes.off_line("inc_fp8_dispatch")]


def test_both_inc_parts_off_leave_inc_unreplaced(fake_vllm, monkeypatch):
    monkeypatch.setenv(ENV_DISABLE, "int8_lm_head,inc_fp8_dispatch,kv_unify")
    vllm_plugin.register()
    assert fake_vllm.registered == []


def test_all_off_leaves_vllm_as_it_is(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv(ENV_DISABLE, "all")
    vllm_plugin.register()
    assert fake_vllm.registered == [] and fake_vllm.int_wna16.marlin_moe_permute_scales is fake_vllm.stock_permute
    assert len(_off_lines(caplog)) == sum(f.plugin for f in FIXES)  # only the plugin's own fixes, in its process


def test_register_refuses_an_unknown_id(fake_vllm, monkeypatch):
    monkeypatch.setenv(ENV_DISABLE, "marlin_moe_scal")
    with pytest.raises(UnknownFixError, match="unknown runtime fix 'marlin_moe_scal'"):
        vllm_plugin.register()
    assert fake_vllm.int_wna16.marlin_moe_permute_scales is fake_vllm.stock_permute


# ---- the CLI switch

@pytest.fixture
def artifact(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "hybrid_build": {
        "format": "inc-hybrid", "source": {"id": "Intel/Qwen3.5-122B-A10B-int4-AutoRound"}, "lm_head": "gptq-int8"}}))
    return art


def _serve(art: Path, *extra: str) -> int:
    return main(["serve", str(art), "--profile", "base", "--recipe", "qwen3.5-122b-a10b", "--dry-run", *extra])


def test_unknown_disable_fix_is_one_line_and_exit_2(artifact, capsys):
    assert _serve(artifact, "--disable-fix", "nope") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err and "marlin_moe_scale" in err


def test_disable_fix_shows_in_the_dry_run(artifact, capsys):
    assert _serve(artifact, "--disable-fix", "marlin_moe_scale", "--disable-fix", "kv-unify", "--disable-fix",
                  "fla_smem_sm121") == 0
    out = capsys.readouterr().out
    assert f"export {ENV_DISABLE}=fla_smem_sm121,kv_unify,marlin_moe_scale\n" in out
    assert "the local engine does not apply fla_smem_sm121 anyway" in out
    assert _serve(artifact, "--engine", "docker", "--disable-fix", "kv_unify", "--json") == 0
    argv = json.loads(capsys.readouterr().out)["argv"]
    assert argv[argv.index(f"{ENV_DISABLE}=kv_unify") - 1] == "-e"  # reaches apply.py in the container
    assert argv.index(f"{ENV_DISABLE}=kv_unify") < argv.index(DOCKER_IMAGE)


def test_environment_switch_joins_the_flag_and_is_checked_too(artifact, capsys, monkeypatch):
    monkeypatch.setenv(ENV_DISABLE, "prefix_align")
    assert _serve(artifact, "--disable-fix", "fla_smem_sm121", "--json") == 0
    assert json.loads(capsys.readouterr().out)["env"][ENV_DISABLE] == "fla_smem_sm121,prefix_align"
    monkeypatch.setenv(ENV_DISABLE, "prefix_aling")
    assert _serve(artifact) == 2


def test_no_switch_no_variable(artifact, capsys):
    assert _serve(artifact, "--json") == 0
    assert ENV_DISABLE not in json.loads(capsys.readouterr().out)["env"]


# ---- patches/apply.py

def test_apply_refuses_an_unknown_id_before_writing(tmp_path):
    env = dict(os.environ, **{ENV_DISABLE: "kv_unify,nope"})
    r = subprocess.run([sys.executable, "-S", apply_mod.__file__, "--site-packages", str(tmp_path)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'nope'" in r.stderr
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.vllm
def test_apply_skips_a_disabled_patch_and_applies_the_others(tmp_path):
    src = vllm_sources.unpacked("0.23.0")
    if src is None:
        pytest.skip("vLLM 0.23.0 sources not prepared (run .ci/vllm_sources.sh)")
    patches = apply_mod.all_patches()
    for p in patches:
        (tmp_path / p.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / p.path, tmp_path / p.path)
    kv = next(p for p in patches if p.name == "kv-unify-drafter")
    # the skipped patch's anchor is not even looked for: a changed file there must not stop the others
    broken = (tmp_path / kv.path).read_text().replace(kv.edits[0].anchor, "            pass\n")
    (tmp_path / kv.path).write_text(broken)
    env = dict(os.environ, **{ENV_DISABLE: "kv_unify,int8_lm_head,marlin_moe_scale"})
    r = subprocess.run([sys.executable, "-S", apply_mod.__file__, "--site-packages", str(tmp_path)], env=env,
                       capture_output=True, text=True)  # -S: no site-packages, as in the container
    assert r.returncode == 0, r.stderr
    assert (tmp_path / kv.path).read_text() == broken
    head = next(p for p in patches if p.name == "int8-lm-head")
    assert (tmp_path / head.path).read_text() == (src / head.path).read_text()
    assert not any((tmp_path / target).exists() for _, target in head.copies)
    applied = {p.name for p in patches} - {kv.name, head.name}
    for p in patches:
        if p.name in applied:
            assert all(e.sentinel in (tmp_path / p.path).read_text() for e in p.edits), p.name
    lines = r.stdout.splitlines()
    assert [x for x in lines if "is off" in x] == [runtime_fixes.off_line("int8_lm_head"),
                                                   runtime_fixes.off_line("kv_unify")]  # FIXES order
    assert sum("applied" in x for x in lines) == len(applied)


# ---- the tested-version warning

def _stand_in(bindir: Path, name: str, stdout: str, code: int = 0) -> None:
    bindir.mkdir(exist_ok=True)
    tool = bindir / name
    tool.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({stdout!r})\nsys.exit({code})\n")
    tool.chmod(0o755)


def _plan(engine: str = "local", image: str | None = None) -> LaunchPlan:
    argv = ["vllm", "serve", "m"] if engine == "local" else ["docker", "run", "x"]
    return LaunchPlan(argv, {}, "m", 8000, "127.0.0.1", "base", engine, "m", image=image)


@pytest.mark.parametrize("printed, warns", [
    ("0.27.0\n", True),
    ("0.0.0-standin\n", True),
    ("0.25.2.dev3+g1234\n", True),
    ("0.25.1\n", False),
    ("INFO 12-01 10:00:00 [__init__.py:43] plugins from 10.0.0.1\n0.33.0+cu130\n", False),
])
def test_version_check_warns_outside_the_tested_set(printed, warns, tmp_path, monkeypatch, caplog):
    _stand_in(tmp_path / "bin", "vllm", printed)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    line = launcher.warn_if_untested(_plan())
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(line) is warns and logged == ([line] if warns else [])
    if warns:
        assert "\n" not in line and "0.23.0" in line and "0.25.1" in line and "0.33.0" in line
        assert "hybrid-build verify" in line and printed.strip() in line


def test_unreadable_version_warns(tmp_path, monkeypatch):
    _stand_in(tmp_path / "bin", "vllm", "", code=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert "could not be read" in launcher.warn_if_untested(_plan())


def test_docker_version_is_the_images(tmp_path, monkeypatch):
    _stand_in(tmp_path / "bin", "docker", "0.24.0\n")  # what the image answers for any other image
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert launcher.warn_if_untested(_plan("docker", DOCKER_IMAGE)) is None
    assert "vLLM 0.24.0 is not one" in launcher.warn_if_untested(_plan("docker", "me/my-vllm:latest"))


def test_docs_list_every_fix_and_tested_version():
    doc = (HERE.parent.parent / "docs" / "serve.md").read_text()
    section = doc[doc.index("## Tested vLLM versions and runtime fixes"):doc.index("## Launcher")]
    for f in FIXES:
        assert f"| `{f.id}` |" in section and (not f.upstream or f.upstream.split(" (")[0] in section), f.id
    for t in TESTED_VERSIONS:
        row = next(line for line in section.splitlines() if line.startswith(f"| {t.version} |"))
        assert all(f"`{i}`" in row for i in t.fixes) and t.engine in row, t.version
