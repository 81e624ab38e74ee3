#!/usr/bin/env python
"""The paper's Table 3 / Figure 4 latencies on one GPU, with random weights (no download, no network).

    python scripts/gpu_latency.py                      # CUDA, paper shapes, bf16 -> results/h200/latency.json
    python scripts/gpu_latency.py --device cpu --shapes tiny --out-dir /tmp/x   # the same code path, seconds

At the paper's shapes (Qwen3-8B: hidden 4096, 36 layers, V = 151936; the 5-layer dFlash drafter; r = 256;
B = 16) it times, per block at batch 1: the target's 1-token decoding step and 16-token verification (a
transformers Qwen3 model built from a config, random bf16 weights), the drafter forward, the base
readout, xPress refinement at K = 1..8 (adaptive, worst-case blocks) and as a CUDA-graph replay of the
fixed-K rollout (the pass compiled with torch.compile when that works), and the Markov head's 15 serial
steps (eager and as a CUDA graph). Medians with the IQR, ratios to the Markov head, provenance.

Needs only torch and transformers: it imports ``xpress.studies.latency`` and what that imports (torch,
numpy and pyyaml, which transformers brings), never pandas, seaborn, datasets or papermill. Run from the
repository root or anywhere: the repository is put on ``sys.path``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    import torch

    from xpress.studies.latency import LatencyConfig, run_latency

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="paper", help="paper (default) or tiny (a CPU check in seconds)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--no-target", action="store_true", help="skip the random Qwen3 target (8B parameters)")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile of the Jacobi pass")
    parser.add_argument("--no-graphs", action="store_true", help="no CUDA-graph variants")
    parser.add_argument("--frames", type=int, default=64,
                        help="also time the target on frames of this many positions (target.frame_rows of the GPU "
                             "presets; 0: not)")
    parser.add_argument("--name", default="h200", help="results/<name>/latency.json")
    parser.add_argument("--out-dir", default=None, help="default: results/<name>/")
    args = parser.parse_args(argv)
    if args.shapes not in ("paper", "tiny"):
        parser.error(f"--shapes {args.shapes!r}: use paper or tiny")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU; use --device cpu --shapes tiny for a CPU check")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    lc = LatencyConfig(ks=tuple(range(1, args.max_k + 1)), repeats=args.repeats, warmup=3, device=args.device,
                       dtype=dtype, target=not args.no_target, cuda_graphs=not args.no_graphs,
                       compile=not args.no_compile and args.device.startswith("cuda"), frames=args.frames)
    t0 = time.perf_counter()
    result = run_latency("paper", [args.shapes], lc, out_dir=args.out_dir, results_name=args.name)
    s = result["shape_sets"][args.shapes]
    summary = {"seconds": round(time.perf_counter() - t0, 1), "markov_over_xpress_k4": s["markov_over_xpress_k4"],
               "paired": s["paired"],
               "median_ms": {k: round(v["median_ms"], 4) for k, v in s["timings"].items()}, "checks": s["checks"]}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
