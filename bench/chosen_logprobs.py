"""Benchmark the learner's scoring of every row: chunked chosen-token logprobs against the log-softmax.

Usage::

    python bench/chosen_logprobs.py [--rows 4] [--length 1500] [--threads 2]

The embedded SmolLM2-135M-Instruct (fp32, CPU) scores ``--rows`` random sequences of ``--length``
tokens at every position (the unshared path, :func:`toolgym.training.learn.loss.token_scores`, with
entropies), then the backward pass of their summed logprobs. Each path runs in a fresh process, so
each peak RSS is that path's own: ``chunked`` (:mod:`toolgym.training.learn.chosen_logprobs`,
chunked at any size) and ``softmax`` (a log-softmax over each row's whole logits, as before). Printed: seconds,
peak RSS, the logprob sum, the mean entropy and the gradient norm (equal up to float rounding).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(path: str, rows: int, length: int, threads: int) -> dict[str, float]:
    """Score and backpropagate in this process; ``path`` is ``chunked`` or ``softmax``."""
    import torch
    from transformers import AutoModelForCausalLM

    import toolgym.training.learn.chosen_logprobs as chosen
    from toolgym.agents.policies.spec import resolve_model_dir
    from toolgym.training.learn.scoring import token_scores

    if path == "softmax":
        chosen.lm_parts = lambda model: None
    else:  # chunked whatever the size (at the default size it would be anyway)
        chosen.WHOLE_BYTES = 0
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(None)), dtype=torch.float32)
    vocab = model.config.vocab_size
    sequences = [torch.randint(0, vocab, (length,)).tolist() for _ in range(rows)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    logp, valid, ent = token_scores(model, sequences, entropy=True)
    total = (logp * valid).sum()
    total.backward()
    seconds = time.perf_counter() - start
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return {
        "seconds": seconds,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "before_mib": before,
        "logp_sum": float(total.detach()),
        "entropy": float(ent[:, 1:].mean()),
        "grad_norm": float(norm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--path", choices=["chunked", "softmax"], help=argparse.SUPPRESS)  # one child's
    args = parser.parse_args()
    if args.path:
        print(json.dumps(one(args.path, args.rows, args.length, args.threads)))
        return
    results = {}
    for path in ("chunked", "softmax"):
        command = [sys.executable, __file__, "--path", path, "--rows", str(args.rows)]
        command += ["--length", str(args.length), "--threads", str(args.threads)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[path] = json.loads(out.strip().splitlines()[-1])
    print(f"scoring {args.rows} x {args.length} tokens at every position, forward and backward")
    print("| path | seconds | peak RSS | rise | logprob sum | mean entropy | grad norm |")
    print("|---|---|---|---|---|---|---|")
    for path, r in results.items():
        print(
            f"| {path} | {r['seconds']:.1f} | {r['peak_mib']:.0f} MiB | {r['peak_mib'] - r['before_mib']:.0f} MiB "
            f"| {r['logp_sum']:.4f} | {r['entropy']:.5f} | {r['grad_norm']:.6f} |"
        )
    chunked, softmax = results["chunked"], results["softmax"]
    print(
        f"\nchunked: {chunked['peak_mib'] / softmax['peak_mib']:.2f}x the softmax path's peak RSS, "
        f"{softmax['seconds'] / chunked['seconds']:.2f}x its speed"
    )


if __name__ == "__main__":
    main()
