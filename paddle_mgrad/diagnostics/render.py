"""The doctor's screen (:mod:`paddle_mgrad.diagnostics.doctor`): the facts and the problems
as the text ``python -m paddle_mgrad doctor`` prints, one section per line group.
"""

from __future__ import annotations

from .collect import GEMM_NAMES, TESTED_PADDLE
from .judge import _final_cache, _needs_line, _step, _var, rebuilt, verdict


def _size(n):
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def _paths_line(cpu, op, fp64_kernel):
    """The bf16 / fp16 / fp64 CPU paths (cpu_info() keys when the op reports them)."""
    if not cpu or op.get("backends", {}).get("cpu") == "python":
        return "bf16/fp16/fp64: pure-Paddle fallback"
    isa = set((cpu.get("isa") or "").split())
    sgemm = "oneDNN sgemm" if op.get("backends", {}).get("cpu") == "cpp-onednn" else "OpenMP sgemm"
    bf16 = {
        "onednn-bf16": "oneDNN bf16 GEMM (native)",
        "widen-sgemm": f"widened to fp32 + {sgemm}",
    }.get(cpu.get("bf16_path"), cpu.get("bf16_path"))
    fp16 = cpu.get("fp16_path") or f"widened ({'F16C' if 'f16c' in isa else 'portable'}) + {sgemm}"
    forced = (fp64_kernel or "").strip().lower() == "generic"
    fp64 = cpu.get("fp64_path") or (
        "blocked DGEMM, "
        + (
            "generic kernel (forced)"
            if forced
            else "AVX2+FMA kernel"
            if {"avx2", "fma"} <= isa
            else "generic kernel"
        )
    )
    return f"bf16: {bf16}; fp16: {fp16}; fp64: {fp64}"


def _policy_line(variables) -> str:
    """The recompute policy in force for calls without ``policy=`` (env.py's knob)."""
    var = next((v for v in variables if v["name"] == "PADDLE_MGRAD_RECOMPUTE_POLICY"), None)
    if var is None:
        return (
            "policy full (the default: every block replayed whole; "
            "PADDLE_MGRAD_RECOMPUTE_POLICY=gemm keeps the linears' outputs)"
        )
    if var["status"] != "ok":
        return (
            "policy: PADDLE_MGRAD_RECOMPUTE_POLICY is invalid (above): paddle_mgrad stops at import"
        )
    return (
        f"policy {var['parsed']} (PADDLE_MGRAD_RECOMPUTE_POLICY: every recompute call without "
        "policy=, Paddle's own included)"
    )


