"""PyTorch SDPA causal attention forward + backward (bf16) on the shapes of
tests/cuda_attention_bench.rs, timed with CUDA events (median of repeats), one JSON line per
point; with --parc FILE, also a table of parc's points (the JSON lines in FILE) beside SDPA's.
With --grid, the bench's PARC_ATT_GRID=1 points instead: head dim {64, 128} x T {1k, 2k, 4k, 8k}
x GQA ratio {1, 4, 6}, 12 heads, B*T = 16k (GQA through SDPA's enable_gqa, PyTorch >= 2.5).
FLOPs as in PyTorch's attention benchmark: causal forward 4*B*H*T^2*d/2, backward 2.5x."""
import argparse
import json

# The micro-benchmark's shapes, then GPT-2 124M's and 350M's training-step shapes.
# (B, H, KVH, T, D).
POINTS = [(8, 16, 16, 1024, 64), (8, 16, 16, 4096, 64), (8, 8, 8, 1024, 128), (8, 8, 8, 4096, 128),
          (8, 12, 12, 1024, 64), (32, 12, 12, 1024, 64), (16, 16, 16, 1024, 64)]
GRID = [(16384 // t, 12, 12 // r, t, d) for d in (64, 128) for t in (1024, 2048, 4096, 8192) for r in (1, 4, 6)]


def sdpa_points(points):
    import torch
    import torch.nn.functional as F

    rows = []
    for b, h, point_kvh, t, d in points:
        kvh = point_kvh
        q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, kvh, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
        iters = 5 if t >= 4096 else 20

        def fwd():
            if kvh == h:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        if kvh != h:
            try:
                fwd()
            except TypeError:
                # PyTorch before 2.5 has no enable_gqa: time SDPA on k, v repeated to every head
                # (what it would run), the repeat outside the timed region.
                k, v = (x.detach().repeat_interleave(h // kvh, dim=1).requires_grad_() for x in (k, v))
                kvh = h

        for _ in range(3):
            fwd().backward(do)
        fwd_ms, bwd_ms = [], []
        for _ in range(iters):
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            o = fwd()
            e[1].record()
            o.backward(do)
            e[2].record()
            torch.cuda.synchronize()
            fwd_ms.append(e[0].elapsed_time(e[1]))
            bwd_ms.append(e[1].elapsed_time(e[2]))
            q.grad = k.grad = v.grad = None
        f, bw = sorted(fwd_ms)[iters // 2], sorted(bwd_ms)[iters // 2]
        flop = 4 * b * h * t * t * d / 2
        row = {"impl": "torch-sdpa", "B": b, "H": h, "KVH": point_kvh, "T": t, "D": d, "fwd_ms": round(f, 3), "bwd_ms": round(bw, 3),
               "fwd_tflops": round(flop / f / 1e9, 1), "bwd_tflops": round(2.5 * flop / bw / 1e9, 1),
               "fwdbwd_tflops": round(3.5 * flop / (f + bw) / 1e9, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parc", help="file holding parc's JSON lines (cuda_attention_bench output)")
    ap.add_argument("--grid", action="store_true", help="the bench's PARC_ATT_GRID=1 points")
    args = ap.parse_args()
    sdpa = {(r["B"], r["H"], r["KVH"], r["T"], r["D"]): r for r in sdpa_points(GRID if args.grid else POINTS)}
    if not args.parc:
        return
    print(f"{'impl':28} {'B':>2} {'H':>3} {'KVH':>3} {'T':>5} {'D':>4} {'fwd TF/s':>9} {'bwd TF/s':>9} {'f+b TF/s':>9} {'SDPA f+b':>9} {'ratio':>6}")
    with open(args.parc) as fh:
        for line in fh:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            kvh = r.get("KVH", r["H"])
            s = sdpa.get((r["B"], r["H"], kvh, r["T"], r["D"]))
            ref = s["fwdbwd_tflops"] if s else float("nan")
            print(f"{r['impl']:28} {r['B']:>2} {r['H']:>3} {kvh:>3} {r['T']:>5} {r['D']:>4} {r['fwd_tflops']:>9} {r['bwd_tflops']:>9} "
                  f"{r['fwdbwd_tflops']:>9} {ref:>9} {r['fwdbwd_tflops'] / ref:>6.2f}")


if __name__ == "__main__":
    main()
