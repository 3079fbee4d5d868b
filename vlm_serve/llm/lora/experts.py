"""LoRA on a mixture-of-experts block's experts, as peft adapts a fused expert parameter (`target_parameters`
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`): one low-rank pair per expert, its `A` (experts x rank,
in) and `B` (out, rank x experts) with the expert as the fastest-moving index of `B`'s columns.

Slots hold, per adapter and local expert, `A` (rank, in) and `B` (out, rank) with the scaling folded into
`B`, cut as the block's weights are: this EP rank's experts, and of the intermediate dimension this MoE-TP
rank's slice (`B`'s gate and up rows for w13, `A`'s columns for w2, whose partial products the block's
all-reduce sums)."""

from __future__ import annotations

import torch

from vlm_serve.llm.lora.layer import LoRABatch, add_products


class ExpertLoRASlots:
    """A SparseMoeBlock's adapters: `A[w]` (experts, slots, max_rank, in) and `B[w]` (experts, slots, out,
    max_rank) for w13 (`w` 0) and w2 (1)."""

    def __init__(self, block, num_slots: int, max_rank: int) -> None:
        """`block`: the SparseMoeBlock it belongs to (not imported: it imports this module)."""
        self.block = block
        experts, hidden, inter = block.num_local_experts, block.hidden_size, block.intermediate
        shapes = (((hidden,), (2 * inter,)), ((inter,), (hidden,)))  # (in, out) of w13 and w2
        kw = {"dtype": torch.float32, "device": block.device}
        self.A = [torch.zeros(experts, num_slots, max_rank, i, **kw) for (i,), _ in shapes]
        self.B = [torch.zeros(experts, num_slots, o, max_rank, **kw) for _, (o,) in shapes]

    def which(self, a: torch.Tensor, b: torch.Tensor) -> int | None:
        """Whether a peft pair of checkpoint shapes `a` (experts x rank, in), `b` (out, experts x rank) adapts
        w13 (0: in the hidden size, out twice the intermediate) or w2 (1); None if neither."""
        hidden, inter = self.block.hidden_size, self.block.intermediate * self.block.moe_tp_size
        for w, (i, o) in enumerate(((hidden, 2 * inter), (inter, hidden))):
            if a.shape[1] == i and b.shape[0] == o:
                return w
        return None

    def set(self, slot: int, w: int, a: torch.Tensor, b: torch.Tensor, rank: int, scaling: float) -> None:
        block, experts = self.block, self.block.num_experts
        if a.shape[0] != rank * experts or b.shape[1] != rank * experts:
            raise ValueError(
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: not rank {rank} x {experts} experts"
            )
        local = slice(block.expert_start, block.expert_start + block.num_local_experts)
        a = a.view(experts, rank, -1)[local]
        b = (b.view(b.shape[0], rank, experts)[:, :, local] * scaling).permute(2, 0, 1)  # (experts, out, rank)
        cut = block.intermediate_slice()
        if w == 0:  # this rank's gate rows, then its up rows
            gate, up = b.chunk(2, dim=1)
            b = torch.cat([gate[:, cut], up[:, cut]], dim=1)
        else:
            a = a[:, :, cut]
        self.A[w][:, slot, :rank] = a.to(self.A[w].dtype)
        self.B[w][:, slot, :, :rank] = b.to(self.B[w].dtype)

    def clear(self, slot: int) -> None:
        for t in (*self.A, *self.B):
            t[:, slot].zero_()

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, w: int, expert: int, slots: torch.Tensor) -> None:
        """Adds to `y` (rows of expert `expert`'s w13 or w2 product for `x`) each row's adapter product
        (`slots`: each row's slot, -1 the base)."""
        batch = LoRABatch.of_rows(slots.tolist())
        if batch is not None:
            add_products(x, y, self.A[w][expert], self.B[w][expert], batch)