def render(facts, problems) -> str:
    L = []
    add = L.append
    ver = facts.get("versions") or {}
    pst = _step(facts, "probe_paddle", "paddle")
    add("paddle_mgrad doctor  (python -m paddle_mgrad doctor --json for the full report)")
    add(f"versions   Python {ver.get('python')} ({ver.get('python_executable')})")
    if "version" in pst:
        cuda = (
            f"built with CUDA {pst.get('cuda_version') or ''}, {pst.get('gpus', '?')} GPU(s)"
            if pst.get("cuda")
            else "built without CUDA"
        )
        tested = "" if pst["version"] in TESTED_PADDLE else f" (tested: {', '.join(TESTED_PADDLE)})"
        add(
            f"           Paddle {pst['version']} ({', '.join(ver.get('paddle_dists') or {}) or '?'}), "
            f"{cuda}{tested}"
        )
    else:
        dists = ", ".join(f"{k} {v}" for k, v in (ver.get("paddle_dists") or {}).items())
        add(f"           Paddle {dists or 'not installed'}: does not import")
    where = (
        "installed"
        if ver.get("paddle_mgrad_installed_path") == ver.get("paddle_mgrad_path")
        else "source checkout"
        + (
            f"; installed {ver['paddle_mgrad_installed']} at "
            f"{ver['paddle_mgrad_installed_path']} is shadowed"
            if ver.get("paddle_mgrad_installed")
            else ", not installed"
        )
    )
    add(
        f"           paddle_mgrad {ver.get('paddle_mgrad')} ({ver.get('paddle_mgrad_path')}, {where})"
    )
    extra = [
        f"{n} {ver[n]}" for n in ("paddlenlp", "paddleformers", "numpy", "protobuf") if ver.get(n)
    ]
    add("           " + ", ".join(extra))

    sw = facts.get("switch") or {}
    pth = (
        f"autoload .pth installed ({sw['pth'][0]})"
        if sw.get("pth")
        else "autoload .pth NOT installed in this environment (PADDLE_MGRAD does nothing; "
        "enable() and the trainer flag work)"
    )
    add(f"switch on  {pth}")
    variables = sw.get("variables") or []
    if not variables:
        add("           no PADDLE_MGRAD* variable set (off unless the script calls enable())")
    for v in variables:
        state = "ok" if v["status"] == "ok" else v["status"].upper() + ": " + (v["message"] or "")
        add(f"           {v['name']}={v['value']}  {state}")
    add("recompute  " + _policy_line(variables))

    op = _step(facts, "probe_op", "op")
    cpu = _step(facts, "probe_op", "cpu")
    b = op.get("backends") or {}
    if b:
        why = f" ({op['fallback_reason'][:150]})" if op.get("fallback_reason") else ""
        add(f"op         CPU tensors: {GEMM_NAMES.get(b.get('cpu'), b.get('cpu'))}{why}")
        if b.get("gpu") is None:
            add("           GPU tensors: none (Paddle built without CUDA)")
        else:
            why = op.get("cuda_fallback_reason")
            add(
                f"           GPU tensors: {GEMM_NAMES.get(b['gpu'], b['gpu'])}"
                + (f" ({why[:150]})" if why and b["gpu"] != "cuda" else "")
            )
        if op.get("library"):
            built = not _step(facts, "probe_paddle", "cache").get("will_load")
            add(
                f"           {'built and loaded' if built else 'loaded'} in {op.get('seconds')} s "
                f"from {op['library']}"
            )
    else:
        add(
            "op         not loaded"
            + (
                f" (probe {facts['probe_op'].get('signal') or 'failed'})"
                if facts.get("probe_op")
                else ""
            )
        )
    comp = facts.get("compilers") or {}
    cxx = comp.get("cxx") or {}
    add(
        f"           compiler: {cxx.get('command')} -> "
        + (f"{cxx.get('real_path')} ({cxx.get('version')})" if cxx.get("path") else "NOT FOUND")
    )
    tk = facts.get("cuda_toolkit") or {}
    if pst.get("cuda"):
        add(f"           CUDA toolkit: {tk.get('summary')}")
    else:
        add(
            "           CUDA toolkit: not needed (CPU Paddle)"
            + (f"; found CUDA {tk['version']} at {tk['home']}" if tk.get("home") else "")
        )
    if cpu and "isa" in cpu:
        add(f"cpu        {cpu.get('isa')}; native bf16: {cpu.get('native_bf16')}")
        add(f"           {_paths_line(cpu, op, _var(facts, 'PADDLE_MGRAD_CPU_FP64_KERNEL'))}")

    cache = _final_cache(facts)
    if cache.get("root"):
        src = "PADDLE_MGRAD_CACHE" if cache.get("from_env") else "default"
        builds = cache.get("builds") or []
        add(
            f"cache      {cache['root']} ({src}; {len(builds)} build(s), lister: {cache.get('lister')})"
        )
        for bld in builds[:8]:
            flags = (["prebuilt"] if bld.get("location") == "prebuilt" else []) + [
                "current" if bld.get("current") else "other configuration",
                "complete" if bld.get("complete") else "incomplete",
                {True: "verified", False: "NOT verified", None: "not checked"}[bld.get("verified")],
            ]
            if bld.get("paddle_version"):
                flags.append(f"Paddle {bld['paddle_version']}")
            if bld.get("cuda") is not None:
                flags.append("cuda" if bld.get("cuda") else "cpu")
            add(
                f"           {bld.get('key')}  {', '.join(flags)}, {_size(bld.get('size'))}"
                + (f"  PROBLEM: {bld['problem'][:120]}" if bld.get("problem") else "")
            )
        if len(builds) > 8:
            add(f"           ... {len(builds) - 8} more (--json lists all)")
        for directory, problem in rebuilt(facts):
            add(f"           rebuilt while loading: {directory} (was: {problem[:120]})")
    st = _step(facts, "probe_op", "selftest_paddle_mgrad")
    add(f"self-test  this Paddle: {_needs_line(facts)}")
    if st and not st.get("started"):
        if st.get("error") or st.get("failed"):
            add(f"           paddle_mgrad: FAILED: {st.get('error') or st.get('failed')}")
        else:
            add(
                f"           paddle_mgrad: backward gets the parameter: {st.get('backward_got_parameter')}, "
                f"main_grad vs float64: max rel err {st.get('max_rel_err'):.1e} "
                f"({'exact' if st.get('main_grad_ok') else 'WRONG'}), our recompute/op calls "
                f"{(st.get('ours') or {}).get('recompute')}/{(st.get('ours') or {}).get('op_calls')}"
                f" [{st.get('seconds')} s]"
            )
    add(f"verdict    {verdict(facts, problems)}")
    for p in problems:
        add(f"  problem: [{p['area']}] {p['problem']}  ->  fix: {p['fix']}")
    return "\n".join(L)
