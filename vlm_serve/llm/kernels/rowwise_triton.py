"""The decoder's row-wise operations on CUDA in one Triton launch each, what rowwise_cpu does on CPU: RMSNorm
(after the residual add, where there is one), Qwen3's QK norm with the rotary embedding for q and k
together and the gated MLP's silu(gate) * up (the store of K and V rows is kv_cache/store_triton.py's).

In torch each is several kernels (a decode step of Qwen3-VL-8B's shapes launched ~2,200, most of them these,
each reading and writing its rows again). The arithmetic is torch's, rounded where torch rounds: sums and
the norm in float32, then x's dtype after each product or sum torch takes in it, so that the results equal
the module-by-module path's but for float32 summation order.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (no Triton: torch's operations)
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        n,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = x.dtype
        x = x.to(tl.float32)
        if HAS_RESIDUAL:  # the stream: residual + x in x's dtype
            x = (x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
            x = x.to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,
        wq_ptr,
        wk_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        heads,
        kv_heads,
        stride_qkv,
        stride_cos,
        stride_sin,
        eps,
        HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        src = qkv_ptr + token * stride_qkv + head * 2 * HALF
        x1 = tl.load(src + offs)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(src + HALF + offs).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        if head < heads:
            w_ptr = wq_ptr
            dst = q_ptr + (token * heads + head) * 2 * HALF
        else:
            w_ptr = wk_ptr
            dst = k_ptr + (token * kv_heads + head - heads) * 2 * HALF
        w1 = tl.load(w_ptr + offs).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
        n1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        n2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        c1 = tl.load(cos_ptr + token * stride_cos + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + token * stride_cos + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + token * stride_sin + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + token * stride_sin + HALF + offs).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each product and the sum rounded
        out1 = (n1 * c1).to(dtype).to(tl.float32) + (-n2 * s1).to(dtype).to(tl.float32)
        out2 = (n2 * c2).to(dtype).to(tl.float32) + (n1 * s2).to(dtype).to(tl.float32)
        tl.store(dst + offs, out1.to(dtype))
        tl.store(dst + HALF + offs, out2.to(dtype))

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = gate.dtype
        gate = gate.to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def handles(x: torch.Tensor) -> bool:
    """Whether these kernels take x: on CUDA, its last dimension contiguous, Triton installed."""
    return triton is not None and x.is_cuda and x.stride(-1) == 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * RMSNorm(s), s) for the stream s = residual + x (x where no residual; then None for s)."""
    rows, n = _rows(x), x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    stream = None if residual is None else torch.empty_like(x)
    res = rows if residual is None else _rows(residual)
    res_out = _rows(out) if stream is None else _rows(stream)
    if not rows.shape[0]:
        return out, stream
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        res,
        weight,
        _rows(out),
        res_out,
        n,
        rows.stride(0),
        res.stride(0),
        n,
        res_out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    return out, stream


def qk_norm_rope(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (tokens, heads, d) and k (tokens, kv_heads, d) of the qkv projection's rows, each head normed and
    rotated by its token's cos and sin (tokens, d). d a power of two."""
    tokens, d = qkv.shape[0], q_weight.shape[0]
    q = torch.empty(tokens, heads, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, kv_heads, d, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, heads + kv_heads)](
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            q,
            k,
            heads,
            kv_heads,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            eps,
            HALF=d // 2,
        )
    return q, k


def qk_norm_rope_handles(qkv: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    power_of_two = head_dim >= 2 and head_dim & (head_dim - 1) == 0
    return handles(qkv) and power_of_two and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.dtype == qkv.dtype


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate, up] along its last dimension."""
    rows, n = _rows(x), x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 2048)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, _rows(out), n, rows.stride(0), n, BLOCK=block
        )
    return out
