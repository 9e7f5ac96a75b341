"""What ``hybrid-build plan --nodes N`` predicts: single-stream decode over N nodes, tensor- or
pipeline-parallel, from the single-node byte model of ``bandwidth``.

Tensor parallel (TP=N, vLLM's sharding of Qwen3.5-MoE): every node reads 1/N of each sharded
weight (attention and DeltaNet projections by heads, each routed and shared expert along its
intermediate dimension, the lm-head by vocabulary rows) and of the context (KV heads, DeltaNet
heads; KV heads are replicated once N exceeds their count), and all of the replicated ones (router,
shared-expert gate, norms, the embedding row). The nodes read in parallel, so a step costs the
bytes of one node, plus the per-step floor in full (every node launches every kernel of every
layer), plus the link: two all-reduces of the hidden state per decoder layer (attention output,
MoE output) and one for the vocab-parallel embedding, and a gather of the vocab-parallel logits.

Pipeline parallel (PP=N): each node holds 1/N of the layers and reads only those, but one stream
passes through the stages one after the other, so a step costs the bytes and floor of the whole
model plus N hops of the hidden state (N-1 between stages, one back for the sampled token). PP
splits memory, not time: it is for a model that one node cannot hold.

A collective costs ``latency x (N-1)`` (a ring's 2(N-1) steps; the given latency is that of a
two-node all-reduce of a few KB) plus its bytes over the link. Messages are a few KB, so at 200
Gb/s latency dominates. The assumptions are listed in the result and in docs/multinode.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import bandwidth as bw

LINK_GBPS = 200.0  # ConnectX-7 port of a DGX Spark: 200 Gb/s = 25 GB/s
# NOT measured yet (the two-GPU harness steps measure it on loopback). A two-node NCCL all-reduce
# of a few KB over RoCE is two network steps of a few us each (RDMA one-way ~2-5 us through
# ConnectX-7) plus NCCL's kernel and proxy work (~10 us): ~15-30 us, taken as 25. Over TCP sockets
# (no RDMA) expect 2-4x that.
LINK_LATENCY_US = 25.0
LINK_SOURCE = ("assumed, not measured: a two-node NCCL all-reduce of a few KB over RoCE, two RDMA steps of a "
               "few us plus ~10 us of NCCL kernel/proxy work (15-30 us); pass --link-latency-us with a "
               "measured value (nccl-tests all_reduce_perf -b 8K -e 8K)")
ACTIVATION_BYTES = 2  # the hidden state travels in BF16
LOGIT_BYTES = 2  # vLLM gathers the vocab-parallel logits in the model dtype
# memory per node that vLLM may fill (DGX Spark: 128 GB unified, shared with the OS)
MEMORY_GB = {"gb10": 128.0, "h200": 141.0, "h100": 80.0, "rtx-pro-6000": 96.0}
# parts every TP rank reads in full (vLLM replicates the router and the shared-expert gate; norms
# are per rank; the embedding is vocab-parallel but one row is read, by one rank)
REPLICATED = ("router", "shared_expert_gate", "norm", "embedding")
WEIGHT_PARTS_CHANGED = ("shared_expert", "lm_head")  # what the profiles change on disk


@dataclass(frozen=True)
class Link:
    """The interconnect between nodes: bandwidth in Gb/s and the latency of a two-node all-reduce
    of a few KB in microseconds."""

    gbps: float = LINK_GBPS
    latency_us: float = LINK_LATENCY_US
    source: str = LINK_SOURCE

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


def tp_bytes_per_node(parts: dict[str, int], nodes: int, kv_heads: int) -> float:
    """Bytes one node reads per decoded token under TP=``nodes``."""
    total = 0.0
    for name, b in parts.items():
        if name in REPLICATED:
            total += b
        elif name == "kv_cache":
            total += b / min(nodes, max(kv_heads, 1))  # vLLM replicates KV heads beyond their count
        else:
            total += b / nodes
    return total


def collective_s(message_bytes: float, nodes: int, link: Link, allreduce: bool = True) -> float:
    """Seconds of one ring collective among ``nodes``: latency per step pair, plus the bytes a
    node sends (an all-reduce sends 2(N-1)/N of the message, a gather (N-1)/N)."""
    share = (2 if allreduce else 1) * (nodes - 1) / nodes
    return link.latency_us * 1e-6 * (nodes - 1) + share * message_bytes / link.bytes_per_s


def tp_link(tc: dict, nodes: int, link: Link) -> dict:
    """The link's part of one TP decode step: collectives, bytes a node sends, seconds."""
    hidden, vocab = tc["hidden_size"], tc["vocab_size"]
    layers = len(bw.layer_types(tc))
    allreduces = 2 * layers + 1  # attention out + MoE out per layer, + the embedding
    message = hidden * ACTIVATION_BYTES
    logits = vocab * LOGIT_BYTES
    seconds = allreduces * collective_s(message, nodes, link) + collective_s(logits, nodes, link, allreduce=False)
    sent = allreduces * 2 * (nodes - 1) / nodes * message + (nodes - 1) / nodes * logits
    return {"allreduces_per_token": allreduces, "allreduce_bytes": message, "gathers_per_token": 1,
            "gather_bytes": logits, "traffic_bytes_per_token": sent, "link_ms": seconds * 1e3,
            "latency_ms": (allreduces + 1) * link.latency_us * 1e-3 * (nodes - 1)}


