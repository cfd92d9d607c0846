"""Summarise one bench/gpu.sh call: tokens/s, MFU, peak GPU memory of the PyTorch peer (eager,
torch.compile) and parc on each model, and the ratios parc / compile and parc / eager.

    gpu_summary.py DIR [--models 124m 350m] [--modes eager compile]

DIR holds gpu.sh's files: torch-MODEL-MODE.jsonl (the peer's JSON line), parc-MODEL.jsonl
(`parc run --log-format json`), parc-MODEL-check.json (`parc check --format json`, for the
parameter count) and NAME.smi (nvidia-smi memory.used samples in MiB, the first taken before the
run). parc's rate is its steady state: tokens of steps 2..N over their wall time (step 1 holds
kernel compilation and first-touch costs). MFU counts 6N + 12·L·d·T FLOPs per token (N the
parameters, the tied head once; torch_gpt.py's count) against 989 TFLOP/s. Prints a table and
writes DIR/summary.json; exits 1 when a run left no result (the table shows what there is).
"""
import argparse, json, os, sys

from jsonl import json_lines

PEAK_FLOPS = 989e12
SHAPES = {"124m": (12, 768), "350m": (24, 1024), "774m": (36, 1280)}  # layers, d
SEQ = 1024


def smi_peak_gib(path):
    """Largest memory.used above the reading before the run, in GiB (None without samples)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        values = [float(v) for v in f.read().split() if v.replace(".", "", 1).isdigit()]
    if len(values) < 2:
        return None
    return max(0.0, max(values[1:]) - values[0]) / 1024


def parc_own_peak_gib(summary):
    """parc's own figure: `memory_reserved_bytes` of its JSON summary (what its backend held:
    planned buffers, scratch, workspace), when this build reports it."""
    value = summary.get("memory_reserved_bytes")
    if isinstance(value, (int, float)):
        return value / 2**30, "memory_reserved_bytes"
    return None, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--models", nargs="+", default=["124m", "350m"])
    p.add_argument("--modes", nargs="+", default=["eager", "compile"])
    a = p.parse_args()
    rows, ratios, missing = [], [], []
    for model in a.models:
        layers, d = SHAPES[model]
        torch_rows = {}
        for mode in a.modes:
            lines = json_lines(os.path.join(a.dir, f"torch-{model}-{mode}.jsonl"))
            if not lines:
                missing.append(f"torch {model} {mode}")
                continue
            r = lines[-1]
            torch_rows[mode] = dict(
                model=model, run=f"torch {mode}", batch=r["batch"], tokens_per_s=r["tokens_per_s"],
                mfu=r["mfu_vs_989"], step_ms=r["step_ms"], peak_alloc_gib=r["peak_mem_gb"],
                peak_smi_gib=smi_peak_gib(os.path.join(a.dir, f"torch-{model}-{mode}.smi")),
                params=r["params"], loss=r["loss"])
            rows.append(torch_rows[mode])
        params = None
        try:
            with open(os.path.join(a.dir, f"parc-{model}-check.json")) as f:
                report = json.load(f)["files"][0].get("report") or {}
            params = report.get("params_total")
        except (OSError, ValueError, KeyError, IndexError):
            pass
        lines = json_lines(os.path.join(a.dir, f"parc-{model}.jsonl"))
        steps = [l for l in lines if l.get("event") == "step"]
        summary = next((l for l in lines if l.get("event") == "summary"), {})
        if len(steps) < 2 or params is None:
            missing.append(f"parc {model} ({len(steps)} steps, params {params})")
            continue
        timed = steps[1:]
        seconds = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]
        tokens = sum(s["tokens"] for s in timed)
        tok_s = tokens / seconds if seconds > 0 else float("nan")
        flops_tok = 6 * params + 12 * layers * d * SEQ
        own, own_key = parc_own_peak_gib(summary)
        parc_row = dict(
            model=model, run="parc cuda", batch=steps[0]["tokens"] // SEQ, tokens_per_s=round(tok_s),
            mfu=round(tok_s * flops_tok / PEAK_FLOPS, 3), step_ms=round(1e3 * seconds / len(timed), 2),
            peak_alloc_gib=own, peak_alloc_source=own_key,
            peak_smi_gib=smi_peak_gib(os.path.join(a.dir, f"parc-{model}.smi")),
            params=params, loss=steps[-1]["loss"], first_step_s=steps[0]["elapsed_s"])
        rows.append(parc_row)
        for mode, t in torch_rows.items():
            ratio = dict(model=model, against=mode, tokens_per_s=parc_row["tokens_per_s"] / t["tokens_per_s"])
            if parc_row["peak_smi_gib"] and t["peak_smi_gib"]:
                ratio["peak_smi"] = parc_row["peak_smi_gib"] / t["peak_smi_gib"]
            if own is not None and t["peak_alloc_gib"]:
                ratio["peak_alloc"] = own / t["peak_alloc_gib"]
            ratios.append(ratio)

    gib = lambda v: "-" if v is None else f"{v:.1f}"
    print(f"{'model':<6} {'run':<14} {'batch':>5} {'tokens/s':>10} {'MFU':>6} {'step ms':>9} "
          f"{'peak alloc GiB':>14} {'peak smi GiB':>12}")
    for r in rows:
        print(f"{r['model']:<6} {r['run']:<14} {r['batch']:>5} {r['tokens_per_s']:>10,} {r['mfu']:>6.1%} "
              f"{r['step_ms']:>9.1f} {gib(r['peak_alloc_gib']):>14} {gib(r['peak_smi_gib']):>12}")
    for r in ratios:
        mem = "".join(f", peak {k.split('_')[1]} ×{r[k]:.2f}" for k in ("peak_smi", "peak_alloc") if k in r)
        print(f"{r['model']}: parc / torch {r['against']}: tokens/s ×{r['tokens_per_s']:.3f}{mem}")
    print("peak alloc: PyTorch's allocator maximum; parc's memory_reserved_bytes (what its backend held). "
          "peak smi: nvidia-smi memory.used above the idle reading, CUDA context included")
    for m in missing:
        print(f"missing: {m}")
    with open(os.path.join(a.dir, "summary.json"), "w") as f:
        json.dump(dict(rows=rows, ratios=ratios, missing=missing), f, indent=1)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
