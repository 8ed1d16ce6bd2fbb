"""The correctness rows of one run (Bench).  On a GPU every call goes to the CUDA core; with
--simulate-cpu the same code runs on the CPU core with CPU torch."""

from __future__ import annotations

import ctypes
import re

from .capi import ELEM, CoreError, info_field
from .shapes import (
    BIAS_PATH_SHAPES,
    CHECK_SHAPES,
    OFFSET_SHAPES,
    check_result,
    error_bound,
    offset_cases,
)


def check_cpu_core(core):
    """Paddle-free check of the CPU core with numpy (fp32 in, fp32 out; bias)."""
    import numpy as np

    results = []
    rs = np.random.RandomState(0)
    for M, K, N in [(37, 19, 23), (600, 70, 530), (0, 4, 5)]:
        x = rs.standard_normal([M, K]).astype("float32")
        dy = rs.standard_normal([M, N]).astype("float32")
        dw = rs.standard_normal([K, N]).astype("float32")
        db = rs.standard_normal([N]).astype("float32")
        w0, b0 = dw.astype("f8"), db.astype("f8")
        for _ in range(3):
            core.cpu(
                x.ctypes.data,
                dy.ctypes.data,
                "float32",
                M,
                K,
                N,
                dw.ctypes.data,
                "float32",
                1.0,
                db.ctypes.data,
                "float32",
                1.0,
            )
        ref_w = w0 + 3 * x.astype("f8").T @ dy.astype("f8")
        ref_b = b0 + 3 * dy.astype("f8").sum(0)
        bw = error_bound(
            3 * np.abs(x.astype("f8")).T @ np.abs(dy.astype("f8")),
            np.abs(w0),
            max(M, 1),
            "float32",
            "float32",
        )
        bb = error_bound(
            3 * np.abs(dy.astype("f8")).sum(0), np.abs(b0), max(M, 1), "float32", "float32"
        )
        okw, rw, _ = check_result(dw, ref_w, bw)
        okb, rb, _ = check_result(db, ref_b, bb)
        results.append({"shape": [M, K, N], "ok": okw and okb, "err/bound": max(rw, rb)})
    return results