def pp_link(tc: dict, nodes: int, link: Link) -> dict:
    """N hops of the hidden state per token (N-1 between stages, one back to the first): each a
    point-to-point send, taken as half a two-node all-reduce's latency."""
    message = tc["hidden_size"] * ACTIVATION_BYTES
    hop = link.latency_us * 1e-6 / 2 + message / link.bytes_per_s
    return {"hops_per_token": nodes, "hop_bytes": message, "traffic_bytes_per_token": message,
            "link_ms": nodes * hop * 1e3}


def pp_bytes_per_node(parts: dict[str, int], nodes: int) -> float:
    """The largest stage's bytes per token: 1/N of the layers, plus the lm-head on the last."""
    head = parts.get("lm_head", 0)
    return (sum(parts.values()) - head) / nodes + head


def predict(parts_by_profile: dict[str, dict[str, int]], tc: dict, hw: bw.Hardware, floor_ms: float,
            nodes: int, link: Link = Link(), stored_bytes: int | None = None,
            input_profile: str = "base") -> dict:
    """Predicted single-stream decode on ``nodes`` nodes of ``hw`` for every profile, TP and PP.
    ``stored_bytes`` (the checkpoint's weights as served, in ``input_profile``'s form) gives the
    weights each node holds."""
    if nodes < 2:
        raise ValueError(f"nodes must be >= 2, got {nodes}")
    kv_heads = int(tc.get("num_key_value_heads") or tc.get("num_attention_heads") or 1)
    tp = tp_link(tc, nodes, link)
    pp = pp_link(tc, nodes, link)
    memory = MEMORY_GB.get(hw.name)
    profiles = {}
    for p, parts in parts_by_profile.items():
        one = sum(parts.values())
        single = bw.decode_tok_s(one, hw.bandwidth_gbps, hw.efficiency, floor_ms)
        per_node = tp_bytes_per_node(parts, nodes, kv_heads)
        tp_step = bw.step_seconds(per_node, hw.bandwidth_gbps, hw.efficiency, floor_ms) + tp["link_ms"] / 1e3
        pp_step = bw.step_seconds(one, hw.bandwidth_gbps, hw.efficiency, floor_ms) + pp["link_ms"] / 1e3
        row = {"bytes_per_token": one, "single_node_tok_s": single,
               "tp": {"bytes_per_token_per_node": per_node, "tok_s": 1 / tp_step,
                      "speedup": (1 / tp_step) / single},
               "pp": {"bytes_per_token_per_node": pp_bytes_per_node(parts, nodes), "tok_s": 1 / pp_step,
                      "speedup": (1 / pp_step) / single}}
        if stored_bytes is not None:
            changed = sum(parts.get(k, 0) - parts_by_profile[input_profile].get(k, 0) for k in WEIGHT_PARTS_CHANGED)
            weights = stored_bytes + changed
            row["weights_bytes"] = weights
            row["weights_per_node_bytes"] = weights / nodes
        profiles[p] = row
    notes = []
    if memory is not None and stored_bytes is not None:
        worst = max(r["weights_bytes"] for r in profiles.values())
        if worst > memory * 1e9:
            notes.append(f"one node ({memory:g} GB) cannot hold the weights ({worst / 1e9:.0f} GB): the single-node "
                         f"figures are hypothetical")
        if worst / nodes > 0.9 * memory * 1e9:
            notes.append(f"{nodes} nodes hold {worst / nodes / 1e9:.0f} GB of weights each, over 90% of "
                         f"{memory:g} GB: little is left for the KV cache")
    return {
        "nodes": nodes,
        "link": {"gbps": link.gbps, "latency_us": link.latency_us, "source": link.source},
        "memory_per_node_gb": memory,
        "tp": tp, "pp": pp,
        "profiles": profiles,
        "assumptions": [
            f"single stream, no speculation; per-node bandwidth and efficiency of {hw.label}, and its per-step "
            f"floor ({floor_ms:.2f} ms) paid in full on every node (TP) or once over all stages (PP)",
            f"TP={nodes}: attention, DeltaNet, routed and shared experts and the lm-head split {nodes} ways; router, "
            f"shared-expert gate, norms and the embedding row read by every node; KV cache split over "
            f"min({nodes}, {kv_heads}) KV heads",
            f"TP link per token: {tp['allreduces_per_token']} all-reduces of {tp['allreduce_bytes']:,} B (2 per layer "
            f"+ embedding) and 1 gather of {tp['gather_bytes']:,} B of logits; each collective costs "
            f"{link.latency_us:g} us x (N-1) plus its bytes at {link.gbps:g} Gb/s",
            f"PP={nodes}: the stream passes the stages in turn ({nodes} hops of {pp['hop_bytes']:,} B, each half a "
            f"two-node all-reduce's latency); it splits memory, not time",
            f"link latency {link.latency_us:g} us: {link.source}",
        ],
        "notes": notes,
    }


