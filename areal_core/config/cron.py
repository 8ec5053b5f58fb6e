"""The cron expressions FlyteAdmin accepts for a launch plan's schedule.

FlyteAdmin validates `CronSchedule.schedule` with robfig/cron v3's `cron.ParseStandard`
(flyteadmin/pkg/manager/impl/validation/launch_plan_validator.go: validateSchedule), which
differs from flytekit's own check (croniter): day-of-week is 0-6 (no 7 for Sunday), no seconds
field, a range must not run backwards and a step must be positive. This is that parser's grammar:

    spec   = [("TZ=" | "CRON_TZ=") zone " "] (descriptor | field{5})
    field  = range {"," range};  range = ("*" | "?" | value ["-" value]) ["/" step]
    descriptor = @yearly | @annually | @monthly | @weekly | @daily | @midnight | @hourly | "@every " duration
"""

from __future__ import annotations

import re

DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, min, max, names -> value) of minute, hour, day of month, month, day of week
FIELDS = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {n: i + 1 for i, n in enumerate(_MONTHS)}),
    ("day of week", 0, 6, {n: i for i, n in enumerate(_DAYS)}),
)
# Go's time.ParseDuration: [sign] (number unit)+ , or "0"
_DURATION = re.compile(r"[-+]?(0|((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+)")
_INT = re.compile(r"\+?\d+")


def _value(text: str, names: dict[str, int]) -> int:
    if text.lower() in names:
        return names[text.lower()]
    if not _INT.fullmatch(text):
        raise ValueError(f"failed to parse int from {text}")
    return int(text)


def _range_error(expr: str, lo: int, hi: int, names: dict[str, int]) -> str:
    range_and_step = expr.split("/")
    low_high = range_and_step[0].split("-")
    try:
        if low_high[0] in ("*", "?"):
            start, end = lo, hi
        elif len(low_high) > 2:
            return f"too many hyphens: {expr}"
        else:
            start = _value(low_high[0], names)
            end = _value(low_high[1], names) if len(low_high) == 2 else start
        step = 1
        if len(range_and_step) > 2:
            return f"too many slashes: {expr}"
        if len(range_and_step) == 2:
            step = _value(range_and_step[1], {})
            if len(low_high) == 1:  # "N/step" means "N-max/step"
                end = hi
    except ValueError as exc:
        return str(exc)
    if start < lo:
        return f"beginning of range ({start}) below minimum ({lo}): {expr}"
    if end > hi:
        return f"end of range ({end}) above maximum ({hi}): {expr}"
    if start > end:
        return f"beginning of range ({start}) beyond end of range ({end}): {expr}"
    if step == 0:
        return f"step of range should be a positive number: {expr}"
    return ""


def cron_error(spec: str) -> str:
    """Why FlyteAdmin (robfig/cron ParseStandard) rejects `spec`; '' when it accepts it."""
    if not spec:
        return "empty spec string"
    if spec.startswith(("TZ=", "CRON_TZ=")):
        from zoneinfo import ZoneInfo

        zone, _, rest = spec.partition(" ")
        try:
            ZoneInfo(zone.split("=", 1)[1])
        except Exception:
            return f"provided bad location {zone.split('=', 1)[1]}"
        spec = rest.strip()
    if spec.startswith("@"):
        if spec in DESCRIPTORS or (spec.startswith("@every ") and _DURATION.fullmatch(spec[len("@every ") :])):
            return ""
        return f"unrecognized descriptor: {spec}"
    fields = spec.split()
    if len(fields) != 5:
        return f"expected exactly 5 fields, found {len(fields)}: {spec}"
    for text, (_, lo, hi, names) in zip(fields, FIELDS, strict=True):
        for expr in (e for e in text.split(",") if e):
            if err := _range_error(expr, lo, hi, names):
                return err
    return ""