class Bench:
    """The checks of one run.  On a GPU every call goes to the CUDA core; with --simulate-cpu the
    same code runs on the CPU core with CPU torch, and the rows that need a GPU say so."""

    def __init__(self, args, torch, core, sim, report):
        import numpy as np

        self.np, self.torch, self.core, self.sim, self.args, self.report = (
            np,
            torch,
            core,
            sim,
            args,
            report,
        )
        self.dev = torch.device("cpu" if sim else "cuda")
        self.device = 0 if sim else (self.dev.index or torch.cuda.current_device())
        self.tdt = {
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float64": torch.float64,
        }
        self.gen = torch.Generator(device=self.dev).manual_seed(1234)
        self.sync = (lambda: None) if sim else torch.cuda.synchronize
        self.keep = []  # allocator-callback tensors, alive until the next sync point

    # ---- helpers
    def randn(self, shape, dtype):
        t = self.torch.randn(*shape, device=self.dev, generator=self.gen, dtype=self.torch.float64)
        return t.to(self.tdt[dtype])

    def stream_ptr(self, stream=None):
        if self.sim:
            return None
        return (stream or self.torch.cuda.current_stream()).cuda_stream

    def call(self, x, dy, dw, db, dw_beta, db_beta, in_dtype, stream=None, **ex):
        """One call of the core on torch tensors (or raw pointers: int); returns its report."""

        def ptr(t):
            return t if isinstance(t, int) or t is None else t.data_ptr()

        def dt(t, default):
            return default if t is None or isinstance(t, int) else str(t.dtype).split(".")[-1]

        M, K = ex.pop("shape", None) or (x.shape[0], x.shape[1])
        N = ex.pop("n", None) or dy.shape[1]
        acc = "float64" if in_dtype == "float64" else "float32"
        a = (
            ptr(x),
            ptr(dy),
            in_dtype,
            M,
            K,
            N,
            ptr(dw),
            dt(dw, acc),
            dw_beta,
            ptr(db),
            dt(db, acc),
            db_beta,
        )
        if self.sim:
            return self.core.cpu(*a)
        return self.core.gpu_ex(
            *a, device=ex.pop("device", self.device), stream=self.stream_ptr(stream), **ex
        )

    def torch_alloc(self, stream=None):
        """An allocator callback backed by torch's caching allocator (as Paddle's for the op)."""

        def alloc(n):
            if stream is not None:
                with self.torch.cuda.stream(stream):
                    t = self.torch.empty(int(n), dtype=self.torch.uint8, device=self.dev)
            else:
                t = self.torch.empty(int(n), dtype=self.torch.uint8, device=self.dev)
            self.keep.append(t)
            return t.data_ptr()

        return alloc

    def reference(self, x, dy):
        x64, dy64 = x.double(), dy.double()
        return (x64.T @ dy64, x64.abs().T @ dy64.abs(), dy64.sum(0), dy64.abs().sum(0))

    def compare(self, got, want, absval, start, M, out, in_dtype, calls):
        """got vs start + calls * want, with the bound of `calls` accumulations."""
        np = self.np
        s = start.double().cpu().numpy()
        bound = error_bound(
            calls * absval.cpu().numpy(), np.abs(s), M, out, in_dtype
        ) + error_bound(absval.cpu().numpy(), 0, M, out, in_dtype)
        return check_result(got.double().cpu().numpy(), s + calls * want.cpu().numpy(), bound)

    def same_bytes(self, a, b):
        t = self.torch
        return bool(t.equal(a.contiguous().view(t.uint8), b.contiguous().view(t.uint8)))

    def add(self, item, case, ok, detail="", **extra):
        row = {"item": item, "case": case, "ok": bool(ok), "detail": detail, **extra}
        self.report["checks"].append(row)
        print(f"{item:10s} {case:44s} {'ok' if ok else 'FAIL'}  {detail}", flush=True)
        return row

    def skip(self, item, why):
        self.report["checks"].append({"item": item, "case": "-", "ok": None, "detail": why})
        print(f"{item:10s} {'-':44s} n/a  {why}", flush=True)

    def accumulate(self, in_dtype, shape, bias, x=None, dy=None, mg=None, db=None, calls=3, **ex):
        """`calls` in-place accumulations from random starting accumulators; checks data_ptr and
        values vs float64.  Returns (ok, detail, infos)."""
        M, K, N = shape
        acc = "float64" if in_dtype == "float64" else "float32"
        x = self.randn((M, K), in_dtype) if x is None else x
        dy = self.randn((M, N), in_dtype) if dy is None else dy
        mg = self.randn((K, N), acc) if mg is None else mg
        if bias and db is None:
            db = self.randn((N,), acc)
        w0, b0 = mg.clone(), (db.clone() if bias else None)
        prod, absprod, colsum, abscolsum = self.reference(x, dy)
        ptr = mg.data_ptr()
        infos = [
            self.call(x, dy, mg, db if bias else None, 1.0, 1.0, in_dtype, **dict(ex))
            for _ in range(calls)
        ]
        self.sync()
        self.keep.clear()
        ok, ratio, _ = self.compare(mg, prod, absprod, w0, M, acc, in_dtype, calls)
        ok = ok and mg.data_ptr() == ptr
        detail = f"err/bound {ratio:.3f}"
        if bias:
            okb, rb, _ = self.compare(db, colsum, abscolsum, b0, M, acc, in_dtype, calls)
            ok, detail = ok and okb, detail + f", bias err/bound {rb:.3f}"
        return ok, detail, infos

    # ---- items
    def values(self):
        args, torch = self.args, self.torch
        shapes = CHECK_SHAPES[1::2] if self.sim else CHECK_SHAPES[: (3 if args.quick else None)]
        for M, K, N in shapes:
            for in_dtype in ("bfloat16", "float16", "float32", "float64"):
                out = "float64" if in_dtype == "float64" else "float32"
                for with_bias in (True, False):
                    x, dy = self.randn((M, K), in_dtype), self.randn((M, N), in_dtype)
                    prod, absprod, colsum, abscolsum = self.reference(x, dy)
                    # fresh accumulator (beta = 0) poisoned with NaN, then 3 accumulations
                    dw = torch.full((K, N), float("nan"), device=self.dev, dtype=self.tdt[out])
                    db = (
                        torch.full((N,), float("nan"), device=self.dev, dtype=self.tdt[out])
                        if with_bias
                        else None
                    )
                    info = self.call(x, dy, dw, db, 0.0, 0.0, in_dtype)
                    start = dw.double().clone()
                    ptr = dw.data_ptr()
                    for _ in range(3):
                        self.call(x, dy, dw, db, 1.0, 1.0, in_dtype)
                    self.sync()
                    ok, ratio, _ = self.compare(dw, prod, absprod, start, M, out, in_dtype, 3)
                    ok = ok and dw.data_ptr() == ptr
                    detail = f"err/bound {ratio:.3f}"
                    if with_bias:
                        zero = torch.zeros_like(colsum)
                        okb, rb, _ = self.compare(db, colsum, abscolsum, zero, M, out, in_dtype, 4)
                        ok, detail = (
                            ok and okb,
                            detail + f", bias {rb:.3f} via {info_field(info, 'bias') or info}",
                        )
                    item = "fp64" if in_dtype == "float64" else "values"
                    self.add(item, f"{in_dtype} {M}x{K}x{N} bias={with_bias}", ok, detail)
                    if in_dtype in (
                        "bfloat16",
                        "float16",
                    ):  # same-precision C (multi_precision=False)
                        dwl = torch.full((K, N), float("nan"), device=self.dev).to(
                            self.tdt[in_dtype]
                        )
                        self.call(x, dy, dwl, None, 0.0, 0.0, in_dtype)
                        self.sync()
                        okl, rl, _ = check_result(
                            dwl.double().cpu().numpy(),
                            prod.cpu().numpy(),
                            error_bound(absprod.cpu().numpy(), 0, M, in_dtype, in_dtype),
                        )
                        self.add(
                            "values",
                            f"{in_dtype} {M}x{K}x{N} -> {in_dtype} dW",
                            okl,
                            f"err/bound {rl:.3f}",
                        )

    def offset_view(self, shape, dtype, off, fill=None, tail=64):
        """A contiguous view of `shape` starting `off` bytes into a fresh byte buffer (`tail`
        spare bytes after it; 0 for views that end at the allocation's end)."""
        torch = self.torch
        n = 1
        for s in shape:
            n *= s
        es = ELEM[dtype]
        buf = torch.empty(off + n * es + tail, dtype=torch.uint8, device=self.dev)
        buf.fill_(0x5A)
        v = buf[off : off + n * es].view(self.tdt[dtype]).view(*shape)
        if fill is not None:
            v.copy_(fill)
        return buf, v

    def offsets(self):
        shapes = OFFSET_SHAPES[1:] if self.sim else OFFSET_SHAPES
        for in_dtype, off, moved in offset_cases():
            for M, K, N in shapes:
                acc = "float64" if in_dtype == "float64" else "float32"
                bufs = {}

                def make(name, shape, dtype, off=off, moved=moved, bufs=bufs):
                    o = off if name in moved else 0
                    buf, v = self.offset_view(shape, dtype, o, self.randn(shape, dtype))
                    bufs[name] = (buf, o, v)
                    return v

                x = make("x", (M, K), in_dtype)
                dy = make("dy", (M, N), in_dtype)
                mg = make("main_grad", (K, N), acc)
                db = make("bias", (N,), acc)
                mg_buf, mg_off, _ = bufs["main_grad"]
                around = self.torch.cat(
                    [mg_buf[:mg_off], mg_buf[mg_off + K * N * ELEM[acc] :]]
                ).clone()
                try:
                    ok, detail, infos = self.accumulate(
                        in_dtype, (M, K, N), True, x=x, dy=dy, mg=mg, db=db
                    )
                except CoreError as e:
                    ok, detail, infos = False, f"error: {e}", []
                after = self.torch.cat([mg_buf[:mg_off], mg_buf[mg_off + K * N * ELEM[acc] :]])
                ok = ok and self.same_bytes(around, after)
                align = info_field(infos[0], "align") if infos and not self.sim else "cpu"
                bias = info_field(infos[0], "bias") if infos and not self.sim else "cpu"
                self.add(
                    "offsets",
                    f"{in_dtype} +{off}B {'/'.join(moved)} {M}x{K}x{N}",
                    ok,
                    f"{detail}; align {align}; bias via {bias}",
                )

    def bias(self):
        M, K, N = (257, 64, 96) if self.sim else (4095, 1024, 520)
        for in_dtype in ("bfloat16", "float16", "float32"):
            x, dy = self.randn((M, K), in_dtype), self.randn((M, N), in_dtype)
            mg0, db0 = self.randn((K, N), "float32"), self.randn((N,), "float32")
            results = {}
            for mode in ("cpu",) if self.sim else ("auto", "epilogue", "kernel"):
                outs = []
                for _rep in range(2):  # twice from the same start: bitwise equal (deterministic)
                    mg, db = mg0.clone(), db0.clone()
                    try:
                        ex = {} if self.sim else {"bias_mode": mode}
                        ok, detail, infos = self.accumulate(
                            in_dtype, (M, K, N), True, x=x, dy=dy, mg=mg, db=db, **ex
                        )
                    except CoreError as e:
                        ok, detail, infos = False, f"error: {e}", []
                    outs.append((ok, detail, infos, mg, db))
                (ok, detail, infos, mg, db), (_, _, _, mg2, db2) = outs
                det = self.same_bytes(mg, mg2) and self.same_bytes(db, db2)
                ran = info_field(infos[0], "bias") if infos and not self.sim else "cpu"
                why = (
                    re.search(r"bias=\S+ \(([^)]*)\)", infos[0]) if infos and not self.sim else None
                )
                results[mode] = db
                want = {"epilogue": "epilogue", "kernel": "kernel"}.get(mode)
                path_ok = want is None or ran == want
                self.add(
                    "bias",
                    f"{in_dtype} {M}x{K}x{N} mode={mode}",
                    ok and det and outs[1][0] and path_ok,
                    f"{detail}; ran {ran}{' (' + why.group(1) + ')' if why else ''}; "
                    f"repeat {'bitwise equal' if det else 'DIFFERS'}",
                )
            if "epilogue" in results and "kernel" in results:
                d = float((results["epilogue"].double() - results["kernel"].double()).abs().max())
                self.report.setdefault("bias_epilogue_vs_kernel", {})[in_dtype] = d

    def streams(self):
        if self.sim:
            return self.skip("streams", "simulation: the CPU core has no streams")
        torch = self.torch
        s = torch.cuda.Stream()
        M, K, N = 2048, 1024, 768
        cur = torch.cuda.current_stream()
        for ws in ("stream-ordered", "allocator", "caller"):
            x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
            mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
            ex = {}
            if ws == "allocator":
                ex["alloc"] = self.torch_alloc(s)
            elif ws == "caller":
                wbuf = torch.empty(64 << 20, dtype=torch.uint8, device=self.dev)
                ex.update(workspace=wbuf.data_ptr(), workspace_bytes=wbuf.numel())
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                ok, detail, infos = self.accumulate(
                    "bfloat16", (M, K, N), True, x=x, dy=dy, mg=mg, db=db, stream=s, **ex
                )
            cur.wait_stream(s)
            used = info_field(infos[0], "workspace") if infos else "?"
            self.add(
                "streams",
                f"non-default stream, workspace {ws}",
                ok and ws in (used or ""),
                f"{detail}; workspace {used}",
            )
        # two streams at once, interleaved, no sync in between
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        for ws in ("stream-ordered", "caller"):
            probs = []
            for (M, K, N), dt in (((3000, 1024, 1536), "bfloat16"), ((1500, 2048, 512), "float16")):
                x, dy = self.randn((M, K), dt), self.randn((M, N), dt)
                mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
                probs.append(((M, K, N), dt, x, dy, mg, db, mg.clone(), db.clone()))
            wb = [torch.empty(64 << 20, dtype=torch.uint8, device=self.dev) for _ in range(2)]
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            for _ in range(3):
                for i, st in enumerate((s1, s2)):
                    (_, dt, x, dy, mg, db, _, _) = probs[i]
                    ex = (
                        {}
                        if ws == "stream-ordered"
                        else {"workspace": wb[i].data_ptr(), "workspace_bytes": wb[i].numel()}
                    )
                    with torch.cuda.stream(st):
                        self.call(x, dy, mg, db, 1.0, 1.0, dt, stream=st, **ex)
            cur.wait_stream(s1)
            cur.wait_stream(s2)
            self.sync()
            oks, details = [], []
            for (M, _K, _N), dt, x, dy, mg, db, w0, b0 in probs:
                prod, absprod, colsum, abscolsum = self.reference(x, dy)
                okw, rw, _ = self.compare(mg, prod, absprod, w0, M, "float32", dt, 3)
                okb, rb, _ = self.compare(db, colsum, abscolsum, b0, M, "float32", dt, 3)
                oks.append(okw and okb)
                details.append(f"{dt} {rw:.3f}/{rb:.3f}")
            self.add(
                "streams",
                f"two streams at once, workspace {ws}",
                all(oks),
                "err/bound " + ", ".join(details),
            )

    def graph(self):
        if self.sim:
            return self.skip("graph", "simulation: no CUDA graphs on the CPU")
        torch = self.torch
        M, K, N = 1024, 512, 384
        for ws in ("caller", "allocator", "stream-ordered"):
            x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
            mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
            w0, b0 = mg.clone(), db.clone()
            ex = {}
            if ws == "caller":
                wbuf = torch.empty(64 << 20, dtype=torch.uint8, device=self.dev)
                ex = {"workspace": wbuf.data_ptr(), "workspace_bytes": wbuf.numel()}
            elif ws == "allocator":
                ex = {"alloc": self.torch_alloc()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):  # warm-up: handle, algorithm, image checks cached
                    self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", stream=side, **dict(ex))
                torch.cuda.current_stream().wait_stream(side)
                self.sync()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    info = self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", **dict(ex))
                mg.copy_(w0)
                db.copy_(b0)
                for _ in range(3):
                    g.replay()
                self.sync()
                prod, absprod, colsum, abscolsum = self.reference(x, dy)
                okw, rw, _ = self.compare(mg, prod, absprod, w0, M, "float32", "bfloat16", 3)
                okb, rb, _ = self.compare(db, colsum, abscolsum, b0, M, "float32", "bfloat16", 3)
                self.add(
                    "graph",
                    f"capture + 3 replays, workspace {ws}",
                    okw and okb,
                    f"err/bound {rw:.3f}, bias {rb:.3f}; {info}",
                )
            except Exception as e:  # noqa: BLE001  (a capture failure is this row's result)
                self.add(
                    "graph",
                    f"capture + 3 replays, workspace {ws}",
                    False,
                    f"{type(e).__name__}: {e}"[:300],
                )
            self.keep.clear()

    def untouched_error(self, item, case, expect, fn, mg, db=None):
        """fn() must raise CoreError containing `expect`, leaving mg/db bitwise unchanged."""
        before = [t.clone() for t in (mg, db) if t is not None]
        try:
            fn()
            self.sync()
            ok, detail = False, "no error"
        except CoreError as e:
            self.sync()
            ok, detail = expect.lower() in str(e).lower(), str(e)[:160]
        after = [t for t in (mg, db) if t is not None]
        same = all(self.same_bytes(a, b) for a, b in zip(before, after))
        return self.add(item, case, ok and same, ("untouched; " if same else "TOUCHED; ") + detail)

    def capability(self):
        M, K, N = 512, 256, 128
        x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
        mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
        if self.sim:  # the decision only (the plan function the core calls)
            lib = self.core.lib
            t = b"sm_80+sm_90+compute_90"
            ok = (
                not lib.pmg_targets_cover(t, 70)
                and lib.pmg_targets_cover(t, 90)
                and lib.pmg_targets_cover(t, 100)
                and lib.pmg_targets_cover(t, 86)
            )
            return self.add(
                "capability",
                "targets_cover (decision only)",
                ok,
                "simulation: sm_70 refused, sm_86/90/100 covered",
            )
        for mode in ("auto", "kernel"):
            self.untouched_error(
                "capability",
                f"simulated sm_70, bias {mode}",
                "sm_70",
                lambda mode=mode: self.call(
                    x, dy, mg, db, 1.0, 1.0, "bfloat16", sim=70, bias_mode=mode
                ),
                mg,
                db,
            )
        # without bias only cuBLASLt runs: a CUDA 12 build runs it there; a CUDA 13 build refuses
        # (CUDA 13's libraries dropped Volta), leaving main_grad untouched
        before = mg.clone()
        try:
            ok, detail, _ = self.accumulate(
                "bfloat16", (M, K, N), False, x=x, dy=dy, mg=mg, calls=1, sim=70
            )
        except CoreError as e:
            ok, detail = (
                "dropped Maxwell, Pascal and Volta" in str(e) and self.same_bytes(before, mg),
                "refused (CUDA 13 build), untouched: " + str(e)[:100],
            )
        self.add("capability", "simulated sm_70, no bias (cuBLASLt only)", ok, detail)
        cap = self.torch.cuda.get_device_capability()
        try:
            ok, detail, _ = self.accumulate(
                "bfloat16", (M, K, N), True, x=x, dy=dy, calls=1, sim=100
            )
        except CoreError as e:
            ok, detail = False, str(e)
        self.add(
            "capability",
            "simulated sm_100 (compute_90 PTX covers it)",
            ok,
            f"{detail}; real GPU sm_{cap[0]}{cap[1]}",
        )

    def checks(self):
        torch = self.torch
        M, K, N = 256, 128, 64
        x, dy = self.randn((M, K), "float32"), self.randn((M, N), "float32")
        mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
        if self.sim:
            err = ctypes.create_string_buffer(512)
            rc = self.core.lib.pmg_check_element_alignment(
                x.data_ptr() + 2,
                dy.data_ptr(),
                0,
                M,
                K,
                N,
                mg.data_ptr(),
                0,
                db.data_ptr(),
                0,
                err,
                len(err),
            )
            return self.add(
                "checks",
                "fp32 x at +2 bytes (decision only)",
                rc == 1 and b"element size" in err.value,
                err.value.decode()[:120],
            )
        tiny = torch.empty(16, dtype=torch.uint8, device=self.dev)
        self.untouched_error(
            "checks",
            "workspace too small, no allocator",
            "needed",
            lambda: self.call(
                x, dy, mg, db, 1.0, 1.0, "float32", workspace=tiny.data_ptr(), workspace_bytes=16
            ),
            mg,
            db,
        )
        self.untouched_error(
            "checks",
            "allocator returns null",
            "could not allocate",
            lambda: self.call(x, dy, mg, db, 1.0, 1.0, "float32", alloc=lambda n: 0),
            mg,
            db,
        )
        self.untouched_error(
            "checks",
            "fp32 x at +2 bytes",
            "element size",
            lambda: self.call(x.data_ptr() + 2, dy, mg, db, 1.0, 1.0, "float32", shape=(M, K)),
            mg,
            db,
        )
        mg16 = self.randn((K, N), "bfloat16")
        xb, dyb = x.to(torch.bfloat16), dy.to(torch.bfloat16)
        self.untouched_error(
            "checks",
            "epilogue forced, bf16 dW (refused)",
            "cannot apply",
            lambda: self.call(xb, dyb, mg16, db, 1.0, 1.0, "bfloat16", bias_mode="epilogue"),
            mg16,
            db,
        )
        x64, dy64 = x.double(), dy.double()
        mg64, db64 = mg.double(), db.double()
        self.untouched_error(
            "checks",
            "epilogue forced, fp64 (refused)",
            "float64",
            lambda: self.call(x64, dy64, mg64, db64, 1.0, 1.0, "float64", bias_mode="epilogue"),
            mg64,
            db64,
        )
        self.untouched_error(
            "checks",
            "no device given",
            "device",
            lambda: self.call(x, dy, mg, db, 1.0, 1.0, "float32", device=-1),
            mg,
            db,
        )

    def bias_order(self):
        """The bias kernel's sums (fresh db, beta 0) bitwise equal to the CPU
        reference that follows its order (csrc/wgrad_gpu_plan.cc bias_reduce_reference) for
        this GPU's SM count and dY's address: vector loads, odd N (scalar loads), narrow N,
        every dtype."""
        if self.sim:
            return self.skip("bias-order", "simulation: the order is the GPU kernel's")
        torch, np = self.torch, self.np
        sms = torch.cuda.get_device_properties(self.dev).multi_processor_count
        for in_dtype in ("bfloat16", "float16", "float32", "float64"):
            acc = "float64" if in_dtype == "float64" else "float32"
            for M, K, N in ((16384, 32, 16), (4095, 32, 520), (3000, 16, 1408), (70000, 8, 64)):
                x, dy = self.randn((M, K), in_dtype), self.randn((M, N), in_dtype)
                mg = self.randn((K, N), acc)
                db = torch.full((N,), float("nan"), device=self.dev, dtype=self.tdt[acc])
                try:
                    info = self.call(x, dy, mg, db, 1.0, 0.0, in_dtype, bias_mode="kernel")
                    self.sync()
                except CoreError as e:
                    self.add("bias-order", f"{in_dtype} {M}x{N}", False, f"error: {e}"[:200])
                    continue
                host = dy.cpu().contiguous()
                ref = self.core.bias_reference(
                    host.data_ptr(), in_dtype, M, N, sms, address=dy.data_ptr()
                )
                got = db.double().cpu().numpy()
                same = bool(np.array_equal(got, ref))
                exact = dy.double().sum(0).cpu().numpy()
                rel = float(np.abs(got - exact).max() / max(np.abs(exact).max(), 1e-30))
                self.add(
                    "bias-order",
                    f"{in_dtype} {M}x{N}",
                    same,
                    f"{'bitwise equal' if same else 'DIFFERS'} to the CPU reference "
                    f"({sms} SMs); max rel err vs float64 {rel:.2e}; {info_field(info, 'bias')}",
                )

    def pressure(self):
        """Memory pressure: an allocator that refuses the first request (cuBLASLt workspace
        included) but not the same call's needs without workspace: the call re-plans
        (ws_retry=1) and accumulates correctly; the core counts it (workspace_retries)."""
        if self.sim:
            return self.skip("pressure", "simulation: no cuBLASLt workspace on the CPU")
        for name, (M, K, N) in BIAS_PATH_SHAPES[:1] + [("square", (4096, 4096, 4096))]:
            x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
            mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
            info = self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", alloc=self.torch_alloc())
            self.sync()
            self.keep.clear()
            m = re.search(r"workspace=(\d+)@", info)
            first = int(m.group(1)) if m else 0
            out = (ctypes.c_int64 * 8)()
            path = {"epilogue": 1, "kernel": 2}.get(info_field(info, "bias"), 0)
            self.core.lib.pmg_plan_workspace(
                1,
                M,
                K,
                N,
                path,
                0,
                self.torch.cuda.get_device_properties(self.dev).multi_processor_count,
                out,
            )
            if first <= out[7]:
                self.skip(
                    "pressure", f"{name} {M}x{K}x{N}: cuBLASLt asked for no workspace ({info})"
                )
                continue
            inner = self.torch_alloc()
            refused = []

            def tight(n, limit=first - 1, refused=refused, inner=inner):
                if n > limit:
                    refused.append(n)
                    return 0
                return inner(n)

            try:
                ok, detail, infos = self.accumulate(
                    "bfloat16", (M, K, N), True, x=x, dy=dy, mg=mg, db=db, alloc=tight
                )
                retried = all(info_field(i, "ws_retry") == "1" for i in infos)
            except CoreError as e:
                ok, detail, infos, retried = False, f"error: {e}", [], False
            self.add(
                "pressure",
                f"{name} {M}x{K}x{N}",
                ok and retried and bool(refused),
                f"{detail}; refused {refused[:1]} bytes, then {infos[0] if infos else '?'}",
            )
