"""GPU utilisation, memory and energy per prompt, sampled with NVML (``pip install nvidia-ml-py``).

Each rank samples the GPUs of its own stage every ``interval_s`` on a background thread while a
prompt decodes. Energy is the trapezoidal integral of power over the samples. On a machine without
CUDA or without NVML the monitor is inactive and records nothing (CPU runs report no GPU fields).
``summary.json`` then reports energy per token both per GPU (the paper's figure averages per
GPU) and summed over the system, which shows when SD costs more energy than AR for the system.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


def integrate_energy(samples: Sequence[tuple[float, float]]) -> float:
    """Joules from (time s, power W) samples, trapezoidal rule (pure)."""
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(samples, samples[1:]))


class GpuMonitor:
    def __init__(self, devices: Sequence[int], interval_s: float = 0.05) -> None:
        self.devices = list(devices)
        self.interval_s = interval_s
        self.handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(d) for d in self.devices]
        except Exception:  # noqa: BLE001 - no NVML, no GPU: the monitor stays inactive
            self.handles = []
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def start(self) -> None:
        if not self.active:
            return
        self._stop = threading.Event()
        self._samples: list[list[tuple[float, float, float, float]]] = [[] for _ in self.handles]
        self._thread = threading.Thread(target=self._run, name="nvml", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        nv, t = self._nvml, time.perf_counter()
        for h, out in zip(self.handles, self._samples):
            power_w = nv.nvmlDeviceGetPowerUsage(h) / 1000
            util = nv.nvmlDeviceGetUtilizationRates(h).gpu
            mem_mb = nv.nvmlDeviceGetMemoryInfo(h).used / 2**20
            out.append((t, power_w, util, mem_mb))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def stop(self) -> list[dict]:
        """Per device of this stage: energy (J), mean utilisation (%), peak memory (MiB)."""
        if self._thread is None:
            return []
        self._stop.set()
        self._thread.join()
        self._sample()
        self._thread = None
        out = []
        for d, s in zip(self.devices, self._samples):
            out.append({
                "device": d,
                "energy_j": integrate_energy([(t, p) for t, p, _, _ in s]),
                "util_mean": sum(u for _, _, u, _ in s) / len(s),
                "mem_peak_mb": max(m for _, _, _, m in s),
            })  # fmt: skip
        return out
