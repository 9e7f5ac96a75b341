"""Resolve every linear layer of checkpoints through a real vLLM's INC config (run as a subprocess).

Usage: ``PYTHONPATH=<vllm src>:<cpu deps> python vllm_probe.py MODE:CHECKPOINT... OUT.json`` (MODE
``stock`` or ``plugin``; or the job ``marlin``: ``marlin_probe.py``'s weight prep before and after
``register()``; or ``head``: ``head_probe.py``'s int8 head methods); writes JSON ``{"vllm", "runs":
{"MODE:CHECKPOINT": {"config_class", "layers": {vllm_layer_name: {"kind", "method", "scheme", "bits",
"group_size"}}}, "marlin": ..., "head": ...}}``. One process serves every job of a version (importing
vLLM is most of the time): the stock jobs run first, then the plugin's ``register()`` (once, honouring
``HYBRID_BUILD_DISABLE_FIXES``) and the plugin jobs, then the head.

vLLM's config classes import on CPU, but its Qwen3.5 model module does not (torchvision ops), so
the model's ``hf_to_vllm_mapper`` prefixes and ``packed_modules_mapping`` are read from the real
source file with ``ast``, and layer objects are created without ``__init__`` (INC dispatches on
the class only). MoE layers are resolved to their INC scheme, not to a kernel method (that needs a
GPU's MoE config). The platform reports an sm90 device so kernel choice follows the H200 path.
"""
from __future__ import annotations

import ast
import json
import sys
import types
from pathlib import Path


