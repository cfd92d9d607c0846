"""The PyTorch peer of parc: a GPT-2-style model in plain PyTorch, in two modes.

bench (from ../shared/bench/torch_gpt.py, whose numbers it reproduces): time training steps on
random tokens and print one JSON line per config: tokens/s, model-FLOPs utilisation (6N + 12*L*d*T
FLOPs per token, the PaLM/nanoGPT convention) and the allocator's peak memory.

    torch_peer.py [bench] [124m|350m|774m ...] [--batch B] [--steps N] [--warm N]
                  [--modes eager,compile]

parity: train the model a parc spec describes, from parc's initial weights and on parc's batches,
with parc's recipe, and print one JSON line per step (loss, lr, grad_norm), to compare loss curves
(bench/loss_parity.sh, bench/parity/compare.py):

    torch_peer.py parity --plan PLAN.json --init INIT.safetensors --batches BATCHES.jsonl
                  --data FILE --format bytes|u16|u32 --lr LR [--schedule cosine|linear|constant]
                  [--warmup W] [--min-lr M] [--decay-steps D] [--steps N]
                  [--device cpu|cuda] [--precision fp32|bf16] [--micro-batch M] [--residual fp32|bf16]
                  [--out FILE]

PLAN.json is `parc plan SPEC --emit json` (shapes, decay flags and every op's constants come from
it), INIT.safetensors `parc run SPEC --save-init`, BATCHES.jsonl `parc run SPEC --log-batches`.
The schedule flags repeat the spec's `train.schedule` (the plan does not carry the learning rate);
compare.py checks that both runs used the same lr at every step.

How parc's GPT-2 maps onto this model (see compiler/src/ir/op.rs and runtime/src/cpu/):
- parc's Linear weights are [out, in] like torch's; attn.wqkv (and bqkv) is the fused qkv
  projection, rows q then k then v, as the peer's; the head is tied to embed.weight (vocab padded).
- LayerNorm eps, attention scale and causality, and the activation (gelu_tanh only) are read from
  the plan's ops; there is no dropout.
- AdamW: parc's update is p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p) with wd only on
  parameters the plan marks `decay` (the 2-D ones); torch's AdamW (decoupled decay on the old p)
  is the same formula. Gradients are clipped by the global norm: coef = min(1, max / (norm + 1e-6)),
  as torch's clip_grad_norm_. The loss is the mean token cross-entropy over the global batch.
- lr at 0-based step k: warmup lr * (k + 1) / warmup for k < warmup, then cosine (or linear) from lr
  to min_lr at decay_steps, min_lr after (compiler/src/spec.rs `LrSchedule::lr_at`).
"""
import argparse, json, math, struct, sys, time
import torch, torch.nn as nn, torch.nn.functional as F


class Block(nn.Module):
    def __init__(s, d, h, eps=1e-5, scale=None, ffn=None):
        super().__init__()
        s.h, s.scale, ffn = h, scale, ffn or 4 * d
        s.ln1 = nn.LayerNorm(d, eps=eps); s.qkv = nn.Linear(d, 3 * d); s.proj = nn.Linear(d, d)
        s.ln2 = nn.LayerNorm(d, eps=eps); s.fc = nn.Linear(d, ffn); s.out = nn.Linear(ffn, d)
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, s.h, C // s.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale)
        x = x + s.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, V, T, L, d, h, eps=1e-5, scale=None, ffn=None):
        super().__init__()
        s.wte = nn.Embedding(V, d); s.wpe = nn.Embedding(T, d)
        s.blocks = nn.ModuleList(Block(d, h, eps, scale, ffn) for _ in range(L))
        s.lnf = nn.LayerNorm(d, eps=eps); s.head = nn.Linear(d, V, bias=False)
        s.head.weight = s.wte.weight
        for name, p in s.named_parameters():  # GPT-2 init: N(0, 0.02), residual projections scaled
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
    def forward(s, idx, tgt, reduction="mean"):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks: x = b(x)
        logits = s.head(s.lnf(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1), reduction=reduction)


# ---------------------------------------------------------------------------------------- bench
CONFIGS = {"124m": (12, 768, 12, 32), "350m": (24, 1024, 16, 16), "774m": (36, 1280, 20, 16)}


def flops_per_token(n_params, L, d, T):
    """6N + 12*L*d*T: the torch_gpt.py / nanoGPT count (matmul FLOPs incl. attention scores)."""
    return 6 * n_params + 12 * L * d * T


