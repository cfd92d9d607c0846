"""Summarise one bench/multi_gpu.sh call: loss agreement of every multi-GPU plan with the one-GPU
run, parc's collective bus bandwidth, dp weak scaling, tp/pp throughput and pipeline stall, and
ZeRO peak memory per GPU against `parc check`.

    multi_gpu_summary.py DIR [--tolerance 1e-2]

DIR holds multi_gpu.sh's files: runs.jsonl (one line per run: name, phase, ranks, exit, and for
model runs layers/d/seq), NAME.jsonl (`parc run --log-format json`), NAME-check.json (`parc check
--format json`), NAME.smi (nvidia-smi "index, MiB" samples of every GPU, the idle reading before
"---"), cuda_nccl-multi.txt and bandwidth.txt (the cuda_nccl test binary's output). Rates are
steady state: the tokens of steps 2..N over their wall time (step 1 holds kernel compilation; a
profiled last step is left out). MFU counts 6N + 12·L·d·T FLOPs per token over 989 TFLOP/s per
GPU. Prints the tables and writes DIR/summary.json; exits 1 when a run failed, left no result, or
a loss is off by more than the tolerance.
"""
import argparse, json, os, re, sys

from jsonl import json_lines

PEAK_FLOPS = 989e12
NCCL_RING_BUSBW = 370.0  # GB/s, NCCL's own figure on 8 H100/H200, NVLink multicast off


def load_check(path):
    """The first file's entry of a `parc check --format json` document, or {}."""
    try:
        with open(path) as f:
            return json.load(f)["files"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {}


def smi_peak_gib(path):
    """The largest memory.used of any GPU above that GPU's idle reading, in GiB, or None."""
    if not os.path.exists(path):
        return None
    idle, peak, before = {}, {}, True
    with open(path) as f:
        for line in f:
            if line.strip() == "---":
                before = False
                continue
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 2 or not all(p.replace(".", "", 1).isdigit() for p in parts):
                continue
            gpu, mib = parts[0], float(parts[1])
            if before:
                idle[gpu] = mib
            else:
                peak[gpu] = max(peak.get(gpu, 0.0), mib - idle.get(gpu, 0.0))
    return max(peak.values()) / 1024 if peak else None


class Run:
    def __init__(self, d, meta):
        self.meta = meta
        self.name = meta["name"]
        lines = json_lines(os.path.join(d, self.name + ".jsonl"))
        self.steps = [l for l in lines if l.get("event") == "step"]
        self.summary = next((l for l in lines if l.get("event") == "summary"), {})
        self.profile = next((l for l in lines if l.get("event") == "profile"), None)
        self.check = load_check(os.path.join(d, self.name + "-check.json"))
        self.report = self.check.get("report") or {}
        self.smi_gib = smi_peak_gib(os.path.join(d, self.name + ".smi"))

    def failure(self):
        """Why the run has no result, for the tables."""
        if self.meta.get("invalid"):
            return f"invalid plan ({self.name}-check.json)"
        return f"exit {self.meta['exit']}"

    def ok(self):
        return self.meta["exit"] == 0 and bool(self.steps)

    def losses(self):
        return [s["loss"] for s in self.steps]

    def tokens_per_s(self):
        """Tokens of steps 2..N over their wall time, leaving out a profiled step."""
        steps = self.steps
        if self.profile is not None:
            profiled = self.profile.get("step")
            steps = [s for s in steps if s["step"] - 1 != profiled]
        if len(steps) < 2:
            return None
        seconds = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]
        tokens = sum(s["tokens"] for s in steps[1:])
        return tokens / seconds if seconds > 0 else None

    def mfu(self, rate):
        params = self.report.get("params_total")
        try:
            layers, d, seq = (int(self.meta[k]) for k in ("layers", "d", "seq"))
        except (KeyError, ValueError):
            return None
        if rate is None or params is None:
            return None
        return rate * (6 * params + 12 * layers * d * seq) / (PEAK_FLOPS * self.meta["ranks"])


def fmt(v, spec, missing="-"):
    return missing if v is None else format(v, spec)


