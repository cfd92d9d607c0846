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

parity: train the Llama-family model a parc plan describes from parc's initial weights, on
parc's batches, with parc's recipe, one JSON line per step (bench/loss_parity.sh with
MODEL=llama, bench/parity/compare.py); the flags are torch_peer.py parity's:

    torch_llama_peer.py parity --plan PLAN.json --init INIT.safetensors --batches BATCHES.jsonl
                  --data FILE --format bytes|u16|u32 --lr LR [--schedule …] [--warmup W] …

How parc's Llama maps onto this model: attn.wqkv holds q's rows, then k's, then v's (attn.bqkv
their biases, Qwen2), rotary positions rotate halves of each head (pairs i, i + hd/2) with the
plan's rope_table theta and frequency scaling (`scaled`); mlp.gate, mlp.up, mlp.down; RMSNorm eps from the plan's rms_norm ops;
the head is head.weight, or the embedding when the plan has none (tied). AdamW, clipping, the lr
schedule and the loss (mean over the global batch) as torch_peer.py's docstring says.

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


def scaled(inv, scaling):
    """parc's RoPE frequency scaling (compiler/src/ir/rope.rs, `RopeScaling::apply`) on float64
    frequencies: None (plain), linear (every frequency / factor) or llama3 (kept under
    original / high_freq_factor wavelengths, / factor over original / low_freq_factor, blended
    between), as the plan's rope_table op carries it."""
    kind = (scaling or {}).get("kind", "none")
    if kind == "none":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind != "llama3":
        sys.exit(f"the plan's RoPE scaling {kind!r} is not one the peer models")
    f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    L = float(scaling["original_max_position"])
    wavelen = 2 * math.pi / inv
    smooth = (L / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / f + smooth * inv
    return torch.where(wavelen < L / hi, inv, torch.where(wavelen > L / lo, inv / f, blended))


def rope_tables(T, hd, theta, device, scaling=None):
    inv = theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd)
    inv = scaled(inv, scaling)
    ang = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1).float()
    return ang.cos(), ang.sin()


class RoundBf16(torch.autograd.Function):
    """The identity, its value and its gradient rounded to bf16 (nearest even) and kept in their
    dtype: a residual stream stored in bf16, as parc's bf16 storage keeps it unless
    `train.precision = bf16 { residual: fp32 }` (parity's `--residual bf16`)."""
    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


def rope(x, cos, sin):
    """Rotate half: pairs (i, i + hd/2), as parc's `Rope` and transformers' Llama."""
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(s, d, h, kv, ffn, qkv_bias, eps=1e-5, residual=lambda x: x):
        super().__init__()
        s.h, s.kv, s.hd, s.residual = h, kv, d // h, residual
        s.ln1, s.ln2 = RMSNorm(d, eps), RMSNorm(d, eps)
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
        x = s.residual(x + s.wo(y.transpose(1, 2).reshape(B, T, s.h * s.hd)))
        h = s.ln2(x)
        return s.residual(x + s.down(F.silu(s.gate(h)) * s.up(h)))


class Llama(nn.Module):
    def __init__(s, V, T, d, L, h, kv, ffn, theta, qkv_bias, tied, eps=1e-5, residual="fp32",
                 scaling=None):
        super().__init__()
        s.residual = RoundBf16.apply if residual == "bf16" else (lambda x: x)
        s.embed = nn.Embedding(V, d)
        s.blocks = nn.ModuleList(Block(d, h, kv, ffn, qkv_bias, eps, s.residual) for _ in range(L))
        s.norm = RMSNorm(d, eps)
        s.head = nn.Linear(d, V, bias=False)
        if tied:
            s.head.weight = s.embed.weight
        cos, sin = rope_tables(T, d // h, theta, None, scaling)
        s.register_buffer("cos", cos, persistent=False)
        s.register_buffer("sin", sin, persistent=False)
        for name, p in s.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(s, idx, tgt, reduction="mean"):
        x = s.residual(s.embed(idx))
        for b in s.blocks:
            x = b(x, s.cos, s.sin)
        logits = s.head(s.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1),
                               reduction=reduction)


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


