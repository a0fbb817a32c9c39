"""GPU check and benchmark of the CuPy paged-attention kernels (one call on an H200-class machine).

    python benches/gpu_attention.py [--quick] [--iters N] [--out FILE]

1. Correctness: every kernel instantiation (dtype x head dim x block size x rows per CTA, the
   split-context path with its reduction, and extend) against dense float64 attention in torch, on
   shuffled blocks with NaN-poisoned unused slots and NaN-prefilled outputs. ``--quick`` checks only
   the configurations that are timed.
2. Timing with CUDA events (warm-up, median of many launches, inputs larger than L2): achieved
   bandwidth = KV bytes read / time, against a measured device-to-device copy (read + write bytes /
   time) and against torch SDPA on KV gathered to contiguous memory beforehand.
   Cases: decode 32 sequences x 4,096 tokens, 8 KV heads x 128, bf16 (32 query heads); the target is
   >= 70% of copy bandwidth. Split context: 2 sequences x 32k. Plus the unsplit and rows variants.

Prints markdown tables (and writes them to ``--out`` if given). Exits non-zero without CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _need_cuda():
    try:
        import torch
    except ImportError:
        sys.exit("benches/gpu_attention.py needs torch with CUDA (pip install 'prefixkv[cuda]')")
    if not torch.cuda.is_available():
        sys.exit("benches/gpu_attention.py needs a CUDA GPU: torch.cuda.is_available() is False")
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        sys.exit(f"benches/gpu_attention.py needs cupy (pip install 'prefixkv[cuda]'): {exc}")
    return torch


def make_problem(torch, *, seqs, lens, kv_heads, group, head_dim, block_size, dtype, q_lens=None, seed=0,
                 poison=True):
    """Pools with shuffled physical blocks; unused slots NaN. Returns a dict of CUDA tensors."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    nblk = [-(-L // block_size) for L in lens]
    width = max(nblk + [1]) + 1
    total = sum(nblk) + 2
    perm = torch.randperm(total, generator=g, device=dev).to(torch.int32)
    shape = (total, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dtype)
    tables = torch.empty((seqs, width), dtype=torch.int32, device=dev)
    used = 0
    for i, L in enumerate(lens):
        own = perm[used:used + nblk[i]]
        used += nblk[i]
        tables[i, :nblk[i]] = own
        tables[i, nblk[i]:] = perm[-1]                          # padding: a spare (poisoned) block
        if poison and L % block_size and nblk[i]:
            k[own[-1], L % block_size:] = float("nan")
            v[own[-1], L % block_size:] = float("nan")
    if poison:
        k[perm[sum(nblk):]] = float("nan")
        v[perm[sum(nblk):]] = float("nan")
    tokens = seqs if q_lens is None else sum(q_lens)
    q = torch.randn((tokens, kv_heads * group, head_dim), generator=g, device=dev).to(dtype)
    qsl = None if q_lens is None else torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32, device=dev)
    return dict(query=q, k_pool=k, v_pool=v, block_tables=tables,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), query_start_loc=qsl,
                scale=head_dim ** -0.5, lens=lens, q_lens=q_lens, group=group)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def gather(torch, pool, tables, lens, i, block_size):
    L = lens[i]
    pos = torch.arange(L, device=pool.device)
    return pool[tables[i, pos // block_size].long(), pos % block_size]      # [L, Hkv, D]


def dense_reference(torch, p):
    """Dense float64 attention (decode or causal extend) and lse."""
    q, k_pool, v_pool = p["query"].double(), p["k_pool"].double(), p["v_pool"].double()
    tables, lens, G, scale = p["block_tables"], p["lens"], p["group"], p["scale"]
    B = k_pool.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    rows = []
    if p["q_lens"] is None:
        rows = [(i, i, L) for i, L in enumerate(lens)]
    else:
        first = 0
        for i, (L, n) in enumerate(zip(lens, p["q_lens"])):
            rows += [(first + j, i, L - n + j + 1) for j in range(n)]
            first += n
    for tok, i, n in rows:
        if n == 0:
            continue
        K = gather(torch, k_pool, tables, [n if s == i else 0 for s in range(len(lens))], i, B)
        V = gather(torch, v_pool, tables, [n if s == i else 0 for s in range(len(lens))], i, B)
        K = K.repeat_interleave(G, dim=1)                                     # [n, Hq, D]
        V = V.repeat_interleave(G, dim=1)
        s = torch.einsum("hd,nhd->hn", q[tok], K) * scale
        lse[tok] = torch.logsumexp(s, dim=1)
        out[tok] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1), V)
    return out, lse


