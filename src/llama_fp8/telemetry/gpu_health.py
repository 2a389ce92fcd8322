"""SM clock, power, temperature and throttle reasons of this rank's GPU, read through NVML once per
logging window (the ``nvidia-ml-py`` package, import name ``pynvml``: the optional extra ``[nvml]``).

Without CUDA or without the package every reading is None and the status says "not measured" and why;
nothing is guessed. Throttle reasons are NVML's bit mask (nvmlClocksThrottleReasons): thermal
(software or hardware thermal slowdown) and power (software power cap, hardware power brake, hardware
slowdown, which NVML raises for both heat and power) are what can make a window slow.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

# nvmlClocksThrottleReasons bits (NVML API reference)
SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x4, 0x8, 0x20, 0x40, 0x80
THERMAL_BITS = SW_THERMAL | HW_THERMAL
POWER_BITS = SW_POWER_CAP | HW_POWER_BRAKE | HW_SLOWDOWN
FIELDS = ("sm_clock_mhz", "power_w", "temp_c", "throttle_thermal", "throttle_power")


class GpuHealth:
    """One rank's NVML reader; ``sample()`` -> the FIELDS (None when not measured)."""

    def __init__(self, device_type: str, device_index: int | None, nvml: Any = None):
        self.status, self._nvml, self._handle = "measured", None, None
        if device_type != "cuda":
            self.status = "not measured (no CUDA device)"
            return
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.status = "not measured (nvidia-ml-py not installed: pip install 'llama-fp8[nvml]')"
                return
        try:
            nvml.nvmlInit()
            self._handle = _handle(nvml, device_index or 0)
            self._nvml = nvml
        except Exception as e:  # noqa: BLE001 - any NVML failure (no driver, no permission) means "not measured"
            self.status = f"not measured (NVML: {e})"
            log.warning("GPU health %s", self.status)

    def sample(self) -> dict[str, float | None]:
        if self._nvml is None:
            return dict.fromkeys(FIELDS)
        n, h = self._nvml, self._handle
        read = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        try:
            reasons = int(read(h))
            return {"sm_clock_mhz": float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                    "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
                    "temp_c": float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                    "throttle_thermal": float(bool(reasons & THERMAL_BITS)),
                    "throttle_power": float(bool(reasons & POWER_BITS))}
        except Exception as e:  # noqa: BLE001 - a failed read is one window "not measured", not a crash
            log.warning("NVML read failed: %s", e)
            return dict.fromkeys(FIELDS)


def _handle(nvml: Any, index: int):
    """The NVML handle of CUDA device ``index``: by UUID when torch knows it (CUDA_VISIBLE_DEVICES can
    reorder devices), else by index."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # noqa: BLE001 - older torch or NVML without that call
        return nvml.nvmlDeviceGetHandleByIndex(index)


def per_node(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per host over its ranks: min SM clock, max power, max temperature, any throttling."""
    out: dict[str, dict[str, Any]] = {}
    for r in ranks:
        node = out.setdefault(r["host"], {"min_sm_clock_mhz": None, "max_power_w": None, "max_temp_c": None,
                                          "throttle_thermal": False, "throttle_power": False})
        for key, field, pick in (("min_sm_clock_mhz", "sm_clock_mhz", min), ("max_power_w", "power_w", max),
                                 ("max_temp_c", "temp_c", max)):
            v = r.get(field)
            if v is not None and math.isfinite(v):
                node[key] = v if node[key] is None else pick(node[key], v)
        node["throttle_thermal"] |= bool(r.get("throttle_thermal"))
        node["throttle_power"] |= bool(r.get("throttle_power"))
    return out