# --------------------------------------------------------------------------------------- parity
class LlamaPlan:
    """What a parc plan (`parc plan SPEC --emit json`) says about a Llama-family model."""
    def __init__(s, plan):
        s.params = {p["name"]: p for p in plan["params"]["params"]}
        ops = [i["op"] for prog in plan["programs"] for i in prog["instrs"] if i.get("instr") == "compute"]
        def one(kind, keys):
            values = {tuple(json.dumps(o.get(k)) for k in keys) for o in ops if o["op"] == kind}
            if len(values) != 1:
                sys.exit(f"the plan's {kind} ops have {len(values)} settings of {keys}; the peer "
                         "supports one (a Llama-family spec: RMSNorm, RoPE, SwiGLU, GQA)")
            return dict(zip(keys, (json.loads(v) for v in values.pop())))
        if "embed.weight" not in s.params or "blocks.0.attn.wqkv" not in s.params:
            sys.exit("the plan has no embed.weight / blocks.0.attn.wqkv: the peer supports Llama-family "
                     "specs (e.g. examples/tiny-llama.par, llama3.2-1b.par)")
        s.vocab, s.d = s.params["embed.weight"]["shape"]
        s.layers = len({n.split(".")[1] for n in s.params if n.startswith("blocks.")})
        att = one("attention", ["heads", "kv_heads", "head_dim", "causal", "scale"])
        if not att["causal"] or abs(att["scale"] - att["head_dim"] ** -0.5) > 1e-12:
            sys.exit("the plan's attention is not causal with scale 1/sqrt(head_dim); the peer's is")
        s.heads, s.kv_heads = att["heads"], att["kv_heads"]
        if att["head_dim"] * s.heads != s.d:
            sys.exit("the plan's heads × head_dim is not d; the peer supports head_dim = d / heads")
        rope = one("rope_table", ["theta", "scaling"])
        s.theta, s.scaling = rope["theta"], rope["scaling"]
        s.eps = one("rms_norm", ["eps"])["eps"]
        s.ffn = s.params["blocks.0.mlp.gate"]["shape"][0]
        s.qkv_bias = "blocks.0.attn.bqkv" in s.params
        s.tied = "head.weight" not in s.params
        adam = [o for o in ops if o["op"] == "adam_w"]
        if not adam:
            sys.exit("the plan has no AdamW op; the peer trains with AdamW only")
        s.betas = (adam[0]["beta1"], adam[0]["beta2"]); s.adam_eps = adam[0]["eps"]
        s.weight_decay = max(o["weight_decay"] for o in adam)
        clip = [o for o in ops if o["op"] == "clip_coef"]
        s.max_norm = clip[0]["max_norm"] if clip else None

    def names(s, model):
        """(torch parameter, parc tensor name) for every parameter of the peer."""
        pairs = [(model.embed.weight, "embed.weight"), (model.norm.weight, "ln_f.weight")]
        if not s.tied:
            pairs.append((model.head.weight, "head.weight"))
        for i, b in enumerate(model.blocks):
            p = f"blocks.{i}."
            pairs += [(b.ln1.weight, p + "ln1.weight"), (b.qkv.weight, p + "attn.wqkv"),
                      (b.wo.weight, p + "attn.wo"), (b.ln2.weight, p + "ln2.weight"),
                      (b.gate.weight, p + "mlp.gate"), (b.up.weight, p + "mlp.up"),
                      (b.down.weight, p + "mlp.down")]
            if s.qkv_bias:
                pairs.append((b.qkv.bias, p + "attn.bqkv"))
        return pairs


def parity_main(argv):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import torch_peer as gpt  # its flags, file readers, optimizer and training loop
    a = gpt.parity_args("torch_llama_peer.py parity", argv)
    with open(a.plan) as f:
        spec = LlamaPlan(json.load(f))
    batches, tokens, (T, G), steps, decay_steps = gpt.parity_data(a, spec.vocab)
    dev = gpt.parity_device(a)
    model = Llama(spec.vocab, T, spec.d, spec.layers, spec.heads, spec.kv_heads, spec.ffn,
                  spec.theta, spec.qkv_bias, spec.tied, spec.eps, a.residual, spec.scaling)
    init = gpt.read_safetensors(a.init)
    pairs = spec.names(model)
    unmapped = sorted(set(spec.params) - {n for _, n in pairs})
    if unmapped:
        sys.exit(f"the plan has parameters the peer does not model: {unmapped[:6]}")
    for dst, name in pairs:
        if name not in init:
            sys.exit(f"the init file lacks {name}: write it with `parc run SPEC --save-init` for this spec")
        if tuple(init[name].shape) != tuple(dst.shape):
            sys.exit(f"{name}: shape {tuple(init[name].shape)} does not fit the peer's {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(init[name])
    # parc decays the parameters its plan marks `decay`: the same tensors here.
    decay = [dst for dst, n in pairs if spec.params[n]["decay"]]
    rest = [dst for dst, n in pairs if not spec.params[n]["decay"]]
    model.to(dev)
    opt = gpt.parity_adamw([dict(params=decay, weight_decay=spec.weight_decay),
                            dict(params=rest, weight_decay=0.0)], a, spec)
    gpt.train_steps(model, decay + rest, opt, spec.max_norm, a, batches, tokens, (T, G), steps,
                    decay_steps)

if __name__ == "__main__":
    if sys.argv[1:2] == ["parity"]:
        parity_main(sys.argv[2:])
    else:
        main(sys.argv[1:])
