"""A/B of the fused kernel's bf16 products at few rows: this tree's build against a git revision's, in one process.

    python scripts/bf16_rows_ab.py --against bafceba   # writes results/cpu/kernel_ab/bf16_rows-bafceba.json (+ .csv);
                                                       # the committed run: results/archive/cpu/kernel_ab/

All of SmolLM2-135M's products (thirty layers of q/k/v, o, gate/up and down, and the LM head) on random bf16
weights packed once (about 270 MB, so they stream from memory as a model's do), times one row count at a time,
the two builds interleaved per repeat; medians over the repeats after the first three. Before timing, every row
count's outputs are checked equal bit for bit between the builds. Needs a CPU whose bf16 products the kernel runs
(AMX tiles or AVX512-BF16) and nothing else running on the cores.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from xpress import kernels, paths  # noqa: E402
from xpress.utils import provenance, write_result  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [N, K]: a layer's products, LM head


def build_at(revision: str):
    """The fused kernel as of ``revision`` (its source from git), built in the cache under its own name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:xpress/csrc/fused_cpu.cpp"],
                            check=True, capture_output=True, text=True).stdout
    folder = paths.cache_dir() / "kernels" / f"ab-{revision}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fused_cpu.cpp").write_text(source)
    from torch.utils.cpp_extension import load

    flags = kernels.FLAGS + kernels.OPENMP
    return load(name=f"xpress_fused_ab_{revision}", sources=[str(folder / "fused_cpu.cpp")], extra_cflags=flags,
                extra_ldflags=kernels.OPENMP, build_directory=str(folder), verbose=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision whose kernel is the baseline")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,16", help="row counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    new = kernels.fused_cpu()
    if new is None or not new.bf16_ready():
        ap.exit(2, "error: this CPU runs no bf16 products in the fused kernel (needs AMX tiles or AVX512-BF16)\n")
    old = build_at(args.against)
    torch.manual_seed(0)
    weights = [new.pack_bf16(torch.randn(s) * 0.05) for s in SHAPES]  # the same packing in both builds
    xs = {m: {k: torch.randn(m, k) for k in {s[1] for s in SHAPES}} for m in rows}
    for m in rows:
        for s, w in zip(SHAPES[:4] + SHAPES[-1:], weights[:4] + weights[-1:]):
            if not torch.equal(new.linear(xs[m][s[1]], w), old.linear(xs[m][s[1]], w)):
                ap.exit(1, f"error: {m} rows x {s}: the two builds give different bits\n")

    def run(mod, m: int) -> float:
        t0 = time.perf_counter()
        for s, w in zip(SHAPES, weights):
            mod.linear(xs[m][s[1]], w)
        return time.perf_counter() - t0

    times = {(b, m): [] for b in ("before", "after") for m in rows}
    for _ in range(args.repeats):
        for m in rows:
            for b, mod in (("before", old), ("after", new)):
                times[(b, m)].append(run(mod, m))
    table = []
    for m in rows:
        before, after = (statistics.median(times[(b, m)][3:]) * 1e3 for b in ("before", "after"))
        table.append({"rows": m, "before_ms": before, "after_ms": after, "after_over_before": after / before})
        print(f"rows {m:2d}: before {before:6.2f} ms  after {after:6.2f} ms  after/before {after / before:.3f}")
    command = "python scripts/bf16_rows_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"what": "all of SmolLM2-135M's bf16 products at each row count, this tree's kernel against "
                       f"{args.against}'s, interleaved, medians (ms)", "against": args.against,
               "repeats": args.repeats, "same_bits": True, "table": table, "command": command,
               "provenance": provenance("cpu", torch_threads=torch.get_num_threads())}
    out = write_result(paths.RESULTS / "cpu" / "kernel_ab", f"bf16_rows-{args.against}", payload, table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
