"""The int4 / int8 tile kernels on AMX against VNNI (csrc/amx_tiles.cpp vs gemv_kernels.cpp), the same
gemv_q4 / gemv_q8 calls with the threshold moved: the default model's four linear shapes of one decoder
layer (int4 tiles) and its lm_head (int8 tiles, 49152 x 576), random weights of the same layouts, for each
row count. The two paths alternate --rounds times (medians of 7 calls each time); prints the medians in ms and
VNNI / AMX. Asserts nothing.

    .venv/bin/python benchmarks/amx_tiles.py [--rows 8,16,24,32,48,64,128,256] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.quant import tile_kernels
from tokenmill.quant.int4 import pack_q4_tiles
from tokenmill.quant.int8 import pack_q8_tiles

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]     # qkv, o, gate_up, down: (out, in)
HEAD = (49152, 576)


def q4_tiles(n: int, k: int) -> torch.Tensor:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.01 + 1e-3).half().float()
    return pack_q4_tiles(q, d, -8 * d)


def median_ms(fn, calls: int = 7) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,24,32,48,64,128,256")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    native = tile_kernels.kernels()
    if native is None or not hasattr(native, "set_amx_min_rows") or not native.amx_tiles_take(1 << 30):
        raise SystemExit("no AMX path here (needs an AMX-BF16 build and CPU, and the OS's AMX permission)")
    torch.manual_seed(0)
    layer = [(n, torch.empty(0), q4_tiles(n, k)) for n, k in LAYER]
    head, head_scales = pack_q8_tiles(torch.randint(-127, 128, HEAD, dtype=torch.int8), torch.rand(HEAD[0]) * 1e-3)
    saved = native.amx_min_rows()
    print(f"{torch.get_num_threads()} threads; ms per call, medians of {args.rounds} alternated rounds")
    print("| rows | layer VNNI | layer AMX | ratio | lm_head VNNI | lm_head AMX | ratio |")
    print("|---|---|---|---|---|---|---|")
    try:
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, LAYER[i][1]) for i in range(len(LAYER))]
            xh = torch.randn(m, HEAD[1])
            run_layer = lambda: [native.gemv_q4(x, tiles, n) for x, (n, _, tiles) in zip(xs, layer)]
            run_head = lambda: native.gemv_q8(xh, head, head_scales, HEAD[0])
            figures = {"layer": ([], []), "head": ([], [])}
            for _ in range(args.rounds):
                for path, threshold in enumerate((0, 1)):          # 0: VNNI at every size; 1: AMX at every size
                    native.set_amx_min_rows(threshold)
                    figures["layer"][path].append(median_ms(run_layer))
                    figures["head"][path].append(median_ms(run_head, 3))
            cells = []
            for vnni, on_amx in figures.values():
                a, b = statistics.median(vnni), statistics.median(on_amx)
                cells += [f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x"]
            print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
    finally:
        native.set_amx_min_rows(saved)


if __name__ == "__main__":
    main()