def bench_one(name, L, d, h, B, T=1024, V=50304, compile_=False, steps=30, warm=10, peak=989e12):
    torch.manual_seed(0)
    m = GPT(V, T, L, d, h).cuda()
    n = sum(p.numel() for p in m.parameters())
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    f = torch.compile(m) if compile_ else m
    x = torch.randint(0, V, (B, T), device="cuda"); y = torch.randint(0, V, (B, T), device="cuda")
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return loss
    for _ in range(warm): step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(steps): loss = step()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / steps
    tok = B * T / dt
    flops_tok = flops_per_token(n, L, d, T)
    print(json.dumps(dict(model=name, params=n, batch=B, seq=T, compile=compile_, step_ms=round(dt * 1e3, 2),
        tokens_per_s=round(tok), mfu_vs_989=round(tok * flops_tok / peak, 3),
        mfu_vs_790=round(tok * flops_tok / 790e12, 3), peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1),
        flops_per_token=flops_tok, loss=round(loss.item(), 3))), flush=True)
    del m, opt, f; torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()


def bench_main(argv):
    p = argparse.ArgumentParser(prog="torch_peer.py bench")
    p.add_argument("models", nargs="*", help=f"any of {', '.join(CONFIGS)} (default: 124m)")
    p.add_argument("--batch", type=int, help="sequences per step (default: 32 for 124m, 16 otherwise)")
    p.add_argument("--steps", type=int, default=30); p.add_argument("--warm", type=int, default=10)
    p.add_argument("--modes", default="eager,compile", help="comma-separated: eager, compile")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    unknown = [w for w in a.models if w not in CONFIGS]
    if unknown:
        sys.exit(f"unknown model {unknown[0]!r}: use {', '.join(CONFIGS)}")
    for w in a.models or ["124m"]:
        L, d, h, B = CONFIGS[w]
        for mode in a.modes.split(","):
            if mode not in ("eager", "compile"):
                sys.exit(f"--modes: unknown mode {mode!r}; use eager and/or compile")
            bench_one(w, L, d, h, a.batch or B, compile_=(mode == "compile"), steps=a.steps, warm=a.warm)


# --------------------------------------------------------------------------------------- parity
def lr_at(k, lr, schedule, warmup, min_lr, decay_steps):
    """compiler/src/spec.rs `LrSchedule::lr_at` for 0-based step k."""
    if warmup > 0 and k < warmup:
        return lr * (k + 1) / warmup
    if schedule == "constant":
        return lr
    if k >= decay_steps or decay_steps <= warmup:
        return min_lr
    t = (k - warmup) / (decay_steps - warmup)
    if schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * t)) * (lr - min_lr)
    return lr + t * (min_lr - lr)


