"""What every benchmark prints with its figures: the machine it ran on."""

import platform


def cpu_name():
    """The CPU's model name (/proc/cpuinfo; else the platform's processor string, or "?")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"
