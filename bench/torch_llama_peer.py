"""The PyTorch peer of parc for the Llama family (issue 19), plain PyTorch: RMSNorm, rotary
positions (rotate-half, as parc and transformers), grouped-query attention through SDPA with
`enable_gqa`, a SwiGLU MLP, q/k/v biases where the model has them (Qwen2), tied or untied
embeddings; bf16 autocast and fused AdamW. Modes:
- eager, compile: PyTorch eager and torch.compile;
- float8-tensorwise, float8-rowwise: torch.compile with torchao's float8 training
  (`convert_to_float8_training`, every linear layer but the LM head), the FP8 peer of
  docs/fp8.md; torchao is carried to the GPU machine as a wheel (bench/llama_call.sh).

One JSON line per model and mode: tokens/s, MFU (6N + 12·L·d·T FLOPs per token against the
bf16 dense peak) and the allocator's peak memory.

    torch_llama_peer.py [llama3.2-1b|qwen2.5-1.5b|tiny ...] [--batch B] [--seq T]
                        [--steps N] [--warm N] [--modes eager,compile,float8-rowwise]
                        [--device cuda|cpu]

`tiny` and `--device cpu` check the script where no GPU is (eager and compile only).
"""
import argparse, json, math, sys, time
import torch, torch.nn as nn, torch.nn.functional as F

# name: (vocab, d, layers, heads, kv_heads, ffn, theta, qkv_bias, tied, default batch at 2048)
CONFIGS = {
    "llama3.2-1b": (128256, 2048, 16, 32, 8, 8192, 500000.0, False, True, 8),
    "qwen2.5-1.5b": (151936, 1536, 28, 12, 2, 8960, 1e6, True, True, 8),
    "tiny": (256, 64, 2, 4, 2, 128, 10000.0, True, True, 2),
}
MODES = ("eager", "compile", "float8-tensorwise", "float8-rowwise")


class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-5):
        super().__init__()
        s.eps, s.weight = eps, nn.Parameter(torch.ones(d))

    def forward(s, x):
        return F.rms_norm(x, (x.shape[-1],), s.weight, s.eps)


def rope_tables(T, hd, theta, device):
    inv = theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd)
    ang = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1).float()
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    """Rotate half: pairs (i, i + hd/2), as parc's `Rope` and transformers' Llama."""
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(s, d, h, kv, ffn, qkv_bias):
        super().__init__()
        s.h, s.kv, s.hd = h, kv, d // h
        s.ln1, s.ln2 = RMSNorm(d), RMSNorm(d)
        s.qkv = nn.Linear(d, (h + 2 * kv) * s.hd, bias=qkv_bias)
        s.wo = nn.Linear(h * s.hd, d, bias=False)
        s.gate = nn.Linear(d, ffn, bias=False)
        s.up = nn.Linear(d, ffn, bias=False)
        s.down = nn.Linear(ffn, d, bias=False)

    def forward(s, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).split([s.h * s.hd, s.kv * s.hd, s.kv * s.hd], dim=-1)
        q = rope(q.view(B, T, s.h, s.hd).transpose(1, 2), cos, sin)
        k = rope(k.view(B, T, s.kv, s.hd).transpose(1, 2), cos, sin)
        v = v.view(B, T, s.kv, s.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + s.wo(y.transpose(1, 2).reshape(B, T, s.h * s.hd))
        h = s.ln2(x)
        return x + s.down(F.silu(s.gate(h)) * s.up(h))


class Llama(nn.Module):
    def __init__(s, V, T, d, L, h, kv, ffn, theta, qkv_bias, tied):
        super().__init__()
        s.embed = nn.Embedding(V, d)
        s.blocks = nn.ModuleList(Block(d, h, kv, ffn, qkv_bias) for _ in range(L))
        s.norm = RMSNorm(d)
        s.head = nn.Linear(d, V, bias=False)
        if tied:
            s.head.weight = s.embed.weight
        cos, sin = rope_tables(T, d // h, theta, None)
        s.register_buffer("cos", cos, persistent=False)
        s.register_buffer("sin", sin, persistent=False)
        for name, p in s.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(s, idx, tgt):
        x = s.embed(idx)
        for b in s.blocks:
            x = b(x, s.cos, s.sin)
        logits = s.head(s.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


def flops_per_token(n_params, L, d, T):
    """6N + 12·L·d·T (issue 19's count, as torch_peer.py's)."""
    return 6 * n_params + 12 * L * d * T


def to_float8(model, recipe):
    """torchao's float8 training on every linear layer but the LM head."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        sys.exit(f"float8 modes need torchao (carry its wheel, bench/llama_call.sh): {e}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")


def bench_one(name, cfg, B, T, mode, steps, warm, device, peak=989e12):
    V, d, L, h, kv, ffn, theta, qkv_bias, tied, _ = cfg
    torch.manual_seed(0)
    m = Llama(V, T, d, L, h, kv, ffn, theta, qkv_bias, tied).to(device)
    n = sum(p.numel() for p in m.parameters())
    if mode.startswith("float8-"):
        to_float8(m, mode.removeprefix("float8-"))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=device == "cuda")
    f = m if mode == "eager" else torch.compile(m)
    x = torch.randint(0, V, (B, T), device=device)
    y = torch.randint(0, V, (B, T), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warm):
        step()
    sync(); t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(); dt = (time.perf_counter() - t) / steps
    tok = B * T / dt
    flops = flops_per_token(n, L, d, T)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    print(json.dumps(dict(model=name, mode=mode, params=n, batch=B, seq=T,
        step_ms=round(dt * 1e3, 2), tokens_per_s=round(tok), mfu=round(tok * flops / peak, 3),
        peak_mem_gib=round(peak_mem, 2), flops_per_token=flops, loss=round(loss.item(), 3))),
        flush=True)
    del m, opt, f
    if device == "cuda":
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()


def main(argv):
    p = argparse.ArgumentParser(prog="torch_llama_peer.py")
    p.add_argument("models", nargs="*", help=f"any of {', '.join(CONFIGS)} (default: llama3.2-1b)")
    p.add_argument("--batch", type=int, help="sequences per step (default: the model's, scaled to 2048 tokens)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20); p.add_argument("--warm", type=int, default=8)
    p.add_argument("--modes", default="eager,compile", help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args(argv)
    unknown = [w for w in a.models if w not in CONFIGS] + [m for m in a.modes.split(",") if m not in MODES]
    if unknown:
        sys.exit(f"unknown model or mode {unknown[0]!r}: models {', '.join(CONFIGS)}; modes {', '.join(MODES)}")
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    for w in a.models or ["llama3.2-1b"]:
        cfg = CONFIGS[w]
        B = a.batch or max(1, cfg[-1] * 2048 // a.seq)
        for mode in a.modes.split(","):
            bench_one(w, cfg, B, a.seq, mode, a.steps, a.warm, a.device)


if __name__ == "__main__":
    main(sys.argv[1:])
