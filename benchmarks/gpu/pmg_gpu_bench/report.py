"""The one table a run prints, and its verdicts."""

from __future__ import annotations

from .shapes import TARGET_BIAS, TARGET_VS_GEMM

ITEMS = [
    "build",
    "values",
    "offsets",
    "bias",
    "streams",
    "graph",
    "fp64",
    "capability",
    "checks",
    "bias-order",
    "pressure",
    "sanitizer",
    "speed",
]


def speed_verdict(row):
    """The two speed targets of one benchmark row: (vs_gemm_ok, bias_ok)."""
    return row["ours_vs_gemm"] <= TARGET_VS_GEMM, row["bias_vs_ours"] <= TARGET_BIAS


def table(report):
    """The one table: a row per item (cases ok/total, worst detail), then a row per speed shape."""
    lines = [
        f"device: {report.get('device')}  torch {report.get('torch')}  CUDA {report.get('cuda')}"
        f"  targets {report.get('targets_built')}  {report.get('date')}  "
        f"({report.get('seconds', '?')} s)",
        f"{'item':10s} {'result':8s} detail",
    ]
    by = {}
    for c in report.get("checks", []):
        by.setdefault(c["item"], []).append(c)
    for item in ITEMS:
        rows = by.get(item, [])
        if item == "speed":
            continue
        if not rows:
            lines.append(f"{item:10s} {'-':8s} not run")
            continue
        ran = [r for r in rows if r["ok"] is not None]
        if not ran:
            lines.append(f"{item:10s} {'n/a':8s} {rows[0]['detail']}")
            continue
        good = sum(1 for r in ran if r["ok"])
        cases = sorted({r["case"] for r in ran})
        lines.append(
            f"{item:10s} {good:>3d}/{len(ran):<4d} "
            + ("; ".join(cases)[:150] if len(cases) <= 3 else f"{len(ran)} cases")
        )
        for r in ran:
            if not r["ok"]:
                lines.append(f"{'':10s} FAIL     {r['case']}: {r['detail'][:200]}")
    bench = report.get("bench", [])
    crashed = [r for r in by.get("speed", []) if r["ok"] is False]
    if bench or crashed:
        lines.append(
            f"{'speed':10s} {'T x K x N':>18s} {'ours ms':>8s} {'+bias':>7s} {'bias via':>9s} "
            f"{'+kernel':>8s} {'gemm':>7s} {'unfused':>8s} {'TFLOP/s':>8s} "
            f"{'ours/gemm':>9s} {'bias/ours':>9s} targets"
        )
        for r in bench:
            g_ok, b_ok = speed_verdict(r)
            lines.append(
                f"{'':10s} {'x'.join(map(str, r['shape'])):>18s} {r['ours_ms']:8.3f} "
                f"{r['ours_with_bias_ms']:7.3f} {str(r.get('bias_path')):>9s} "
                f"{r['ours_bias_kernel_ms']:8.3f} {r['bf16_gemm_ms']:7.3f} {r['unfused_ms']:8.3f} "
                f"{r['ours_tflops']:8.1f} {r['ours_vs_gemm']:9.3f} {r['bias_vs_ours']:9.3f} "
                f"{'met' if g_ok and b_ok else 'MISSED'} (<={TARGET_VS_GEMM}, <={TARGET_BIAS})"
            )
        for r in crashed:
            lines.append(f"{'':10s} FAIL     {r['case']}: {r['detail'][:200]}")
    paths = report.get("bias_paths", [])
    if paths:

        def ms(v):
            return f"{v:8.3f}" if v else f"{'-':>8s}"

        lines.append(
            f"{'bias path':10s} {'shape':>22s} {'gemm':>8s} {'no bias':>8s} {'auto':>8s} "
            f"{'(path)':>9s} {'kernel':>8s} {'epilog.':>8s} {'colsum':>8s} "
            f"{'auto/best':>9s} {'kern GB/s':>9s}"
        )
        for r in paths:
            best = r.get("auto_vs_best_forced")
            gbps = r.get("bias_kernel_GBps")
            lines.append(
                f"{'':10s} {r['name'] + ' ' + 'x'.join(map(str, r['shape'])):>22s} "
                f"{ms(r['bf16_gemm_ms'])} {ms(r['ours_ms'])} {ms(r.get('auto_ms'))} "
                f"{str(r.get('auto_path')):>9s} {ms(r.get('kernel_ms'))} {ms(r.get('epilogue_ms'))} "
                f"{ms(r['colsum_ms'])} {'-' if best is None else f'{best:.3f}':>9} "
                f"{'-' if gbps is None else f'{gbps:.0f}':>9}"
            )
    return "\n".join(lines)


def print_table(report):
    print()
    print(table(report))
