"""Peak memory of one ``tokrag bench`` arm: the process's resident set on CPU (its high-water
mark reset after loading), read from ``/proc/self/status``."""

from __future__ import annotations

__all__: list[str] = []


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return float("nan")


def _status_mb(field: str) -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return float("nan")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so loading the model does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:  # pragma: no cover - non-Linux or not permitted
        return False