def _class_node(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _class_attr(tree: ast.Module, cls: str, attr: str) -> ast.expr:
    for node in _class_node(tree, cls).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return node.value
    raise KeyError(f"{cls}.{attr}")


def model_mappings(vllm_root: Path) -> tuple[dict, dict]:
    models = vllm_root / "vllm" / "model_executor" / "models"
    vl = ast.parse((models / "qwen3_vl.py").read_text())
    q35 = ast.parse((models / "qwen3_5.py").read_text())
    mapper = _class_attr(vl, "Qwen3VLForConditionalGeneration", "hf_to_vllm_mapper")
    prefixes = next(ast.literal_eval(k.value) for k in mapper.keywords if k.arg == "orig_to_new_prefix")
    packed = ast.literal_eval(_class_attr(vl, "Qwen3VLForConditionalGeneration", "packed_modules_mapping"))
    extra = _class_attr(q35, "Qwen3_5ForConditionalGeneration", "packed_modules_mapping")
    assert isinstance(extra, ast.BinOp)  # Qwen3VL... | {...}
    packed |= ast.literal_eval(extra.right)
    return prefixes, packed


def vllm_layers(artifact: Path, prefixes: dict, packed: dict) -> dict[str, str]:
    """vLLM module name -> layer kind, from the checkpoint's tensor names."""
    names = json.loads((artifact / "model.safetensors.index.json").read_text())["weight_map"]
    sub_to_fused = {sub: fused for fused, subs in packed.items() for sub in subs if sub != fused}
    skip = ("norm", "embed_tokens", "conv1d")
    # the router (mlp.gate) and shared_expert_gate are built with quant_config=None in
    # models/qwen3_next.py of both versions: the quantization config is never asked about them
    not_asked = ("gate", "shared_expert_gate")
    out: dict[str, str] = {}
    for tensor in names:
        if tensor.startswith(("model.visual.", "mtp.")):
            continue
        module, part = tensor.rsplit(".", 1)
        leaf = module.split(".")[-1]
        if part in ("A_log", "dt_bias") or any(s in leaf for s in skip) or leaf in not_asked:
            continue
        for old, new in prefixes.items():
            if module.startswith(old) or module + "." == old:
                module = new + module[len(old):] if module.startswith(old) else new.rstrip(".")
                break
        if ".mlp.experts." in module:
            out[module.split(".mlp.experts.")[0] + ".mlp.experts"] = "moe"
            continue
        leaf = module.split(".")[-1]
        if leaf in sub_to_fused:
            module = module[: -len(leaf)] + sub_to_fused[leaf]
            leaf = sub_to_fused[leaf]
        if leaf == "lm_head":
            kind = "lm_head"
        elif leaf == "qkv_proj":
            kind = "qkv"
        elif leaf in packed:
            kind = "merged"
        elif leaf in ("o_proj", "out_proj", "down_proj"):
            kind = "row"
        else:
            kind = "replicated"
        out[module] = kind
    return out


def resolve(artifact: Path, prefixes: dict, packed: dict) -> dict:
    """``config_class`` and every layer's resolution through the INC config vLLM has now."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.inc.schemes.factory import resolve_scheme
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.utils import WeightsMapper

    classes = {"qkv": QKVParallelLinear, "merged": MergedColumnParallelLinear, "row": RowParallelLinear,
               "replicated": ReplicatedLinear, "lm_head": ParallelLMHead, "moe": RoutedExperts}
    config = json.loads((artifact / "config.json").read_text())
    cls = get_quantization_config("inc")
    vcfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    # Fp8LinearMethod reads the model dtype; no ModelConfig can be built without a model on disk
    object.__setattr__(vcfg, "model_config", types.SimpleNamespace(dtype=torch.bfloat16))
    result: dict = {"config_class": cls.__name__, "layers": {}}
    with set_current_vllm_config(vcfg):
        qc = cls.from_config(config["quantization_config"])
        qc.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix=prefixes))
        qc.packed_modules_mapping = packed
        for name, kind in sorted(vllm_layers(artifact, prefixes, packed).items()):
            layer = object.__new__(classes[kind])
            torch.nn.Module.__init__(layer)
            info: dict = {"kind": kind}
            if kind == "moe":
                lc = qc.config_parser.resolve(layer, name)
                info["method"] = "unquantized" if not lc.quantized else type(resolve_scheme(lc)).__name__
                info.update(bits=lc.bits, group_size=lc.group_size)
            else:
                method = qc.get_quant_method(layer, name)
                info["method"] = type(method).__name__
                scheme = getattr(method, "scheme", None)
                if scheme is not None:
                    info["scheme"] = type(scheme).__name__
                    lc = getattr(scheme, "layer_config", None)
                    if lc is not None:
                        info.update(bits=lc.bits, group_size=lc.group_size)
                block = getattr(getattr(method, "quant_config", None), "weight_block_size", None) or \
                    getattr(getattr(scheme, "quant_config", None), "weight_block_size", None)
                if block:
                    info["fp8_block"] = list(block)
            result["layers"][name] = info
    return result


def main() -> int:
    args, out = sys.argv[1:-1], Path(sys.argv[-1])
    jobs = [a for a in args if a not in ("marlin", "head")]
    modes = [job.split(":", 1)[0] for job in jobs]
    if not args or set(modes) - {"stock", "plugin"} or modes != sorted(modes, key=lambda m: m == "plugin"):
        print("vllm_probe: give MODE:CHECKPOINT jobs (every stock one before the plugin ones), marlin, head, "
              "then OUT.json", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import head_probe
    import marlin_probe
    import vllm
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    # Declare an sm90 (H200) device so vLLM chooses its GPU kernel classes (Marlin, block FP8);
    # they are only constructed, never run.
    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    root = Path(vllm.__file__).resolve().parents[1]
    prefixes, packed = model_mappings(root)
    result: dict = {"vllm": vllm.__version__ if hasattr(vllm, "__version__") else "?", "runs": {}}
    marlin_stock = marlin_probe.prepare_all() if "marlin" in args else None
    registered = False
    for job, mode in [*zip(jobs, modes), *([("marlin", "plugin")] if marlin_stock else [])]:
        if mode == "plugin" and not registered:
            from hybrid_build.serve.runtime import plugin as vllm_plugin

            vllm_plugin.register()
            registered = True
        if job == "marlin":
            result["runs"]["marlin"] = marlin_probe.report(marlin_stock, marlin_probe.prepare_all())
        else:
            result["runs"][job] = resolve(Path(job.split(":", 1)[1]), prefixes, packed)
    if "head" in args:
        result["runs"]["head"] = head_probe.results()
    # a file, not stdout: with 0.25.1 a piped stdout came back empty at exit
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