def read_safetensors(path):
    """{name: float32 tensor} from a safetensors file of f32 tensors (what parc writes)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            sys.exit(f"{path}: tensor {name} is {info['dtype']}; parc writes F32")
        a, b = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(body[a:b]), dtype=torch.float32).reshape(info["shape"])
    return out


class SpecModel:
    """What the plan says about the model: shapes, decay flags and op constants."""
    def __init__(self, plan):
        self.params = {p["name"]: p for p in plan["params"]["params"]}
        ops = [i["op"] for prog in plan["programs"] for i in prog["instrs"] if i.get("instr") == "compute"]
        def kinds(kind):
            return [o for o in ops if o["op"] == kind]
        def one(kind, keys):
            values = {tuple(o.get(k) for k in keys) for o in kinds(kind)}
            if len(values) != 1:
                sys.exit(f"the plan's {kind} ops have {len(values)} settings of {keys}: {sorted(values, key=str)}; "
                         "the peer supports a GPT-2 model with one setting")
            return dict(zip(keys, values.pop()))
        emb = self.params.get("embed.weight"); pos = self.params.get("pos.weight")
        if emb is None or pos is None:
            sys.exit("the plan has no embed.weight / pos.weight: the peer supports GPT-2-style specs "
                     "(tied embedding, learned positions), e.g. examples/tiny.par or gpt2-124m.par")
        self.vocab, self.d = emb["shape"]; self.seq = pos["shape"][0]
        self.layers = len({n.split(".")[1] for n in self.params if n.startswith("blocks.")})
        att = one("attention", ["head_dim", "causal", "scale", "kv_heads", "heads"])
        if not att["causal"]:
            sys.exit("the plan's attention is not causal; the peer's is")
        self.head_dim = att["head_dim"]; self.heads = self.d // self.head_dim; self.scale = att["scale"]
        if att["kv_heads"] != att["heads"]:
            sys.exit("the plan's attention has grouped KV heads; the peer supports GPT-2 multi-head attention")
        self.eps = one("layer_norm", ["eps"])["eps"]
        # The activation is an op of its own, or fused into the first MLP projection's matmul.
        acts = {o["act"] for o in kinds("activation")} | {o["act"] for o in kinds("matmul") if o.get("act")}
        if len(acts) != 1:
            sys.exit(f"the plan's activations are {sorted(acts)}; the peer supports a GPT-2 model with one")
        act = acts.pop()
        if act != "gelu_tanh":
            sys.exit(f"the plan's activation is {act}; the peer supports gelu_tanh")
        adam = kinds("adam_w")
        if not adam:
            sys.exit("the plan has no AdamW op; the peer trains with AdamW only")
        self.betas = (adam[0]["beta1"], adam[0]["beta2"]); self.adam_eps = adam[0]["eps"]
        self.weight_decay = max(o["weight_decay"] for o in adam)
        clip = kinds("clip_coef")
        self.max_norm = clip[0]["max_norm"] if clip else None
        fc = self.params.get("blocks.0.mlp.fc")
        self.ffn = fc["shape"][0] if fc else 4 * self.d
        expected = {"embed.weight", "pos.weight", "ln_f.weight", "ln_f.bias"}
        for i in range(self.layers):
            expected |= {f"blocks.{i}.{n}" for n in (
                "ln1.weight", "ln1.bias", "attn.wqkv", "attn.bqkv",
                "attn.wo", "attn.bo", "ln2.weight", "ln2.bias", "mlp.fc", "mlp.fc_bias", "mlp.proj", "mlp.proj_bias")}
        if set(self.params) != expected:
            sys.exit("the plan's parameters are not the GPT-2 block's (bias everywhere, tied head): "
                     f"unexpected {sorted(set(self.params) - expected)[:6]}, missing {sorted(expected - set(self.params))[:6]}")


def load_parc_weights(model, spec, init):
    """Copy parc's global tensors into the torch model (names as in `parc plan`'s param table)."""
    def put(dst, *names):
        src = torch.cat([init[n] for n in names], dim=0) if len(names) > 1 else init[names[0]]
        if tuple(src.shape) != tuple(dst.shape):
            sys.exit(f"{'+'.join(names)}: shape {tuple(src.shape)} does not fit the peer's {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)
    missing = sorted(set(spec.params) - set(init))
    if missing:
        sys.exit(f"the init file lacks {missing[:6]}: write it with `parc run SPEC --save-init` for this spec")
    put(model.wte.weight, "embed.weight"); put(model.wpe.weight, "pos.weight")
    put(model.lnf.weight, "ln_f.weight"); put(model.lnf.bias, "ln_f.bias")
    for i, b in enumerate(model.blocks):
        p = f"blocks.{i}."
        put(b.ln1.weight, p + "ln1.weight"); put(b.ln1.bias, p + "ln1.bias")
        put(b.qkv.weight, p + "attn.wqkv"); put(b.qkv.bias, p + "attn.bqkv")
        put(b.proj.weight, p + "attn.wo"); put(b.proj.bias, p + "attn.bo")
        put(b.ln2.weight, p + "ln2.weight"); put(b.ln2.bias, p + "ln2.bias")
        put(b.fc.weight, p + "mlp.fc"); put(b.fc.bias, p + "mlp.fc_bias")
        put(b.out.weight, p + "mlp.proj"); put(b.out.bias, p + "mlp.proj_bias")


def decay_groups(model, spec, weight_decay):
    """AdamW groups: weight_decay on the 2-D weights, none on gains and biases. This is parc's
    grouping only if the plan marks exactly its 2-D parameters `decay` (checked here)."""
    for name, info in spec.params.items():
        if info["decay"] != (len(info["shape"]) == 2):
            sys.exit(f"the plan sets decay = {info['decay']} on {name} {info['shape']}; the peer decays "
                     "exactly the 2-D weights")
    params = list(model.parameters())  # the tied head is wte.weight, listed once
    return [dict(params=[p for p in params if p.dim() == 2], weight_decay=weight_decay),
            dict(params=[p for p in params if p.dim() != 2], weight_decay=0.0)]


def read_tokens(path, fmt):
    dtype = {"bytes": torch.uint8, "u16": torch.int16, "u32": torch.int32}.get(fmt)
    if dtype is None:
        sys.exit(f"--format {fmt}: use bytes, u16 or u32")
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    t = torch.frombuffer(raw, dtype=dtype).to(torch.int64)
    if fmt == "u16":
        t = t & 0xFFFF
    elif fmt == "u32":
        t = t & 0xFFFFFFFF
    return t


def read_batches(path):
    with open(path) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    if not lines or lines[0].get("event") != "batches":
        sys.exit(f"{path}: not a batch log (write it with `parc run SPEC --log-batches FILE`)")
    return lines[0], {l["step"]: l["offsets"] for l in lines[1:]}


def parity_args(prog, argv):
    """The parity flags both peers take (see the module docstring)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--plan", required=True); p.add_argument("--init", required=True)
    p.add_argument("--batches", required=True); p.add_argument("--data", required=True)
    p.add_argument("--format", required=True, choices=["bytes", "u16", "u32"])
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--warmup", type=int, default=0); p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--decay-steps", type=int, help="default: the number of steps in the batch log")
    p.add_argument("--steps", type=int, help="default: every step in the batch log")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--micro-batch", type=int, help="sequences per forward/backward (default: the global batch)")
    p.add_argument("--residual", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: round the residual stream and its gradient to bf16 after every add, as "
                        "parc's bf16 storage does without `bf16 { residual: fp32 }` (Llama peer only)")
    p.add_argument("--out", help="also write the JSON lines to this file")
    return p.parse_args(argv)


