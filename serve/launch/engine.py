"""How a serve profile becomes one exact command: ``vllm serve`` locally, or ``docker run`` of the
sm121 vLLM 0.23 image with our runtime patches mounted.

``plan_launch`` resolves the artifact (a hybrid folder, its source, or a Hub id), the recipe's
profile and the engine into a ``LaunchPlan`` (argv, environment, model name, port). Nothing runs
here; ``launcher`` starts it, ``--dry-run`` prints it.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_build.core import formats
from hybrid_build.core.artifact import CONFIG, RECIPE, read_provenance, read_recipe_data
from hybrid_build.core.bounded_read import read_json
from hybrid_build.core.errors import UserError
from hybrid_build.recipes.serve_names import DOCKER_IMAGE, SMOKE_EXPECT, SOURCE_PLACEHOLDER
from hybrid_build.serve.runtime.fixes import ENV_DISABLE, FIXES, UnknownFixError, parse_ids
from hybrid_build.serve.speed.memory_plan import UNIT_ENGINES as UNIT_VERSIONS
from hybrid_build.serve.speed.memory_plan import uses_match_unit

from .served_key import SERVER_ENV, ApiKey, is_loopback

if TYPE_CHECKING:
    from hybrid_build.core.provenance import Provenance
    from hybrid_build.recipes.profiles import ServeProfile
    from hybrid_build.recipes.schema import Recipe

ENGINES = ("local", "docker")
CONTAINER_MODEL = "/model"
CONTAINER_DRAFTER = "/drafter"
CONTAINER_RUNTIME = "/opt/hybrid-build/runtime"  # serve/runtime/ alone is mounted: patches/, int8_gemv.py
PLUGIN_ENV = {"VLLM_PLUGINS": "hybrid_build"}


@dataclass(frozen=True)
class VllmServe:
    """What ``vllm serve`` is asked for one profile. ``argv`` is built from it once, where it runs:
    this machine, a container (``docker_mounts`` names the model and drafter as the container sees
    them) or the Ray head (its host and parallel flags, ``extra``)."""

    profile: ServeProfile
    model: str
    port: int
    host: str
    drafter: str | None = None   # --drafter or the resolved ``{source}`` folder; None: the profile's own
    revision: str | None = None  # the Hub commit a recorded Hub source is pinned to
    extra: tuple[str, ...] = ()  # after the profile's arguments (several nodes: their parallel flags)
    drafter_revision: str | None = None  # the Hub drafter's revision (``drafter_revision``)

    def argv(self) -> list[str]:
        pin = ["--revision", self.revision] if self.revision else []
        return (vllm_args(self.profile, self.model, self.port, self.host, self.drafter, self.drafter_revision)
                + pin + list(self.extra))

    @property
    def drafter_model(self) -> str | None:
        """The DFlash drafter the argv loads (a folder or a Hub id), if any."""
        spec = _speculative(self.profile, self.drafter, self.drafter_revision)
        return spec.get("model") if spec else None


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    model_name: str
    port: int
    host: str
    profile: str
    engine: str
    model: str
    notes: list[str] = field(default_factory=list)
    smoke_expect: str | None = SMOKE_EXPECT  # the recipe's serve.smoke_expect
    image: str | None = None  # the docker engine's image (its vLLM is the one served)
    # what the drafter-vs-engine check reads (engine_check): the DFlash drafter as this machine names
    # it (a folder or a Hub id), its revision, and whether the profile caches prefixes
    drafter: str | None = None
    drafter_revision: str | None = None
    prefix_caching: bool = False
    prefix_match_unit: int | None = None  # --prefix-match-unit when passed (``match_unit``)
    # the served API's key (``served_key``): in the child's environment only, never in argv or env
    api_key: ApiKey | None = field(default=None, repr=False)
    # what the plan was made from, resolved once: the recipe (verify's thresholds) and vLLM's request
    # on this machine (several nodes build theirs from it)
    recipe: Recipe | None = field(default=None, repr=False)
    vllm: VllmServe | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)

    @property
    def secret_env(self) -> dict[str, str]:
        """What the started process gets in its environment on top of ``env`` and is never shown."""
        return self.api_key.env() if self.api_key and not self.api_key.pending else {}

    def to_json(self) -> dict:
        out = {"argv": self.argv, "env": self.env, "model_name": self.model_name, "base_url": self.base_url,
               "profile": self.profile, "engine": self.engine, "model": self.model, "notes": self.notes}
        if self.api_key is not None:
            out["api_key"] = self.api_key.to_json()
        return out


def _read_json(path: Path) -> dict:
    """A config file: a regular file, capped, nested at most MAX_DEPTH (``core/bounded_read``)."""
    return read_json(path, str(path), error=UserError)


def recipe_for_serving(artifact: str, recipe_arg: str | None, bound=None) -> tuple[Recipe, dict | None]:
    """The recipe (``--recipe``; else the artifact's own; else chosen from its config) and the
    artifact's config.json (None for a Hub id). ``bound`` (``core.bound.BoundArtifact``): the
    artifact serve opened and checked, whose config.json is not read again."""
    # here, not at the top: the schema imports the output formats (torch); `serve --help` reads this module
    from hybrid_build.recipes.schema import load_recipe, parse_recipe, select_recipe

    path = Path(artifact).expanduser()
    config = bound.read_json(CONFIG) if bound is not None else None
    if not isinstance(config, dict):
        config = _read_json(path / CONFIG) if (path / CONFIG).exists() else None
    if path.exists() and config is None:
        raise UserError(f"{artifact}: not a checkpoint folder (no config.json)")
    if recipe_arg:
        return load_recipe(recipe_arg), config
    own = bound.recipe_data() if bound is not None else read_recipe_data(path, missing_ok=True)
    if own is not None:
        return parse_recipe(own, str(path / RECIPE)), config
    if config is None:
        raise UserError(f"{artifact}: a Hub id needs --recipe (shipped recipes hold the serve profiles)")
    text = config.get("text_config") or config
    return select_recipe(text, config.get("model_type", "")), config


def _speculative(profile: ServeProfile, drafter: str | None, revision: str | None = None) -> dict | None:
    """The ``--speculative-config``; ``drafter`` replaces the profile's DFlash model, ``revision`` (vLLM's
    ``SpeculativeConfig.revision``, in every tested version) is the one ``drafter_revision`` chose."""
    spec = profile.speculative
    if spec is None:
        return None
    out: dict = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "dflash":
        model = drafter or spec.model
        if not model:
            raise UserError("this profile uses a DFlash drafter but names none: pass --drafter HUB_ID_OR_FOLDER")
        out["model"] = model
        if revision:
            out["revision"] = revision
    if spec.attention_backend:
        out["attention_backend"] = spec.attention_backend
    return out


def _provenance(artifact: str, hybrid: dict, bound=None) -> Provenance:
    """The artifact's provenance (the bound artifact's, where serve opened one); for a folder that
    has none (a build not yet recorded), the source its config records."""
    from hybrid_build.core.provenance import Provenance

    if bound is not None:
        return bound.provenance
    return read_provenance(Path(artifact), missing_ok=True) or Provenance(source=hybrid.get("source") or {})


def _local_source(artifact: str, config: dict | None, source: str | None, bound=None) -> Path | None:
    """The local folder of the source checkpoint: ``--source``, else the one the artifact records
    (the demo's inside the artifact, else its recorded absolute path), else the artifact itself when
    it is a source folder. None for a Hub source or when no folder is known here."""
    if source is not None:
        given = Path(source).expanduser()
        return given.resolve() if given.is_dir() else None
    hybrid = (config or {}).get("hybrid_build")
    if config is not None and not hybrid:
        return Path(artifact).expanduser().resolve()  # serving a source folder directly
    if not hybrid:
        return None
    from hybrid_build.core.source_identity import read_record

    provenance = _provenance(artifact, hybrid, bound)
    record = read_record(Path(artifact), provenance)
    if record is None or record.kind == "hub":
        return None
    candidates = ([Path(artifact) / record.in_artifact] if record.in_artifact else []) + \
                 ([Path(record.path)] if record.path else [])
    return next((c.resolve() for c in candidates if (c / "config.json").is_file()), None)


def resolve_drafter(name: str, profile: ServeProfile, drafter: str | None, artifact: str, config: dict | None,
                    source: str | None, bound=None) -> str | None:
    """The DFlash drafter to load instead of the profile's literal one, or None to keep that:
    ``--drafter``, or the profile's ``{source}``-relative folder made absolute (the demo recipe's
    ``{source}-dflash`` is the drafter ``hybrid-build demo-checkpoint`` builds beside the source)."""
    spec = profile.speculative
    if spec is None or spec.method != "dflash":
        return None
    if drafter:
        local = Path(drafter).expanduser()
        return str(local.resolve()) if local.exists() else drafter
    if not spec.model or SOURCE_PLACEHOLDER not in spec.model:
        return None
    folder = _local_source(artifact, config, source, bound)
    if folder is None:
        raise UserError(f"the {name!r} profile's DFlash drafter is {spec.model!r}, a folder beside a local source "
                        "checkpoint, and no local source folder is known for this artifact: pass --drafter "
                        "HUB_ID_OR_FOLDER (or --source FOLDER)")
    path = Path(spec.model.replace(SOURCE_PLACEHOLDER, str(folder)))
    if not (path / "config.json").is_file():
        raise UserError(f"the {name!r} profile's DFlash drafter {path} does not exist (`hybrid-build run` without "
                        "SOURCE and `hybrid-build demo-checkpoint` build it beside the demo source): pass --drafter "
                        "HUB_ID_OR_FOLDER")
    return str(path)


def drafter_revision(name: str, profile: ServeProfile, drafter: str | None,
                     given: str | None) -> tuple[str | None, str | None]:
    """The DFlash drafter's Hub revision to serve and the line that names it: ``--drafter-revision``
    (``given``), else the profile's pin for its own Hub drafter; a Hub drafter without one is served
    at the Hub's main, which moves, and the line says so. A folder has no revision: ``given`` for one
    (or for a profile without a DFlash drafter) is a UserError."""
    import re

    from hybrid_build.recipes.profiles import REVISION, is_hub_drafter

    spec = profile.speculative
    if spec is None or spec.method != "dflash":
        if given:
            raise UserError(f"--drafter-revision: the {name!r} profile has no DFlash drafter")
        return None, None
    model = drafter or spec.model or ""
    hub = is_hub_drafter(model) and not Path(model).expanduser().exists()
    if given:
        if not hub:
            raise UserError(f"--drafter-revision {given}: the drafter {model} is a folder; a revision names a commit "
                            "of a Hub drafter")
        if not re.fullmatch(REVISION, given):
            raise UserError(f"--drafter-revision {given!r}: not a Hub revision (a commit, tag or branch name)")
        return given, f"drafter: {model} at revision {given} (--drafter-revision)"
    if not hub:
        return None, None
    if drafter is None and spec.revision:
        return spec.revision, f"drafter: {model} at revision {spec.revision}, the {name!r} profile's pin"
    whose = "--drafter names no revision" if drafter else f"the {name!r} profile pins none"
    return None, (f"drafter: {model} at the Hub's main, which moves ({whose}): acceptance can differ from the "
                  "profile's figures; --drafter-revision pins a commit")


def vllm_args(profile: ServeProfile, model: str, port: int, host: str, drafter: str | None,
              drafter_rev: str | None = None) -> list[str]:
    args = ["serve", model, "--served-model-name", profile.served_model_name, "--host", host, "--port", str(port),
            "--gpu-memory-utilization", f"{profile.gpu_memory_utilization:g}",
            "--max-model-len", str(profile.max_model_len), "--max-num-seqs", str(profile.max_num_seqs),
            "--enable-prefix-caching" if profile.enable_prefix_caching else "--no-enable-prefix-caching"]
    if profile.attention_backend:
        args += ["--attention-backend", profile.attention_backend]
    if profile.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", profile.kv_cache_dtype]
    if profile.load_format:
        args += ["--load-format", profile.load_format]
    if profile.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", profile.tool_call_parser]
    if profile.reasoning_parser:
        args += ["--reasoning-parser", profile.reasoning_parser]
    spec = _speculative(profile, drafter, drafter_rev)
    if spec:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return args + list(profile.extra_args)


def _served_model(artifact: str, config: dict | None, profile: ServeProfile,
                  source: str | None, bound=None) -> tuple[str, str | None]:
    """The folder or Hub id vLLM loads for this profile, and the Hub revision to load. A local
    source (given, or the one the artifact records) is checked by content against the artifact's
    provenance before it is served; a recorded Hub source is pinned to its recorded commit."""
    hybrid = (config or {}).get("hybrid_build")
    if profile.artifact == "hybrid":
        if config is not None and not hybrid:
            raise UserError(f"{artifact}: not a hybrid-build artifact (no hybrid_build block in config.json); "
                            "the dense profile serves the output of `hybrid-build run`")
        return artifact, None
    if not hybrid:
        return source or artifact, None  # the source checkpoint itself
    from hybrid_build.core.source_identity import open_recorded_source, read_record

    provenance = _provenance(artifact, hybrid, bound)
    record = read_record(Path(artifact), provenance)
    if source is None and record is not None and record.kind == "hub":
        return record.id, record.revision  # a commit pins the bytes; vLLM fetches it if needed
    ckpt = open_recorded_source(Path(artifact), provenance, source)
    return str(ckpt.root.resolve()), None


def runtime_dir() -> Path:
    """The folder of the code that runs inside vLLM (``serve/runtime``): what the docker engine mounts."""
    import hybrid_build.serve.runtime as runtime

    return Path(runtime.__file__).resolve().parent


@dataclass(frozen=True)
class DockerMounts:
    """What a container of the docker engine sees of this machine (one node's or each of several):
    ``docker run``'s volume flags, and vLLM's request as the container names the model and drafter."""

    flags: list[str]
    vllm: VllmServe


def docker_mounts(vllm: VllmServe) -> DockerMounts:
    """The Hugging Face cache, a local model and a local drafter folder (read-only, at fixed paths),
    and the runtime folder alone, whose patches the container applies before vLLM starts."""
    flags = ["-v", "hf-cache:/root/.cache/huggingface"]
    inside: dict[str, str] = {}
    model = Path(vllm.model).expanduser()
    if model.exists():
        flags += ["-v", f"{model.resolve()}:{CONTAINER_MODEL}:ro"]
        inside["model"] = CONTAINER_MODEL
    drafter = vllm.drafter_model
    if drafter and Path(drafter).exists():
        flags += ["-v", f"{drafter}:{CONTAINER_DRAFTER}:ro"]
        inside["drafter"] = CONTAINER_DRAFTER
    flags += ["-v", f"{runtime_dir()}:{CONTAINER_RUNTIME}:ro"]
    return DockerMounts(flags, replace(vllm, **inside))


def apply_patches_command() -> str:
    """The shell command that applies serve/runtime/patches (mounted at CONTAINER_RUNTIME) to the image's vLLM."""
    site = ("$(python3 -c 'import importlib.util,os;"
            "print(os.path.dirname(os.path.dirname(importlib.util.find_spec(\"vllm\").origin)))')")
    return f"python3 {CONTAINER_RUNTIME}/patches/apply.py --site-packages \"{site}\""


def fixes_off(given: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The runtime fixes to leave out: ``given`` plus this environment's switch; an unknown id is a
    UserError (one line listing the valid ids)."""
    import os

    try:
        return parse_ids(",".join([os.environ.get(ENV_DISABLE, ""), *given]), "--disable-fix / " + ENV_DISABLE)
    except UnknownFixError as e:
        raise UserError(str(e)) from None


def fixes_off_note(off: frozenset[str], engine: str) -> str:
    """Which fixes are off, and which of those this engine never applies (plugin vs source patch)."""
    applies = {f.id for f in FIXES if (f.plugin if engine == "local" else f.patch)}
    note = f"runtime fixes off ({ENV_DISABLE}): {', '.join(sorted(off))}"
    idle = sorted(off - applies)
    if idle:
        note += f"; the {engine} engine does not apply {', '.join(idle)} anyway"
    return note + "; `hybrid-build verify` shows whether this vLLM needs them (docs/serve.md)"


def detect_hardware() -> str | None:
    """The ``plan`` preset of this machine's first GPU, from ``nvidia-smi``; None if unknown."""
    import shutil
    import subprocess

    from hybrid_build.serve.speed.bandwidth import HARDWARE

    if not shutil.which("nvidia-smi"):
        return None
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return next((hw.name for hw in HARDWARE.values() if hw.gpu_name and hw.gpu_name in name), None)


def _lever_note(artifact: Path, hardware: str | None) -> str | None:
    if hardware is None:
        return None
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.core.errors import HybridBuildError
    from hybrid_build.serve.speed.speed_plan import lever_gain_note

    try:
        return lever_gain_note(Checkpoint.read_folder(artifact), hardware)
    except HybridBuildError:  # headers the byte model cannot read: say nothing rather than guess
        return None


def plan_launch(artifact: str, profile_name: str | None, engine: str = "local", port: int = 8000,
                host: str = "127.0.0.1", recipe: str | None = None, drafter: str | None = None,
                source: str | None = None, image: str = DOCKER_IMAGE, hardware: str | None = None,
                drafter_rev: str | None = None,
                disable_fixes: tuple[str, ...] | list[str] = (), api_key: ApiKey | None = None,
                vllm_version: str | None = None, bound=None) -> LaunchPlan:
    """``hardware`` (a ``plan`` preset; default: the GPU ``nvidia-smi`` names, if it is one) is
    only used to say when the profile's levers are predicted to gain little there. ``disable_fixes``
    (``--disable-fix``) adds to the ids ``HYBRID_BUILD_DISABLE_FIXES`` already names here; the
    union goes into the served processes' environment. ``api_key`` (``served_key.resolve``) goes
    into vLLM's environment as ``VLLM_API_KEY`` when the plan starts; the docker engine's argv
    names the variable (``-e VLLM_API_KEY``) without its value. ``vllm_version``: the vLLM to be
    served, where known (the profile's ``prefix_match_unit`` is passed only where it was measured).
    ``bound``: the artifact serve opened and checked (``core.bound``), asked for its config and
    provenance instead of reading them again. ``drafter_rev``: ``--drafter-revision``, the Hub
    drafter's revision in place of the profile's pin (``drafter_revision``)."""
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r} (choose from: {', '.join(ENGINES)})")
    off = fixes_off(disable_fixes)
    rec, config = recipe_for_serving(artifact, recipe, bound)
    name = profile_name or rec.serve.default_profile
    profiles = rec.serve.profiles
    if name not in profiles:
        raise UserError(f"recipe {rec.name!r} has no serve profile {name!r} (has: {', '.join(profiles) or 'none'})")
    profile = profiles[name]
    model, revision = _served_model(artifact, config, profile, source, bound)
    drafter = resolve_drafter(name, profile, drafter, artifact, config, source, bound)
    drafter_rev, drafter_note = drafter_revision(name, profile, drafter, drafter_rev)
    unit, unit_note = match_unit(profile, engine, vllm_version, drafter, off, drafter_rev)
    asked_off = off  # what the user switched off (the note below); the unit's layout adds prefix_align
    if unit is not None:  # the stock layout: prefix_align's padding is what the unit makes unneeded
        off = off | {"prefix_align"}
    env = dict(profile.extra_env)
    if off:
        env[ENV_DISABLE] = ",".join(sorted(off))
    hybrid = (config or {}).get("hybrid_build") or {}
    if profile.artifact == "hybrid" and profile.int8_lm_head and formats.head_quantized_at_load(hybrid.get("lm_head")):
        # the plugin's switch takes the same word (it runs inside vLLM and cannot import core)
        env["HYBRID_BUILD_LM_HEAD"] = formats.AT_LOAD_LABEL
    notes = [fixes_off_note(asked_off, engine)] if asked_off else []
    kv_note = _kv_cache_note(name, profile, model)
    if kv_note:
        notes.append(kv_note)
    if profile.artifact == "hybrid" and not profile.int8_lm_head and formats.head_stored(hybrid.get("lm_head")):
        notes.append("the artifact stores an int8 lm-head; it is served as stored")
    if profile.artifact == "hybrid" and hybrid and (Path(artifact) / "config.json").is_file():
        gain = _lever_note(Path(artifact), hardware or detect_hardware())
        if gain:
            notes.append(gain)
    checked = _drafter_fields(profile, drafter, drafter_rev)
    if drafter_note:
        notes.append(drafter_note)
    if profile.prefix_caching_note:
        notes.append(f"prefix caching ({name!r} profile): {profile.prefix_caching_note}")
    if profile.note:
        notes.append(f"{name!r} profile: {profile.note}")
    if unit_note:
        notes.append(unit_note)
    local_model = str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model
    # the fine_grained layout: the block size is the hybrid alignment's kernel grid, so every group's block
    # is a multiple of the unit (vLLM refuses a unit that does not divide one)
    vllm = VllmServe(profile, local_model, port, host, drafter, revision,
                     extra=("--block-size", str(unit), "--prefix-match-unit", str(unit)) if unit else (),
                     drafter_revision=drafter_rev)
    if engine == "local":
        env.update(PLUGIN_ENV)
        return LaunchPlan(["vllm"] + vllm.argv(), env, profile.served_model_name, port, host, name, engine,
                          local_model, notes, rec.serve.smoke_expect, api_key=api_key, recipe=rec, vllm=vllm,
                          prefix_match_unit=unit, **checked)

    # docker: the container serves on 8000 inside; the runtime folder is mounted read-only and its
    # patches applied to the image's vLLM before `vllm serve` starts
    mounts = docker_mounts(replace(vllm, port=8000, host="0.0.0.0"))
    script = f"{apply_patches_command()} && exec vllm {shlex.join(mounts.vllm.argv())}"
    env_flags: list[str] = []
    for k, v in sorted(env.items()):
        env_flags += ["-e", f"{k}={v}"]
    if api_key is not None:
        env_flags += ["-e", SERVER_ENV]  # docker copies the value from its own environment
    argv = (["docker", "run", "--rm", "--name", f"hybrid-build-{name}", "--gpus", "all", "--ipc", "host",
             "-p", docker_publish(host, port)] + mounts.flags + env_flags + [image, "bash", "-c", script])
    return LaunchPlan(argv, {}, profile.served_model_name, port, host, name, engine, model, notes,
                      rec.serve.smoke_expect, image=image, api_key=api_key, recipe=rec, vllm=vllm, **checked)




def match_unit(profile: ServeProfile, engine: str, version: str | None, drafter: str | None,
               off: frozenset[str], drafter_rev: str | None = None) -> tuple[int | None, str | None]:
    """The unit of the ``fine_grained`` layout (``--block-size U --prefix-match-unit U``; None:
    prefix_align's layout stays), and a note saying why."""
    from hybrid_build.serve.runtime.fixes import base_version

    unit, spec = profile.prefix_match_unit, profile.speculative
    if not unit or not profile.enable_prefix_caching or spec is None or spec.method != "dflash":
        return None, None
    v = base_version(version) if version else None
    from hybrid_build.serve.speed.memory_plan import PREFIX_ALIGN_ENGINES, WINDOW_FIX

    keep = (f"runtime fix prefix_align's padded layout is kept, not the profile's prefix_match_unit {unit}"
            if v is None or v in PREFIX_ALIGN_ENGINES else
            f"the stock layout is served without the profile's prefix_match_unit {unit}")
    if engine != "local" or v not in UNIT_VERSIONS:
        served = f"vLLM {v} ({engine} engine)" if v else f"not known here ({engine} engine)"
        return None, (f"prefix cache: {keep}: the unit is passed where its hits were measured, vLLM "
                      f"{' or '.join(UNIT_VERSIONS)} with the local engine, and the served vLLM is {served}")
    if "dflash_keep_last_block" in off:
        return None, f"prefix cache: {keep}: the unit needs runtime fix dflash_keep_last_block, which is off"
    from .memory import drafter_config

    cfg, _, basis = drafter_config(drafter or spec.model, drafter_rev)
    sliding = "sliding_attention" in (cfg.get("layer_types") or [])
    if not uses_match_unit(profile, v, cfg, off):
        why = ("SlidingWindowManager asserts at its first lookup with the unit" if v == "0.26.0" else
               "KV-cache planning turns partial (fine-grained) hits off for it")
        return None, (f"prefix cache: {keep}: the DFlash drafter ({basis}) has sliding-window layers, runtime fix "
                      f"{WINDOW_FIX} is off, and without it vLLM {v}'s {why}")
    window = f", {WINDOW_FIX}" if sliding else ""
    return unit, (f"prefix cache: --block-size {unit} --prefix-match-unit {unit} on vLLM's own KV pages (the "
                  f"fine_grained layout): a warm prefix hits within {unit:,} tokens of its end, without prefix_align's "
                  f"padded pages (runtime fix prefix_align off; dflash_keep_last_block{window} on)")


def _drafter_fields(profile: ServeProfile, drafter: str | None, revision: str | None) -> dict:
    """The plan's drafter (``--drafter`` or the resolved ``{source}`` folder, else the profile's own
    Hub id) and whether its profile caches prefixes."""
    spec = profile.speculative
    if spec is None or spec.method != "dflash":
        return {"prefix_caching": profile.enable_prefix_caching}
    return {"drafter": drafter or spec.model, "drafter_revision": revision,
            "prefix_caching": profile.enable_prefix_caching}


def _kv_cache_note(name: str, profile: ServeProfile, model: str) -> str | None:
    """What was measured about an fp8 KV cache, where it applies (docs/serve.md): on an H200 with
    vLLM 0.25.1 the bf16-served hybrid passed verify with it, and a checkpoint vLLM served in
    float16 (the tiny source, whose config.json names no dtype) died at the first prompt
    (FlashAttention: "For FP8 input, output must have dtype BF16"); serve's verify before READY
    stops such a server. vLLM picks the dtype itself when the config names none (it chose bf16 for
    the tiny hybrid and float16 for its source), so this is a note, not a refusal."""
    if not profile.kv_cache_dtype.startswith("fp8") or "--dtype" in profile.extra_args:
        return None
    cfg_path = Path(model).expanduser() / CONFIG
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    text = cfg.get("text_config") or {}
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    if dtype == "bfloat16":
        return None
    said = "says float16" if dtype == "float16" else f"names {dtype!r}" if dtype else "names no dtype"
    return (f"the {name!r} profile asks for an {profile.kv_cache_dtype} KV cache and {model}'s config.json {said}: "
            "if vLLM serves it in float16, FlashAttention stops at the first prompt (measured on an H200, vLLM "
            "0.25.1) and verify stops the server; add \"--dtype\", \"bfloat16\" to the profile's extra_args to be sure")


def docker_publish(host: str, port: int) -> str:
    """``docker run -p``'s value: the container's 8000 on ``port`` of the loopback address ``host``
    names (``localhost``: 127.0.0.1), or of every interface for any other host, as ``vllm serve
    --host`` would listen; so a key is needed exactly where ``served_key.is_loopback`` says."""
    if not is_loopback(host):
        return f"{port}:8000"
    address = "127.0.0.1" if host.lower() == "localhost" else host.strip("[]")
    return f"{'[' + address + ']' if ':' in address else address}:{port}:8000"
