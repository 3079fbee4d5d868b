"""The bounds the GPU kit's figures stand beside: what a decode step must read from memory, what a picture's
tower pass and prefill must compute, and where a profiled stretch of steps left the device idle.

Counts come from the model's config, not its tensors (on CPU the weights are repacked), at one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlm_serve.config import ModelConfig

# peak HBM bandwidth (bytes/s) and dense bfloat16 rate (FLOP/s) of the GPUs the kit has met, by name
DEVICE_PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100": (3.35e12, 989e12),
    "A100": (2.0e12, 312e12),
}


def device_peaks(name: str) -> tuple[float, float] | None:
    """(HBM bytes/s, bfloat16 FLOP/s) of a GPU by its name, where known."""
    return next((peaks for key, peaks in DEVICE_PEAKS.items() if key in name), None)


@dataclass(frozen=True)
class DecodeTraffic:
    """Bytes a decode step reads: the weights every step reads whatever the batch (attention, norms, dense
    MLPs, routers, the LM head), the experts the batch's tokens touch, and each request's KV cache."""

    shared_bytes: int
    expert_bytes: int  # one expert of one layer: gate, up and down
    moe_layers: int
    experts: int
    per_token: int
    kv_bytes_per_position: int  # K and V of one position, every layer

    def experts_touched(self, batch: int) -> float:
        """Experts one layer reads for `batch` tokens, if routing spreads tokens evenly at random."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.per_token / self.experts) ** batch)

    def step_bytes(self, batch: int, context: float) -> float:
        """Bytes of one step of `batch` requests, each with `context` positions cached."""
        experts = self.moe_layers * self.experts_touched(batch) * self.expert_bytes
        return self.shared_bytes + experts + batch * context * self.kv_bytes_per_position


def decode_traffic(config: ModelConfig, weight_bytes: int = 2, kv_bytes: int = 2) -> DecodeTraffic:
    """The language model's decode traffic, weights of `weight_bytes` an element, KV of `kv_bytes`."""
    text = config.text
    hidden, head_dim = text.hidden_size, text.head_dim
    attention = hidden * (text.num_attention_heads + 2 * text.num_key_value_heads) * head_dim
    attention += text.num_attention_heads * head_dim * hidden + 2 * head_dim + 2 * hidden  # o, q/k and layer norms
    moe_layers = sum(text.is_moe_layer(i) for i in range(text.num_hidden_layers))
    dense_layers = text.num_hidden_layers - moe_layers
    shared = text.num_hidden_layers * attention + dense_layers * 3 * hidden * text.intermediate_size
    shared += moe_layers * hidden * text.num_experts + text.vocab_size * hidden + hidden  # routers, LM head, norm
    return DecodeTraffic(
        shared_bytes=shared * weight_bytes,
        expert_bytes=3 * hidden * text.moe_intermediate_size * weight_bytes,
        moe_layers=moe_layers,
        experts=text.num_experts,
        per_token=text.num_experts_per_tok,
        kv_bytes_per_position=text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * kv_bytes,
    )


def tower_flops(config: ModelConfig, patches: int) -> float:
    """FLOPs of the vision tower over one picture of `patches` patches (attention over the whole picture)."""
    v = config.vision
    h, merged = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
    per_patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h  # patch embedding
    per_patch += v.depth * (4 * h * h + 2 * h * v.intermediate_size)  # blocks' linear layers
    mergers = (1 + len(v.deepstack_visual_indexes)) * (merged * merged + merged * v.out_hidden_size)
    attention = v.depth * 4 * patches * patches * h  # scores and their sum over values
    return 2 * per_patch * patches + 2 * mergers * patches / v.spatial_merge_size**2 + attention


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of a prefill of `tokens` positions (causal attention; the LM head on the last position)."""
    text = config.text
    traffic = decode_traffic(config, weight_bytes=1)
    lm_head = text.vocab_size * text.hidden_size
    per_token = traffic.shared_bytes - lm_head + traffic.moe_layers * text.num_experts_per_tok * traffic.expert_bytes
    attention = text.num_hidden_layers * 2 * tokens * tokens * text.num_attention_heads * text.head_dim
    return 2 * per_token * tokens + 2 * lm_head + attention


@dataclass(frozen=True)
class Gap:
    """A stretch with no kernel running, and the host operations that ran during it (by overlap, in µs)."""

    start_us: float
    length_us: float
    host: list[tuple[str, float]]


def device_idle(
    kernels: list[tuple[float, float]], host_ops: list[tuple[str, float, float]], top: int = 8
) -> tuple[float, float, list[Gap]]:
    """Of kernels' (start, end) times and host operations' (name, start, end) (µs, one clock): the span from
    the first kernel's start to the last's end, the share of it some kernel ran, and its `top` longest idle
    gaps, each with the host operations that overlapped it most."""
    if not kernels:
        return 0.0, 0.0, []
    kernels = sorted(kernels)
    span = kernels[-1][1] - kernels[0][0]
    busy, gaps = 0.0, []
    run_start, run_end = kernels[0]
    for start, end in kernels[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((run_end, start - run_end))
            run_start = start
        run_end = max(run_end, end)
    busy += run_end - run_start
    found = []
    for start, length in sorted(gaps, key=lambda g: -g[1])[:top]:
        overlap: dict[str, float] = {}
        for name, op_start, op_end in host_ops:
            shared = min(op_end, start + length) - max(op_start, start)
            if shared > 0:
                overlap[name] = overlap.get(name, 0.0) + shared
        host = sorted(overlap.items(), key=lambda item: -item[1])[:5]
        found.append(Gap(start, length, [(name, round(us, 1)) for name, us in host]))
    return span, busy / span if span else 0.0, found
