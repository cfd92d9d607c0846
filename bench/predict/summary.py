"""Predicted against measured step times of bench/predict_call.sh's output folder.

    python3 bench/predict/summary.py CONFIGS OUT

One row per configuration: the step `parc check` predicted (its simulated timeline, priced by the
call's profile), the measured median of steps 3.. of `parc run`, and measured / predicted. Then,
per model (the name up to its first `/`): Kendall's tau between predicted and measured order, and
how far the predicted fastest is from the measured fastest. Then, where the runs were profiled
(`parc run --profile`), each kind of work's measured time in the profiled step against the
timeline's price of the same instructions, per configuration and summed over all. Last, where
the call logged the GPU's clock (clocks.csv, `nvidia-smi` every 200 ms) and each run's time window
(window-NAME.txt, window-calibrate.txt: its start and end in nvidia-smi's timestamp format), the
median SM clock and power under load (samples above 300 W) during calibrate and during each run:
compute-bound points timed at a higher clock than a step sustains price it low.
"""
import csv
import json
import statistics
import sys
from datetime import datetime
from pathlib import Path

# nvidia-smi's timestamp, as predict_call.sh writes the windows too.
STAMP = "%Y/%m/%d %H:%M:%S.%f"
# Samples above this draw count as under load.
LOADED_W = 300.0


def predicted(path):
    try:
        doc = json.loads(path.read_text())
        return doc["files"][0]["lowered"]["step_seconds"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def measured(path):
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    steps = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step" and e.get("tokens_per_s"):
            steps.append(e["tokens"] / e["tokens_per_s"])
    timed = steps[2:]
    return statistics.median(timed) if timed else None


def kendall_tau(xs, ys):
    concordant = discordant = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            s = (xs[i] - xs[j]) * (ys[i] - ys[j])
            concordant += s > 0
            discordant += s < 0
    pairs = len(xs) * (len(xs) - 1) / 2
    return (concordant - discordant) / pairs if pairs else float("nan")


def main(configs, out):
    rows = []
    for line in Path(configs).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name = line.split()[0]
        file = name.replace("/", "_")
        rows.append((name, predicted(out / f"check-{file}.json"), measured(out / f"run-{file}.jsonl")))
    print(f"{'configuration':<28} {'predicted':>10} {'measured':>10} {'meas/pred':>9}")
    within = 0
    both = [r for r in rows if r[1] and r[2]]
    for name, p, m in rows:
        ps = f"{p * 1e3:.1f} ms" if p else "-"
        ms = f"{m * 1e3:.1f} ms" if m else "-"
        ratio = f"{m / p:.3f}" if p and m else "-"
        within += bool(p and m and abs(m / p - 1) <= 0.10)
        print(f"{name:<28} {ps:>10} {ms:>10} {ratio:>9}")
    print(f"within 10%: {within} of {len(both)} measured")
    models = sorted({n.split("/")[0] for n, _, _ in both})
    for model in models:
        group = [r for r in both if r[0].split("/")[0] == model]
        if len(group) < 2:
            continue
        tau = kendall_tau([r[1] for r in group], [r[2] for r in group])
        pick = min(group, key=lambda r: r[1])
        best = min(group, key=lambda r: r[2])
        print(f"{model}: Kendall tau {tau:.2f} over {len(group)}; predicted fastest {pick[0]} "
              f"measures {pick[2] * 1e3:.1f} ms, {(pick[2] / best[2] - 1) * 100:.1f}% over the "
              f"measured fastest {best[0]} ({best[2] * 1e3:.1f} ms)")


def profile(path):
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "profile":
            return e
    return None


def kinds_table(configs, out):
    totals = {}
    printed = False
    for line in Path(configs).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name = line.split()[0]
        p = profile(out / f"run-{name.replace('/', '_')}.jsonl")
        if not p:
            continue
        if not printed:
            print(f"\nper kind, profiled step: measured ms / predicted ms (ratio)")
            printed = True
        cells = []
        for k in p["kinds"]:
            m, q = k["ms"], k.get("predicted_ms")
            t = totals.setdefault(k["kind"], [0.0, 0.0])
            t[0] += m
            t[1] += q or 0.0
            ratio = f" ({m / q:.2f})" if q else ""
            cells.append(f"{k['kind']} {m:.1f}/{q:.1f}{ratio}" if q else f"{k['kind']} {m:.1f}")
        step = p.get("predicted_step_ms")
        head = f"{name}: step {p['step_ms']:.1f}" + (f"/{step:.1f}" if step else "")
        print(head + "; " + ", ".join(cells))
    ops = {}
    for line in Path(configs).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        p = profile(out / f"run-{line.split()[0].replace('/', '_')}.jsonl")
        for o in (p or {}).get("ops", []):
            t = ops.setdefault(o["op"], [0.0, 0.0])
            t[0] += o["ms"]
            t[1] += o.get("predicted_ms") or 0.0
    if ops:
        print("\nper op, summed over the profiled steps: measured ms / predicted ms (ratio)")
        for op, (m, q) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"  {op:<36} {m:9.1f} / {q:9.1f}" + (f"  ({m / q:.2f})" if q else ""))
    if totals:
        print("all configurations: " + ", ".join(
            f"{k} {m:.0f}/{q:.0f}" + (f" ({m / q:.2f})" if q else "") for k, (m, q) in totals.items()))


def clock_samples(path):
    """(time, SM MHz, W) of each readable row of nvidia-smi's CSV log; [] where there is none."""
    try:
        rows = list(csv.reader(path.open()))
    except OSError:
        return []
    samples = []
    for r in rows[1:]:
        try:
            samples.append((datetime.strptime(r[0].strip(), STAMP), float(r[1].split()[0]),
                            float(r[2].split()[0])))
        except (ValueError, IndexError):
            continue
    return samples


def window(path):
    """A run's (start, end) from its window file, or None."""
    try:
        start, end = path.read_text().strip().splitlines()[:2]
        return datetime.strptime(start.strip(), STAMP), datetime.strptime(end.strip(), STAMP)
    except (OSError, ValueError):
        return None


def loaded(samples, span):
    """The median clock and power of the samples above LOADED_W inside span, or None."""
    inside = [(c, w) for t, c, w in samples if span[0] <= t <= span[1] and w > LOADED_W]
    if not inside:
        return None
    return statistics.median(c for c, _ in inside), statistics.median(w for _, w in inside), len(inside)


def clocks_table(configs, out):
    samples = clock_samples(out / "clocks.csv")
    names = ["calibrate"] + [line.split()[0] for line in Path(configs).read_text().splitlines()
                             if line.strip() and not line.startswith("#")]
    rows = []
    for name in names:
        span = window(out / f"window-{name.replace('/', '_')}.txt")
        seen = loaded(samples, span) if span else None
        if seen:
            rows.append((name, *seen))
    if not rows:
        return
    print(f"\nSM clock under load (samples above {LOADED_W:.0f} W): median MHz, median W, samples")
    for name, mhz, watts, n in rows:
        print(f"  {name:<28} {mhz:6.0f} MHz {watts:6.0f} W {n:5d}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    kinds_table(sys.argv[1], Path(sys.argv[2]))
    clocks_table(sys.argv[1], Path(sys.argv[2]))