def check_all(torch, ck, quick):
    """Correctness of every instantiation (or the timed ones with --quick). Returns table rows."""
    rows = []
    configs = []
    for dtype in (torch.bfloat16, torch.float16):
        for D in ck.HEAD_DIMS:
            for B in ck.BLOCK_SIZES:
                for R in ck.ROWS:
                    if quick and not (dtype == torch.bfloat16 and D == 128 and B == 16 and R == 4):
                        continue
                    configs.append((dtype, D, B, R))
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
    failures = 0
    for dtype, D, B, R in configs:
        group = max(R, 2) if R < 8 else 8
        lens = [0, 1, B - 1, B, B + 1, 300, 1000]
        p = make_problem(torch, seqs=len(lens), lens=lens, kv_heads=2, group=group, head_dim=D, block_size=B,
                         dtype=dtype, seed=D + B + R)
        ref_out, ref_lse = dense_reference(torch, p)
        for splits, extend in ((1, False), (3, False), (None, False), (2, True)):
            if extend:
                q_lens = [0, 1, 3, 5, 17, 30, 2]
                pe = make_problem(torch, seqs=len(lens), lens=lens, kv_heads=2, group=group, head_dim=D,
                                  block_size=B, dtype=dtype, q_lens=q_lens, seed=D + B + R + 1)
                r_out, r_lse = dense_reference(torch, pe)
                prob = pe
            else:
                prob, r_out, r_lse = p, ref_out, ref_lse
            out, lse = ck.launch_paged_attention(prob["query"], prob["k_pool"], prob["v_pool"],
                                                 prob["block_tables"], prob["seq_lens"], prob["scale"],
                                                 prob["query_start_loc"], True, num_splits=splits, rows=R,
                                                 poison=True)
            torch.cuda.synchronize()
            err = (out.double() - r_out).abs().max().item()
            finite = torch.isfinite(r_lse)
            lse_ok = bool(torch.equal(torch.isneginf(lse), ~finite))
            lse_err = (lse.double()[finite] - r_lse[finite]).abs().max().item() if finite.any() else 0.0
            ok = (not torch.isnan(out).any().item()) and err <= tol[dtype] * 4 and lse_ok and lse_err < 5e-3
            failures += not ok
            rows.append((str(dtype).replace("torch.", ""), D, B, R, "extend" if extend else f"splits={splits}",
                         f"{err:.2e}", f"{lse_err:.2e}", "ok" if ok else "FAIL"))
    return rows, failures


