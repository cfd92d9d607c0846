"""Hugging Face parity of `parc export --format hf` and `train.init = hf(DIR)` (bench/hf_parity.sh).

    hf_parity.py --model DIR --batches BATCHES.jsonl --data FILE [--format bytes|u16|u32]
                 --parc-log PARC.jsonl [--tolerance 1e-5] [--parc-logits LOGITS.json]

1. Loads DIR (a `parc export --format hf` folder) with transformers' AutoModelForCausalLM in fp32,
   recording every Python warning and every transformers log record at WARNING or above, and the
   loading info (missing, unexpected, mismatched keys): any of them fails the check.
2. Computes transformers' mean token cross-entropy on the first step's global batch of the parc
   run (BATCHES.jsonl is `parc run --log-batches`: sample i's inputs are tokens [O_i, O_i + seq) of
   the data file, its targets [O_i + 1, O_i + seq + 1)), and compares it with the step-1 loss of
   PARC.jsonl (`parc run --log-format json` with `train.init = hf("DIR")`): relative difference
   within --tolerance.
3. The logits hook: with --parc-logits (JSON {"tokens": [...], "logits": [[...], ...]}: parc's fp32
   logits for one token sequence, one row per position), compares transformers' logits on the same
   tokens within --tolerance relative (of the largest logit); `parc sample --dump-logits` writes
   the file.

Prints one JSON line with the numbers; exit code 0 within tolerance, 1 over it or on any warning.
"""
import argparse, json, logging, sys, warnings

import numpy as np
import torch


class Records(logging.Handler):
    """Collects log records at WARNING and above."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def load(model_dir):
    """The model, and every warning its loading raised or logged (an empty list: none)."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_warning()
    records = Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, output_loading_info=True
            )
    finally:
        logger.removeHandler(records)
    problems = [f"{w.category.__name__}: {w.message}" for w in caught] + records.messages
    for key, value in info.items():
        if value:
            problems.append(f"loading info {key}: {value}")
    model.eval()
    return model, problems


def tokens_of(path, fmt):
    raw = open(path, "rb").read()
    dtype = {"bytes": np.uint8, "u16": "<u2", "u32": "<u4"}[fmt]
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


def first_batch(batches_path, data):
    """Inputs and targets of step 1's global batch, [batch, seq] each."""
    with open(batches_path) as f:
        header = json.loads(f.readline())
        step = json.loads(f.readline())
    seq = header["seq"]
    assert step["step"] == 1, step
    inputs = np.stack([data[o : o + seq] for o in step["offsets"]])
    targets = np.stack([data[o + 1 : o + seq + 1] for o in step["offsets"]])
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def parc_first_loss(log_path):
    for line in open(log_path):
        event = json.loads(line)
        if event.get("event") == "step" and event.get("step") == 1:
            return event["loss"]
    raise SystemExit(f"{log_path} has no step-1 line; was it `parc run --log-format json`?")


def transformers_loss(model, inputs, targets):
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    ).item()


def logits_difference(model, path):
    """The largest |transformers - parc| logit over parc's file, relative to its largest logit."""
    parc = json.load(open(path))
    tokens = torch.tensor([parc["tokens"]])
    with torch.no_grad():
        ours = model(input_ids=tokens).logits.float()[0].numpy()
    theirs = np.asarray(parc["logits"], dtype=np.float32)[:, : ours.shape[-1]]
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--format", default="bytes", choices=["bytes", "u16", "u32"])
    p.add_argument("--parc-log", required=True)
    p.add_argument("--parc-logits")
    p.add_argument("--tolerance", type=float, default=1e-5)
    args = p.parse_args()

    torch.manual_seed(0)
    model, problems = load(args.model)
    inputs, targets = first_batch(args.batches, tokens_of(args.data, args.format))
    ours = transformers_loss(model, inputs, targets)
    parc = parc_first_loss(args.parc_log)
    rel = abs(ours - parc) / abs(ours)
    result = {
        "model": args.model,
        "class": type(model).__name__,
        "warnings": problems,
        "transformers_loss": ours,
        "parc_loss": parc,
        "loss_rel_diff": rel,
        "tolerance": args.tolerance,
    }
    ok = not problems and rel <= args.tolerance
    if args.parc_logits:
        result["logits_rel_diff"] = logits_difference(model, args.parc_logits)
        ok = ok and result["logits_rel_diff"] <= args.tolerance
    result["ok"] = ok
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