def parity_data(a, vocab, seq=None):
    """The batch log and the tokens, checked against the model (its `vocab`, and its `seq` where
    the model fixes one): (batches, tokens, (T, G), steps, decay_steps)."""
    header, batches = read_batches(a.batches)
    T, G = header["seq"], header["global_batch"]
    if seq is not None and T != seq:
        sys.exit(f"the batch log has seq {T} but the plan's model has seq {seq}: use files of one run")
    steps = a.steps or len(batches)
    decay_steps = a.decay_steps if a.decay_steps is not None else len(batches)
    missing = [k for k in range(1, steps + 1) if k not in batches]
    if missing:
        sys.exit(f"the batch log has no step {missing[0]}; it covers {len(batches)} steps")
    tokens = read_tokens(a.data, a.format)
    if int(tokens.max()) >= vocab:
        sys.exit(f"{a.data}: token {int(tokens.max())} is not below the model's vocab {vocab}")
    return batches, tokens, (T, G), steps, decay_steps


def parity_device(a):
    """The run's device, seeded, with TF32 off (fp32 means fp32; bf16 comes from autocast)."""
    torch.manual_seed(0)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(a.device)


def parity_adamw(groups, a, spec):
    """AdamW over `groups` with the plan's betas and eps (fused on CUDA)."""
    opt_args = dict(lr=a.lr, betas=spec.betas, eps=spec.adam_eps)
    if a.device == "cuda":
        opt_args["fused"] = True
    return torch.optim.AdamW(groups, **opt_args)


def parity_main(argv):
    a = parity_args("torch_peer.py parity", argv)
    if a.residual != "fp32":
        sys.exit("--residual bf16 is the Llama peer's (torch_llama_peer.py parity); this GPT-2 peer keeps autocast's fp32 residual")
    with open(a.plan) as f:
        spec = SpecModel(json.load(f))
    batches, tokens, shape, steps, decay_steps = parity_data(a, spec.vocab, spec.seq)
    dev = parity_device(a)
    model = GPT(spec.vocab, spec.seq, spec.layers, spec.d, spec.heads, eps=spec.eps, scale=spec.scale, ffn=spec.ffn)
    load_parc_weights(model, spec, read_safetensors(a.init))
    model.to(dev)
    opt = parity_adamw(decay_groups(model, spec, spec.weight_decay), a, spec)
    params = [p for p in model.parameters()]
    train_steps(model, params, opt, spec.max_norm, a, batches, tokens, shape, steps, decay_steps)


def train_steps(model, params, opt, max_norm, a, batches, tokens, shape, steps, decay_steps):
    """The parity run's steps (both peers): each step's batch from the log, the schedule's lr,
    micro batches of `a.micro_batch` summed into the mean over the global batch, clipping, one
    AdamW update, and one JSON line (to stdout and `a.out`)."""
    T, G = shape
    dev = next(model.parameters()).device
    mb = a.micro_batch or G
    out = open(a.out, "w") if a.out else None
    started = time.perf_counter()
    for k in range(steps):
        offsets = torch.tensor(batches[k + 1], dtype=torch.int64)
        seqs = tokens[offsets[:, None] + torch.arange(T + 1)[None, :]]
        x, y = seqs[:, :-1].contiguous().to(dev), seqs[:, 1:].contiguous().to(dev)
        lr = lr_at(k, a.lr, a.schedule, a.warmup, a.min_lr, decay_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        total = torch.zeros((), device=dev, dtype=torch.float32)
        for i in range(0, x.shape[0], mb):
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=(a.precision == "bf16")):
                loss = model(x[i:i + mb], y[i:i + mb], reduction="sum") / (G * T)
            loss.backward()
            total += loss.detach()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in params]))
        opt.step(); opt.zero_grad(set_to_none=True)
        line = json.dumps(dict(event="step", step=k + 1, loss=float(total), lr=lr, grad_norm=float(norm),
                               tokens=G * T, elapsed_s=round(time.perf_counter() - started, 3)))
        print(line, flush=True)
        if out:
            out.write(line + "\n"); out.flush()
    if out:
        out.close()


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["parity"]:
        parity_main(argv[1:])
    else:
        bench_main(argv[1:] if argv[:1] == ["bench"] else argv)