def correctness(runs, d, tol, problems):
    out = {"tolerance": tol, "plans": []}
    test = next((r for r in runs if r.name == "cuda_nccl-multi"), None)
    if test is not None:
        text = open(os.path.join(d, "cuda_nccl-multi.txt")).read() if os.path.exists(
            os.path.join(d, "cuda_nccl-multi.txt")) else ""
        passed = test.meta["exit"] == 0 and re.search(r"test result: ok\. [1-9]", text) is not None
        out["cuda_nccl_multi_gpu_test"] = "passed" if passed else f"FAILED (exit {test.meta['exit']})"
        print(f"cuda_nccl multi_gpu_plans_through_nccl_match_the_single_rank_cpu_run: {out['cuda_nccl_multi_gpu_test']}")
        if not passed:
            problems.append("cuda_nccl multi-GPU test")
    base = next((r for r in runs if r.name == "tiny-1gpu"), None)
    plans = [r for r in runs if r.meta["phase"] == "correctness" and r.name.startswith("tiny-") and r is not base]
    if base is None or not base.ok():
        problems.append("correctness: the one-GPU tiny run left no losses")
        return out
    ref = base.losses()
    print(f"tiny.par losses against the one-GPU run ({len(ref)} steps, final {ref[-1]:.4f}), tolerance {tol:g} relative")
    print(f"{'plan':<28} {'ranks':>5} {'max rel diff':>13} {'at step':>8} {'result':>8}")
    for r in plans:
        row = dict(plan=r.name[5:], ranks=r.meta["ranks"])
        if not r.ok():
            row["result"] = r.failure()
        else:
            got = r.losses()
            if len(got) != len(ref):
                row["result"] = f"{len(got)} of {len(ref)} steps"
            else:
                diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)]
                worst = max(range(len(diffs)), key=diffs.__getitem__)
                row.update(max_rel_diff=diffs[worst], at_step=worst + 1)
                row["result"] = "ok" if diffs[worst] <= tol else "OFF"
        if row["result"] != "ok":
            problems.append(f"correctness {row['plan']}: {row['result']}")
        out["plans"].append(row)
        print(f"{row['plan']:<28} {row['ranks']:>5} {fmt(row.get('max_rel_diff'), '13.2e'):>13} "
              f"{fmt(row.get('at_step'), '8d'):>8} {row['result']:>8}")
    return out


def bandwidth(runs, d, problems):
    run = next((r for r in runs if r.name == "bandwidth"), None)
    if run is None:
        return None
    path = os.path.join(d, "bandwidth.txt")
    text = open(path).read() if os.path.exists(path) else ""
    gpus = re.search(r"(\d+) GPU\(s\), NCCL", text)
    rows = {}
    for m in re.finditer(r"^(all-reduce|all-gather|reduce-scatter)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", text, re.M):
        name, size, busbw = m.group(1), int(m.group(2)), float(m.group(5))
        rows.setdefault(name, []).append((size, busbw))
    if run.meta["exit"] != 0 or not rows:
        problems.append(f"bandwidth: exit {run.meta['exit']}, {sum(map(len, rows.values()))} rows")
    out = {"gpus": int(gpus.group(1)) if gpus else None, "reference_busbw_gbs": NCCL_RING_BUSBW, "collectives": []}
    print(f"\nparc's collectives through NCCL on {out['gpus']} GPU(s) (full table: bandwidth.txt); "
          f"reference {NCCL_RING_BUSBW:.0f} GB/s busbw (NCCL's ring on 8 GPUs), goal ≥ 90%")
    print(f"{'collective':<15} {'best busbw GB/s':>15} {'at bytes':>12} {'largest':>12} {'busbw there':>12} {'of 370':>7}")
    for name, points in rows.items():
        best = max(points, key=lambda p: p[1])
        last = max(points)
        row = dict(collective=name, best_busbw=best[1], best_at_bytes=best[0], largest_bytes=last[0],
                   busbw_at_largest=last[1], fraction_of_reference=best[1] / NCCL_RING_BUSBW)
        out["collectives"].append(row)
        print(f"{name:<15} {best[1]:>15.1f} {best[0]:>12} {last[0]:>12} {last[1]:>12.1f} {row['fraction_of_reference']:>7.1%}")
    if out["gpus"] is not None and out["gpus"] != 8:
        print(f"(the reference is an 8-GPU figure; with {out['gpus']} GPUs the ring's busbw differs)")
    return out


def scaling(runs, problems):
    rows = []
    by_model = {}
    for r in runs:
        m = re.fullmatch(r"scale-(\w+)-dp(\d+)", r.name)
        if m:
            by_model.setdefault(m.group(1), []).append((int(m.group(2)), r))
    if not by_model:
        return rows
    print("\ndata-parallel weak scaling (same batch per GPU), goal ≥ 95% efficiency")
    print(f"{'model':<6} {'GPUs':>4} {'tokens/s':>12} {'per GPU':>10} {'MFU':>6} {'efficiency':>10}")
    for model, items in by_model.items():
        items.sort(key=lambda x: x[0])
        one = next((r.tokens_per_s() for n, r in items if n == 1 and r.ok()), None)
        for n, r in items:
            rate = r.tokens_per_s() if r.ok() else None
            if rate is None:
                problems.append(f"scaling {r.name}: no rate ({r.failure()})")
            eff = rate / (n * one) if rate is not None and one else None
            row = dict(model=model, gpus=n, tokens_per_s=rate, mfu=r.mfu(rate), efficiency=eff)
            rows.append(row)
            print(f"{model:<6} {n:>4} {fmt(rate, '12,.0f'):>12} {fmt(rate / n if rate else None, '10,.0f'):>10} "
                  f"{fmt(row['mfu'], '6.1%'):>6} {fmt(eff, '10.1%'):>10}")
    return rows