def render_text(mn: dict) -> str:
    n = mn["nodes"]
    link = mn["link"]
    tp = mn["tp"]
    lines = ["", f"{n} nodes over a {link['gbps']:g} Gb/s link, {link['latency_us']:g} us per two-node all-reduce "
                 f"(no speculation)",
             f"TP={n} link per token: {tp['allreduces_per_token']} all-reduces + 1 logits gather, "
             f"{tp['traffic_bytes_per_token'] / 1e6:.2f} MB sent per node, {tp['link_ms']:.2f} ms "
             f"({tp['latency_ms']:.2f} ms of it latency); PP={n}: {mn['pp']['link_ms']:.3f} ms of hops",
             f"{'profile':<11}{'GB/tok':>8}{'1 node':>8}{'TP GB/node':>12}{f'TP={n}':>8}{'PP GB/node':>12}"
             f"{f'PP={n}':>8}{'weights/node':>14}"]
    for p, r in mn["profiles"].items():
        w = f"{r['weights_per_node_bytes'] / 1e9:.1f} GB" if "weights_per_node_bytes" in r else "-"
        lines.append(f"{p:<11}{r['bytes_per_token'] / 1e9:>8.3f}{r['single_node_tok_s']:>8.1f}"
                     f"{r['tp']['bytes_per_token_per_node'] / 1e9:>12.3f}{r['tp']['tok_s']:>8.1f}"
                     f"{r['pp']['bytes_per_token_per_node'] / 1e9:>12.3f}{r['pp']['tok_s']:>8.1f}{w:>14}")
    if mn["memory_per_node_gb"]:
        lines.append(f"(tok/s, single stream; memory per node {mn['memory_per_node_gb']:g} GB)")
    for a in mn["assumptions"]:
        lines.append(f"assumption: {a}")
    for note in mn["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
