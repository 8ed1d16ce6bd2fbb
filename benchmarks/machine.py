"""What every benchmark prints with its figures: the machine it ran on."""

import platform

#: the CPU features that change which kernels run (oneDNN's, ours): named present or absent
_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_name():
    """The CPU as /proc/cpuinfo tells it: the model name, then family, model and stepping and
    which of :data:`_FEATURES` it has -- a cloud VM's model name ("AMD EPYC", "Intel(R) Xeon(R)
    Processor") does not tell one generation from another, and the figures differ between them.
    Else the platform's processor string, or "?"."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # (the first processor is enough)
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or "?"
    ident = ", ".join(
        f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields
    )
    flags = set(fields.get("flags", "").split())
    has = [f for f in _FEATURES if f in flags]
    lacks = [f for f in _FEATURES if f not in flags]
    features = " ".join(has) + ("; no " + ", no ".join(lacks) if lacks else "")
    return f"{name} ({ident}; {features})" if ident else f"{name} ({features})"