def cuda_time_ms(torch, fn, iters, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(torch, iters):
    n = 1 << 30                                           # 1 GiB, far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(torch, lambda: dst.copy_(src), iters)
    return 2 * n / (ms * 1e-3)                            # bytes read + written per second


def bench_case(torch, ck, name, p, iters, copy_bw, *, num_splits=None, rows=None):
    import torch.nn.functional as F

    args = (p["query"], p["k_pool"], p["v_pool"], p["block_tables"], p["seq_lens"], p["scale"])
    kv = p["k_pool"]
    Hkv, D, B = kv.shape[2], kv.shape[3], kv.shape[1]
    kv_bytes = sum(p["lens"]) * Hkv * D * kv.element_size() * 2
    dims = ck.check_inputs(*args[:5])
    plan = ck.plan_attention(dims, num_sms=ck._device_sms(torch.cuda.current_device()), num_splits=num_splits,
                             rows=rows)
    ms = cuda_time_ms(torch, lambda: ck.launch_paged_attention(*args, num_splits=num_splits, rows=rows), iters)
    # SDPA on KV gathered beforehand (dense baseline; the gather itself is timed separately)
    lens = p["lens"]
    if len(set(lens)) == 1:
        L, S = lens[0], len(lens)
        ks = torch.stack([gather(torch, p["k_pool"], p["block_tables"], lens, i, B) for i in range(S)])
        vs = torch.stack([gather(torch, p["v_pool"], p["block_tables"], lens, i, B) for i in range(S)])
        q4 = p["query"].unsqueeze(2)                                          # [S, Hq, 1, D]
        k4, v4 = ks.permute(0, 2, 1, 3).contiguous(), vs.permute(0, 2, 1, 3).contiguous()   # [S, Hkv, L, D]

        def sdpa():
            return F.scaled_dot_product_attention(q4, k4, v4, scale=p["scale"], enable_gqa=True)

        sdpa_ms = cuda_time_ms(torch, sdpa, iters)

        def gather_sdpa():
            kk = torch.stack([gather(torch, p["k_pool"], p["block_tables"], lens, i, B) for i in range(S)])
            vv = torch.stack([gather(torch, p["v_pool"], p["block_tables"], lens, i, B) for i in range(S)])
            return F.scaled_dot_product_attention(q4, kk.transpose(1, 2), vv.transpose(1, 2), scale=p["scale"],
                                                  enable_gqa=True)

        gather_ms = cuda_time_ms(torch, gather_sdpa, max(5, iters // 5))
    else:
        sdpa_ms = gather_ms = float("nan")
    bw = kv_bytes / (ms * 1e-3)
    return dict(case=name, plan=f"rows={plan.rows} splits={plan.num_splits} grid={plan.attention_grid}",
                kv_mib=kv_bytes / 2**20, ms=ms, bw=bw / 1e9, copy_pct=100 * bw / copy_bw,
                sdpa_ms=sdpa_ms, sdpa_bw=kv_bytes / (sdpa_ms * 1e-3) / 1e9, gather_sdpa_ms=gather_ms)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="check only the timed configurations")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, help="also write the markdown tables here")
    args = ap.parse_args(argv)
    torch = _need_cuda()
    from prefixkv.kv import cuda_kernels as ck

    dev = torch.cuda.get_device_properties(0)
    lines = [f"# paged attention kernels on {dev.name} ({datetime.date.today()})", "",
             f"torch {torch.__version__}, cupy {__import__('cupy').__version__}, "
             f"{dev.multi_processor_count} SMs, L2 {getattr(dev, 'L2_cache_size', 0) / 2**20:.0f} MiB", ""]

    rows, failures = check_all(torch, ck, args.quick)
    lines += ["## Correctness against dense float64 (torch)", "",
              "| dtype | head dim | block | rows/CTA | path | max abs err | max lse err | |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(map(str, r))} |" for r in rows]
    lines += ["", f"{len(rows) - failures} of {len(rows)} checks pass.", ""]

    copy_bw = copy_bandwidth(torch, args.iters)
    results = []
    decode = make_problem(torch, seqs=32, lens=[4096] * 32, kv_heads=8, group=4, head_dim=128, block_size=16,
                          dtype=torch.bfloat16, seed=1, poison=False)
    results.append(bench_case(torch, ck, "decode 32 x 4096, 8x128 KV, 32 q heads, bf16", decode, args.iters, copy_bw))
    results.append(bench_case(torch, ck, "same, forced one split", decode, args.iters, copy_bw, num_splits=1))
    del decode
    gqa8 = make_problem(torch, seqs=32, lens=[4096] * 32, kv_heads=8, group=8, head_dim=128, block_size=16,
                        dtype=torch.bfloat16, seed=2, poison=False)
    for r in (4, 8):
        results.append(bench_case(torch, ck, f"decode 32 x 4096, 64 q heads, rows={r}", gqa8, args.iters, copy_bw,
                                  rows=r))
    del gqa8
    long = make_problem(torch, seqs=2, lens=[32768] * 2, kv_heads=8, group=4, head_dim=128, block_size=16,
                        dtype=torch.bfloat16, seed=3, poison=False)
    results.append(bench_case(torch, ck, "split context 2 x 32768, bf16", long, args.iters, copy_bw))
    results.append(bench_case(torch, ck, "same, forced one split", long, args.iters, copy_bw, num_splits=1))
    del long
    fp16 = make_problem(torch, seqs=32, lens=[4096] * 32, kv_heads=8, group=4, head_dim=128, block_size=16,
                        dtype=torch.float16, seed=4, poison=False)
    results.append(bench_case(torch, ck, "decode 32 x 4096, fp16", fp16, args.iters, copy_bw))
    del fp16

    lines += ["## Bandwidth (median of %d, CUDA events)" % args.iters, "",
              f"Device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write).", "",
              "| case | plan | KV MiB | kernel ms | GB/s | % of copy | SDPA (gathered) ms | SDPA GB/s | gather+SDPA ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['plan']} | {r['kv_mib']:.0f} | {r['ms']:.3f} | {r['bw']:.0f} | "
                     f"{r['copy_pct']:.0f}% | {r['sdpa_ms']:.3f} | {r['sdpa_bw']:.0f} | {r['gather_sdpa_ms']:.3f} |")
    target = results[0]["copy_pct"]
    lines += ["", f"Target (decode 32 x 4096 bf16 >= 70% of copy bandwidth): {target:.0f}% -> "
              f"{'met' if target >= 70 else 'NOT met'}.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
