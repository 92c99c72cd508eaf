"""GPU telemetry for the benchmarks: the SM clock, board power and temperature sampled by
``nvidia-smi`` while a block of work runs (bench/e2e.py --sample-clocks, bench/attention.py
--sustain). Under seconds of dense matmul work the H200 sits at its board power limit (~700 W) and
its SM clock drops (2026-12-02: the D-128 forward back to back for 4 s, 688-690 W, 1650 MHz median):
a rate measured over a benchmark's short burst is not the rate of work that runs for seconds."""
from __future__ import annotations

import os
import statistics
import subprocess

import torch


class GpuSampler:
    """SM clock (MHz), board power (W) and temperature (C) sampled by ``nvidia-smi -lms`` while a
    block runs; ``summary()`` gives medians (and the lowest clock). Used by --sample-clocks to see
    whether one method runs the GPU at lower clocks than another (power limit). Without nvidia-smi
    (or on a CPU) it records nothing and ``summary()`` is None."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")

    def __init__(self, device: torch.device, period_ms: int = 50):
        self.device, self.period_ms, self.samples, self._proc, self._thread = device, period_ms, [], None, None

    def _gpu_id(self) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = self.device.index or 0
        if visible:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            if index < len(ids):
                return ids[index]
        return str(index)

    def __enter__(self):
        import shutil
        import threading
        smi = shutil.which("nvidia-smi")
        if self.device.type != "cuda" or smi is None:
            return self
        self._proc = subprocess.Popen(
            [smi, "-i", self._gpu_id(), f"--query-gpu={','.join(self.FIELDS)}", "--format=csv,noheader,nounits",
             f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read(stream):
            for line in stream:
                try:
                    self.samples.append(tuple(float(x) for x in line.split(",")))
                except ValueError:  # "[N/A]" fields or a partial line
                    pass
        self._thread = threading.Thread(target=read, args=(self._proc.stdout,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)
        return False

    def summary(self):
        return telemetry_summary(self.samples)


def telemetry_summary(samples):
    """Medians of (SM clock MHz, power W, temperature C) samples, the lowest clock and the highest
    temperature; None without samples."""
    if not samples:
        return None
    clocks, power, temp = (sorted(col) for col in zip(*samples))
    return {"samples": len(samples), "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_min": clocks[0], "power_w_median": statistics.median(power),
            "temperature_c_max": temp[-1]}
