"""The machine a plan is priced for: one GPU type, its links, and how fast its kernels run in practice.

Peak FLOP/s come from :mod:`titanlike.planner.peaks` (the table the trainer's MFU uses too), so a plan's MFU and a
run's MFU are measured against the same number. Memory is what the driver reports (``nvidia-smi`` total), not
the marketing figure. Link bandwidths are per GPU and per direction, as NCCL's "bus bandwidth" counts them:

* ``nvlink``: inside a node (H100/H200: NVLink 4, 900 GB/s bidirectional = 450 GB/s each way; A100: 300;
  B200: 900);
* ``network``: between nodes, one NIC per GPU (A100: HDR 200 Gb/s = 25 GB/s; H100/H200/B200: NDR 400 Gb/s =
  50 GB/s).

``compute_efficiency`` is the fraction of the datasheet peak the model's kernels reach when nothing waits
(matmuls, attention and the element-wise ops together); 0.6 is the default, between the two anchors measured for
this project (a large matmul and a whole Llama-1B step on one H200: docs/facts.md, "Smaller ones").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanlike.planner.peaks import peak_key, peak_tflops_for_name

__all__ = ["GPUS", "Hardware", "hardware_for"]

GiB = 1024**3

# name -> (memory GiB as the driver reports it, NVLink GB/s per direction, network GB/s per GPU and direction)
GPUS: dict[str, tuple[float, float, float]] = {
    "A100": (80.0, 300.0, 25.0),  # A100-SXM4-80GB: 81920 MiB
    "H100": (79.6, 450.0, 50.0),  # H100 80GB HBM3: 81559 MiB
    "H200": (140.4, 450.0, 50.0),  # H200: 143771 MiB
    "B200": (179.1, 900.0, 50.0),  # B200: 183359 MiB
}


@dataclass(frozen=True)
class Hardware:
    gpu: str
    peak_flops: float  # dense FLOP/s of one GPU for the run's dtype
    memory_bytes: float
    gpus_per_node: int
    nvlink_bw: float  # bytes/s per GPU per direction inside a node
    network_bw: float  # bytes/s per GPU per direction between nodes
    latency_s: float = 10e-6  # per collective / p2p message
    compute_efficiency: float = 0.6
    memory_fraction: float = 0.92  # usable share of memory: CUDA context, NCCL buffers, allocator fragmentation

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.memory_fraction

    def link_bw(self, crosses_nodes: bool) -> float:
        return self.network_bw if crosses_nodes else self.nvlink_bw

    def replace(self, **kw) -> Hardware:
        return replace(self, **kw)


def hardware_for(
    gpu: str = "H100",
    *,
    gpus_per_node: int = 8,
    dtype: str = "bfloat16",
    float8_recipe: str = "",
    peak_tflops: float = 0.0,
    nvlink_gbps: float | None = None,
    ib_gbps: float | None = None,
    memory_gib: float | None = None,
    compute_efficiency: float = 0.6,
    latency_us: float = 10.0,
) -> Hardware:
    """A :class:`Hardware` from the table, any figure overridable (``peak_tflops > 0`` replaces the peak)."""
    name = next((k for k in GPUS if k.lower() == gpu.lower()), None)
    if name is None:
        raise ValueError(
            f"unknown GPU {gpu!r}; known: {', '.join(GPUS)} (or give --memory-gib, --peak-tflops, "
            f"--nvlink-gbps and --ib-gbps with one of them)"
        )
    mem, nvlink, ib = GPUS[name]
    tflops = peak_tflops if peak_tflops > 0 else peak_tflops_for_name(name, peak_key(dtype, float8_recipe))
    if tflops is None:
        raise ValueError(
            f"no {peak_key(dtype, float8_recipe)} peak for {name} in titanlike.planner.peaks; give --peak-tflops"
        )
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return Hardware(
        gpu=name,
        peak_flops=tflops * 1e12,
        memory_bytes=(memory_gib or mem) * GiB,
        gpus_per_node=gpus_per_node,
        nvlink_bw=(nvlink_gbps or nvlink) * 1e9,
        network_bw=(ib_gbps or ib) * 1e9,
        latency_s=latency_us * 1e-6,
        compute_efficiency=compute_efficiency,
    )
