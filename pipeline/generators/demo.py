"""The embedded default: a tiny but real Qwen3.5-MoE INT4 AutoRound checkpoint, built offline.

The real input is 62 GiB; this one is ~6 MB and shaped like it. transformers builds a random
``Qwen3_5MoeForConditionalGeneration`` (VL form: 4 layers with one full-attention layer, 8
experts, untied lm-head, hidden 256 so that 128-wide groups apply), auto-round exports it with
RTN as ``auto_round:auto_gptq`` keeping the shared experts BF16 (as Intel's checkpoint does), and
then the layout of Intel's upload is reproduced: the weights re-sharded into several files, and
the MTP tensors in ``model_extra_tensors.safetensors``, which the index does not list.

Beside it (``<folder>-dflash``) goes a tiny DFlash drafter shaped like z-lab's: a real random
transformers Qwen3 (``model_type`` qwen3, ``architectures`` DFlashDraftModel, a ``dflash_config``
naming the mask token and the target layers it reads) with the target's hidden size and no
embeddings or head of its own, so that the serve profiles that speculate with DFlash have a
drafter to name. It drafts nothing useful: its weights are random, like the target's.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.safetensors_io import (
    ByteRange,
    OutTensor,
    plan_shards,
    write_bytes_atomic,
    write_index,
    write_shard,
)

log = logging.getLogger(__name__)

MTP_FILE = "model_extra_tensors.safetensors"
DEMO_NAME = "tiny-qwen3.5-moe-int4-autoround"
DRAFTER_SUFFIX = "-dflash"  # the drafter's folder: the demo folder's name plus this

TEXT_CONFIG = dict(
    vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    shared_expert_intermediate_size=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=3, max_position_embeddings=4096, mtp_num_hidden_layers=1,
)
VISION_CONFIG = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256)
# z-lab's DFlash drafters are small Qwen3 stacks (the 122B one: 6 layers, 5 sliding + 1 full);
# this one keeps that mix in 2 layers and reads 4 hidden states of the target (z-lab's reads 8)
DRAFTER_CONFIG = dict(
    hidden_size=TEXT_CONFIG["hidden_size"], vocab_size=TEXT_CONFIG["vocab_size"], intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=512,
    max_window_layers=1, max_position_embeddings=TEXT_CONFIG["max_position_embeddings"], rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
DFLASH_CONFIG = {
    "block_size": 16,
    # an id of the embedding table that the demo tokenizer (454 tokens) never produces, standing in
    # for the reserved token Qwen's tokenizer keeps for it (248077 in Qwen3.5)
    "mask_token_id": TEXT_CONFIG["vocab_size"] - 1,
    "target_layer_ids": [0, 1, 2, 3],
}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# what the tokenizer learns from: enough English, code and tool-call JSON to tokenise the bundled texts
TOKENIZER_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome. ",
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Tea was first drunk in China, then traded along the Silk Road to India, Persia and Europe. ",
    "hello world, the quick brown fox jumps over the lazy dog. 0123456789 ",
]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_CONFIG["vocab_size"],
                                  special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 40, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _mtp_tensors(config, seed: int) -> dict:
    """MTP weights as the real checkpoint stores them: one full-attention decoder layer with a
    per-expert MoE under ``mtp.layers.0.``, plus the fc and norms. transformers never builds the
    MTP block, so the layer comes from a real one-layer text model, exported by save_pretrained."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    text = dict(TEXT_CONFIG, num_hidden_layers=1, layer_types=["full_attention"])
    torch.manual_seed(seed + 1)
    layer_model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text)).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp, _quiet_libraries("saving the MTP layer"):
        layer_model.save_pretrained(tmp)
        state = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(f))
    out = {"mtp." + k[len("model."):]: v for k, v in state.items() if k.startswith("model.layers.0.")}
    h = config.text_config.hidden_size
    gen = torch.Generator().manual_seed(seed + 2)
    out["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        out[norm] = torch.zeros(h, dtype=torch.bfloat16)  # Qwen3.5 RMSNorm scales by (1 + weight)
    return out


def demo_drafter_path(source: str | os.PathLike) -> Path:
    """Where the demo's DFlash drafter lives: beside the demo source, ``<name>-dflash``."""
    source = Path(source)
    return source.with_name(source.name + DRAFTER_SUFFIX)


def build_demo_checkpoint(out_dir: str | os.PathLike, seed: int = 0, shards: int = 3, drafter: bool = True) -> Path:
    """Build the tiny checkpoint into ``out_dir`` (created; must not exist or be empty) and return it.
    With ``drafter``, its DFlash drafter goes to ``demo_drafter_path(out_dir)`` first, so that a
    complete demo source always has one."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".demo-", dir=out_dir.parent))
    try:
        tokenizer = _train_tokenizer()
        torch.manual_seed(seed)
        config = Qwen3_5MoeConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, tie_word_embeddings=False)
        config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        model = Qwen3_5MoeForConditionalGeneration(config).to(torch.bfloat16)

        exported = _export_autoround(model, tokenizer, work / "export")
        final = work / "final"
        final.mkdir()
        _reshard(exported, final, shards)
        _save(_mtp_tensors(config, seed), final / MTP_FILE)
        cfg = json.loads((final / "config.json").read_text())
        cfg["text_config"]["mtp_num_hidden_layers"] = 1
        (final / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if drafter:
            build_demo_drafter(demo_drafter_path(out_dir), seed=seed)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(final, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("demo checkpoint at %s", out_dir)
    return out_dir


def build_demo_drafter(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the demo's DFlash drafter into ``out_dir`` (replaced if it holds an earlier one).

    Weight names are those of z-lab's checkpoints as vLLM's ``DFlashDraftModel`` loads them: the
    Qwen3 decoder ``layers.*`` and final ``norm``, plus ``fc`` (the target's hidden states at
    ``target_layer_ids``, concatenated, down to the hidden size) and ``hidden_norm``; no
    ``embed_tokens`` or ``lm_head``: a DFlash drafter uses the target's."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not _is_dflash_drafter(out_dir):
        raise FileExistsError(f"{out_dir} exists and does not hold a DFlash drafter")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        config = Qwen3Config(**DRAFTER_CONFIG)
        torch.manual_seed(seed + 3)
        state = {k: v.contiguous() for k, v in Qwen3Model(config).to(torch.bfloat16).state_dict().items()
                 if not k.startswith("embed_tokens.")}
        h = config.hidden_size
        gen = torch.Generator().manual_seed(seed + 4)
        n_in = h * len(DFLASH_CONFIG["target_layer_ids"])  # the target's hidden size is the drafter's
        state["fc.weight"] = (torch.randn(h, n_in, generator=gen) * n_in ** -0.5).to(torch.bfloat16)
        state["hidden_norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        _save(state, tmp / "model.safetensors")
        with _quiet_libraries("saving the drafter config"):
            config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.update(architectures=["DFlashDraftModel"], dflash_config=dict(DFLASH_CONFIG),
                   block_size=DFLASH_CONFIG["block_size"], num_target_layers=TEXT_CONFIG["num_hidden_layers"],
                   dtype="bfloat16")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.debug("demo DFlash drafter at %s", out_dir)
    return out_dir


def _save(tensors: dict, path: Path) -> None:
    """A safetensors file written as every file of this tool is (whole or not at all, the umask's
    mode; ``safetensors.torch.save_file`` 0.8 leaves its own temporary file's 0600)."""
    from safetensors.torch import save

    write_bytes_atomic(path, save(tensors, metadata={"format": "pt"}))


def _is_dflash_drafter(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text()).get("architectures") == ["DFlashDraftModel"]
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _quiet_libraries(what: str):
    """auto-round's and transformers' prints, warnings and progress bars are about their own
    work, not the user's: kept, and shown only if that work fails."""
    chatter = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("autoround", "transformers")]
    levels = [lg.level for lg in loggers]
    tqdm_env = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # bars bind the real stderr before any redirection
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with contextlib.redirect_stderr(chatter), contextlib.redirect_stdout(chatter):
            yield
    except Exception:
        log.error("%s failed; its output was:\n%s", what, chatter.getvalue()[-4000:])
        raise
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env


@contextlib.contextmanager
def _bf16_on_every_cpu():
    """auto-round computes in bf16 only on a CPU whose CPUID advertises AVX512-BF16; elsewhere it
    turns ``amp`` off, casts the model to float32 and writes every tensor it keeps unquantized
    (the shared experts, the head, the norms) as float32. Intel exported in bf16, and torch
    computes bf16 on every CPU: the demo asks auto-round's CPU device for it, so that the demo is
    the same checkpoint on every machine."""
    from auto_round.utils.device_manager import get_ar_device

    cpu = get_ar_device("cpu")
    before = getattr(cpu, "_bf16_supported", None)
    cpu._bf16_supported = True  # what CpuInfo().bf16 caches there
    try:
        yield
    finally:
        cpu._bf16_supported = before


def _require_bf16(export_dir: Path) -> None:
    """Every tensor auto-round left unquantized is BF16, as in Intel's checkpoint (its scales are
    F16, its packed weights I32): a float32 one means auto-round ran without bf16 after all."""
    ckpt = Checkpoint.read_folder(export_dir)
    wide = sorted(t.name for t in ckpt.tensors.values() if t.dtype == "F32")
    if wide:
        raise RuntimeError(f"auto-round export: {len(wide)} tensors written as float32 (e.g. {wide[0]}), "
                           f"not bf16: this auto-round decides its compute dtype in another way")


def _export_autoround(model, tokenizer, export_dir: Path) -> Path:
    from auto_round import AutoRound

    log.debug("auto-round RTN export (W4A16, group 128, shared experts kept BF16) into %s", export_dir)
    with _quiet_libraries("auto-round export"), _bf16_on_every_cpu():
        # RTN (iters=0) needs no data; the optimised RTN crashes on the full-attention layer's mask
        ar = AutoRound(model, tokenizer=tokenizer, scheme="W4A16", iters=0, disable_opt_rtn=True,
                       ignore_layers="shared_expert.", device_map="cpu")
        ar.quantize_and_save(str(export_dir), format="auto_round:auto_gptq")
    found = [p.parent for p in export_dir.rglob("config.json")]
    if len(found) != 1:
        raise RuntimeError(f"auto-round export: expected one config.json under {export_dir}, found {found}")
    _require_bf16(found[0])
    return found[0]


def _reshard(src: Path, dst: Path, shards: int) -> None:
    """Copy an exported folder, re-sharding its weights into ``shards`` files by byte ranges."""
    ckpt = Checkpoint.read_folder(src)
    tensors = [OutTensor(t.name, t.dtype, t.shape, ByteRange(ckpt.path_of(t), t.start, t.nbytes))
               for t in ckpt.tensors.values()]
    total = sum(t.nbytes for t in tensors)
    plans = plan_shards(tensors, max_shard_bytes=-(-total // shards) + 1)
    for p in plans:
        write_shard(p, dst)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    write_index(dst, plans)
