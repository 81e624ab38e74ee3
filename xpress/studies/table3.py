"""The latency study beside the paper (Table 3 and Figure 4): a latency result of
:func:`xpress.studies.latency.run_latency` read against the paper's H200 numbers, the end-to-end speedup
its timings project with the paper's Eq. 1, and the Figure 4 analogue.

    from xpress.studies.table3 import beside_paper_table3, plot_latency_vs_k, projected_speedup
    rows = beside_paper_table3(lat)                        # measured vs paper, as ratios to the Markov head
    projected_speedup(lat["shape_sets"]["paper"], {"dflash": 3.0, "xpress": 3.5}, k=4)

Nothing here imports pandas or seaborn at module level (the figure imports them when drawn).
"""
from __future__ import annotations

import re
from typing import Any

from .latency import latency_rows

# The paper's Table 3 (arXiv 2608.02438): refinement latency per block on one H200 (Qwen3-8B, B = 16), in
# microseconds: xPress at K Jacobi passes and the Markov head's 15 serial steps (the paper runs the Markov
# decode as a compiled, CUDA-graphed loop).
PAPER_TABLE3_US = {**{f"xpress K={k}": us for k, us in zip(range(1, 9), (150, 227, 301, 379, 452, 530, 603, 681))},
                   "markov": 601}
# Its Figure 4: the Markov head's serial decode is about a quarter (24%) of the draft side per block on that H200
# (drafter forward + base lm_head readout + refinement).
PAPER_MARKOV_DRAFT_SHARE = 0.24


def _graph_name(component: str) -> str:
    """The CUDA-graph replay's name of ``markov`` or ``xpress K=k`` in a latency result's timings."""
    return "markov graph" if component == "markov" else component.replace("xpress K=", "xpress graph K=")


def _timed_pair(t: dict[str, dict[str, float]], component: str) -> tuple[str, str]:
    """The names ``component`` and the Markov decode were timed under, compared like with like: both CUDA
    graph replays where both were captured (as the paper's were), else both eager."""
    if _graph_name(component) in t and _graph_name("markov") in t:
        return _graph_name(component), _graph_name("markov")
    return component, "markov"


def beside_paper_table3(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table 3 beside the paper's: for each shape set of a latency ``result`` and each component of the
    paper's Table 3 that was timed (xPress K = 1..8, the Markov head), the measured median (ms) and its
    ratio to the Markov head's, beside the paper's time (us) and ratio (the paper's, on an H200). Where
    both the Markov decode and xPress at K were replayed as CUDA graphs (as the paper's were) the graph
    times are used for both, else the eager ones (``measured_as``). The ratios are what compares across
    machines."""
    rows = []
    for name, s in result["shape_sets"].items():
        t = s["timings"]
        for component, us in PAPER_TABLE3_US.items():
            if component not in t:
                continue
            timed, markov = _timed_pair(t, component)
            rows.append({"shapes": name, "component": component, "measured_as": timed,
                         "median_ms": t[timed]["median_ms"],
                         "ratio_to_markov": t[timed]["median_ms"] / t[markov]["median_ms"],
                         "paper_us": us, "paper_ratio_to_markov": us / PAPER_TABLE3_US["markov"]})
    return rows


def projected_speedup(s: dict[str, Any], tau: dict[str, float], k: int = 4) -> list[dict[str, Any]]:
    """The paper's Eq. 1, ``L = (T_draft + T_verify) / tau``: a round drafts a block, verifies it and
    commits tau tokens on average, so against the target's autoregressive step ``T_step`` the speedup is
    ``tau T_step / (T_draft + T_verify)``. From one shape set ``s`` of a latency result timed with its
    target (``target step``, ``target verify``) and ``tau`` {method: tau} for ``dflash``, ``markov``,
    ``xpress``: ``T_draft`` = drafter forward + base readout + the method's refinement (none for dflash, the
    Markov decode, xPress at K = ``k``; CUDA-graph replays where both were timed). A projection, not a
    measurement: the engine's bookkeeping, acceptance sampling and the cache's growth are left out."""
    t = s["timings"]
    if f"xpress K={k}" not in t:
        timed = [n.removeprefix("xpress K=") for n in t if re.fullmatch(r"xpress K=\d+", n)]
        raise ValueError(f"xpress K={k} was not timed in this result: use one of its K ({', '.join(timed)})")
    b = s["shapes"]["block_size"]
    step, verify = t.get("target step (1 token)"), t.get(f"target verify ({b} tokens)")
    if step is None or verify is None:
        raise ValueError("this latency result has no target timings (target step / verify): project from a run "
                         "with a target, e.g. scripts/gpu_latency.py without --no-target")
    xpress, markov = _timed_pair(t, f"xpress K={k}")
    refine = {"dflash": 0.0, "markov": t[markov]["median_ms"], "xpress": t[xpress]["median_ms"]}
    drafting = t["drafter forward"]["median_ms"] + t["base readout"]["median_ms"]
    rows = []
    for method, tau_m in tau.items():
        if method not in refine:
            raise ValueError(f"tau for method {method!r}: give dflash, markov or xpress")
        draft = drafting + refine[method]
        rows.append({"method": method if method != "xpress" else f"xpress K={k}", "tau": tau_m, "draft_ms": draft,
                     "verify_ms": verify["median_ms"], "step_ms": step["median_ms"],
                     "projected_speedup": tau_m * step["median_ms"] / (draft + verify["median_ms"])})
    return rows


def plot_latency_vs_k(result: dict[str, Any]):
    """Figure 4 analogue: refinement latency against K per shape set (median, IQR bars), the Markov
    head's serial decode as a horizontal line (its IQR shaded). Returns the figure."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(latency_rows(result))
    sets = list(result["shape_sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 3.8), squeeze=False)
    for ax, name in zip(axes[0], sets):
        d = df[(df.shapes == name) & df.component.str.fullmatch(r"xpress K=\d+")]
        sns.lineplot(data=d, x="K", y="median_ms", marker="o", ax=ax, label="xPress, K Jacobi passes")
        ax.errorbar(d.K, d.median_ms, yerr=[d.median_ms - d.q1_ms, d.q3_ms - d.median_ms], fmt="none", c="C0")
        g = df[(df.shapes == name) & df.component.str.startswith("xpress graph K=")]
        if len(g):
            sns.lineplot(data=g, x="K", y="median_ms", marker="s", ax=ax, label="xPress, CUDA graph")
        m = result["shape_sets"][name]["timings"]["markov"]
        p = result["shape_sets"][name]["shapes"]["block_size"] - 1
        ax.axhline(m["median_ms"], c="C3", ls="--", label=f"Markov head ({p} serial steps)")
        ax.axhspan(m["q1_ms"], m["q3_ms"], color="C3", alpha=0.15)
        m32 = result["shape_sets"][name]["timings"].get("markov (float32 readout)")
        if m32:  # the certified readout was used: the Markov decode with its float32 readout too
            ax.axhline(m32["median_ms"], c="C3", ls=":", label="Markov head, float32 readout")
        ax.set_title(result["shape_sets"][name]["shapes"]["name"])
        ax.set_xlabel("K (Jacobi passes)")
        ax.set_ylabel("ms per block")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
