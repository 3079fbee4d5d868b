"""Sparse mixture-of-experts block: top-k router and experts sharded over the EP ranks.

Each rank holds `num_experts / ep_size` experts, each with its `1 / moe_tp_size` slice of the
intermediate dimension. Every rank sees every token, computes what its experts owe to the tokens routed
to them, and one all-reduce over the TP group sums the pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.llm.distributed import divide, get_parallel_state, tp_all_reduce
from vlm_serve.llm.layers.linear import ReplicatedLinear


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        state = get_parallel_state()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_local_experts = divide(num_experts, state.ep_size)
        self.expert_start = state.ep_rank * self.num_local_experts
        self.intermediate = divide(intermediate_size, state.moe_tp_size)
        self.moe_tp_rank = state.moe_tp_rank
        self.hidden_size = hidden_size
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        # (experts, out, in) like nn.Linear weights: gate and up stacked in w13
        self.w13 = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.intermediate, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate), requires_grad=False)

    def load_gate_up(self, loaded: torch.Tensor) -> None:
        """Loads fused experts as (experts, 2 * intermediate, hidden): gate rows first, then up rows."""
        local = loaded[self.expert_start : self.expert_start + self.num_local_experts]
        gate, up = local.chunk(2, dim=1)
        rows = slice(self.moe_tp_rank * self.intermediate, (self.moe_tp_rank + 1) * self.intermediate)
        self.w13.data.copy_(torch.cat([gate[:, rows], up[:, rows]], dim=1))

    def load_down(self, loaded: torch.Tensor) -> None:
        """Loads fused experts as (experts, hidden, intermediate)."""
        local = loaded[self.expert_start : self.expert_start + self.num_local_experts]
        cols = slice(self.moe_tp_rank * self.intermediate, (self.moe_tp_rank + 1) * self.intermediate)
        self.w2.data.copy_(local[:, :, cols])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        out = torch.zeros_like(x)
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        for local_id in range(self.num_local_experts):
            e = self.expert_start + local_id
            if counts[e] == 0:
                continue
            picks = order[offsets[e] : offsets[e + 1]]  # positions in the flattened (token, k) grid
            tokens = picks // self.top_k
            gate_up = F.linear(x[tokens], self.w13[local_id])
            gate, up = gate_up.chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[local_id])
            out.index_add_(0, tokens, y * weights.flatten()[picks, None])
        return tp_all_reduce(out)
