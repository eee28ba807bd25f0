"""The memory-hungry task of the oversubscription benchmark, shared by outlast and Ray.

It takes `mib` of memory, touched page by page, and does matrix products on it for
`seconds` of wall time, lightly (a product, then a short sleep), so the node's memory is
the bottleneck rather than its two cores.
"""

import time


def hungry(mib: int, seconds: float) -> float:
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    x = torch.ones(mib * 1024 * 1024 // 4)  # touched: every page is resident
    n = 256
    a = x[: n * n].view(n, n)
    acc = 0.0
    while time.monotonic() - t0 < seconds:
        acc += float((a @ a)[0, 0])
        time.sleep(0.01)
    return acc