def tp_pp(runs, problems):
    rows = []
    chosen = [r for r in runs if r.meta["phase"] in ("tp", "pp")]
    if not chosen:
        return rows
    print("\ntensor and pipeline parallel (examples/gpt2-1.5b-8gpu.par at d 1536, 24 heads)")
    print(f"{'run':<20} {'GPUs':>4} {'m':>3} {'tokens/s':>10} {'MFU':>6} {'ideal bubble':>21} "
          f"{'check timeline':>14} {'p2p share':>9}")
    for r in chosen:
        rate = r.tokens_per_s() if r.ok() else None
        if rate is None:
            problems.append(f"{r.meta['phase']} {r.name}: no rate ({r.failure()})")
        m = r.report.get("microbatches")
        pp = dict(r.report.get("mesh") or []).get("pp", 1)
        # interleaving v chunks per rank divides the bubble by v: (p-1)/(v·m+p-1)
        v = r.meta.get("virtual") and int(r.meta["virtual"]) or 1
        theory = (pp - 1) / (v * m + pp - 1) if m and pp > 1 else None
        lowered = r.check.get("lowered") or {}
        p2p = None
        if r.profile is not None and pp > 1:
            kinds = {k["kind"]: k for k in r.profile.get("kinds", [])}
            p2p = kinds.get("p2p", {}).get("share_pct", 0.0) / 100
        row = dict(run=r.name, gpus=r.meta["ranks"], microbatches=m, tokens_per_s=rate, mfu=r.mfu(rate),
                   bubble_theory=theory, bubble_check_timeline=lowered.get("bubble_fraction"),
                   p2p_share_profiled=p2p)
        rows.append(row)
        print(f"{r.name:<20} {row['gpus']:>4} {fmt(m, '3d'):>3} {fmt(rate, '10,.0f'):>10} {fmt(row['mfu'], '6.1%'):>6} "
              f"{fmt(theory, '21.1%'):>21} {fmt(row['bubble_check_timeline'], '14.1%'):>14} {fmt(p2p, '9.1%'):>9}")
    if any(r["gpus"] > 1 and r["bubble_theory"] is not None for r in rows):
        print("ideal bubble: (p-1)/(m+p-1); interleaved (p-1)/(v·m+p-1) with v chunks per rank; "
              "check timeline: `parc check`'s simulated step")
        print("bubble: parc measures no bubble directly; 'p2p share' is the profiled last step's share of "
              "pipeline sends/receives on the report rank (the last stage), waiting for peers included, "
              "with every op synchronized: an upper-bound proxy, not the bubble")
    return rows


def zero(runs, problems):
    rows = []
    chosen = [r for r in runs if r.meta["phase"] == "zero"]
    if not chosen:
        return rows
    print("\nZeRO peak memory per GPU against `parc check` (goal within 10%)")
    print(f"{'run':<18} {'reserved GiB':>12} {'smi GiB':>8} {'plan GiB':>9} {'cost GiB':>9} {'reserved/plan':>13} {'smi/plan':>9}")
    gib = 2 ** 30
    for r in chosen:
        if not r.ok():
            problems.append(f"zero {r.name}: {r.failure()}")
        reserved = r.summary.get("memory_reserved_bytes")
        reserved = reserved / gib if isinstance(reserved, (int, float)) else None
        plans = (r.check.get("lowered") or {}).get("memory_plans") or []
        plan = max((p["persistent_bytes"] + p["arena_bytes"] for p in plans), default=None)
        plan = plan / gib if plan else None
        roles = r.report.get("roles") or []
        cost = max((sum(v for v in role.get("memory", {}).values()) for role in roles), default=None)
        cost = cost / gib if cost else None
        row = dict(run=r.name, reserved_gib=reserved, smi_gib=r.smi_gib, plan_gib=plan, cost_model_gib=cost,
                   reserved_over_plan=reserved / plan if reserved and plan else None,
                   smi_over_plan=r.smi_gib / plan if r.smi_gib and plan else None)
        rows.append(row)
        print(f"{r.name:<18} {fmt(reserved, '12.2f'):>12} {fmt(r.smi_gib, '8.2f'):>8} {fmt(plan, '9.2f'):>9} "
              f"{fmt(cost, '9.2f'):>9} {fmt(row['reserved_over_plan'], '13.3f'):>13} {fmt(row['smi_over_plan'], '9.3f'):>9}")
    print("reserved: the run's memory_reserved_bytes (the most any rank's backend held); smi: nvidia-smi's largest "
          "memory.used of any GPU above idle (CUDA context, NCCL buffers included); plan: check's memory plan "
          "(persistent + arena, largest program); cost: the cost model's largest role total")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--tolerance", type=float, default=1e-2)
    a = p.parse_args()
    metas = json_lines(os.path.join(a.dir, "runs.jsonl"))
    runs = [Run(a.dir, m) for m in metas]
    problems = []
    result = dict(runs=metas)
    if any(m["phase"] == "correctness" for m in metas):
        result["correctness"] = correctness(runs, a.dir, a.tolerance, problems)
    result["bandwidth"] = bandwidth(runs, a.dir, problems)
    result["scaling"] = scaling(runs, problems)
    result["tp_pp"] = tp_pp(runs, problems)
    result["zero"] = zero(runs, problems)
    result["problems"] = problems
    print()
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{len(metas)} runs, {len(problems)} problem(s)")
    with open(os.path.join(a.dir, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
