"""The settings reference page, ``docs/settings.md``, made from the settings' own declarations.

Each row comes from ``roundel.common.settings.SPECS`` (variable, meaning),
the ``Settings`` defaults and the launcher's ``flags.ENV_FLAGS``, so the page
cannot drift from the code: ``tests/test_settings_reference.py`` fails when
the file differs from what this makes. After changing a setting, run
``python -m roundel.runner.settings_reference`` to write the page again.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from roundel.common.settings import MIB, SPECS, Settings
from roundel.runner.flags import ENV_FLAGS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

# flags that set a setting outside ENV_FLAGS (they choose among values rather than carry one)
_OTHER_FLAGS = {"LOG_LEVEL": ["--verbose (= debug)"], "CPU_OPERATIONS": ["--gloo", "--mpi"]}

INTRO = """\
# Settings

Each setting is an environment variable under its `ROUNDEL_` name or the
`HOROVOD_` name job scripts already use (`ROUNDEL_` wins when both are set),
and most are `roundelrun` flags too. A flag given on the command line beats
the config file (`--config-file` takes Horovod's YAML), which beats the
environment. Bad values stop `hvd.init()` and `roundelrun` with an error
naming the variable. This page is made from the code
(`python -m roundel.runner.settings_reference`).

| variable suffix (`ROUNDEL_`/`HOROVOD_`) | flag | default | meaning |
| --- | --- | --- | --- |
"""


def _default(spec) -> str:
    value = {f.name: f.default for f in dataclasses.fields(Settings)}[spec.field]
    if spec.suffix.endswith("_DISABLE"):  # the variable says the opposite of the field
        value = not value
    if isinstance(value, bool):
        return "1" if value else "0"
    if value == "":
        return "unset"
    if isinstance(value, int) and value >= MIB and value % MIB == 0:
        return f"{value} ({value // MIB} MiB)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def page() -> str:
    """The whole page, as it should be in ``docs/settings.md``."""
    flags = {}
    for _, flag, var, _ in ENV_FLAGS:
        flags.setdefault(var.removeprefix("ROUNDEL_"), []).append(flag)
    rows = []
    for spec in SPECS:
        named = flags.get(spec.suffix, []) + _OTHER_FLAGS.get(spec.suffix, [])
        shown = ", ".join(f"`{flag}`" for flag in named)
        rows.append(f"| `{spec.suffix}` | {shown} | {_default(spec)} | {spec.meaning} |")
    return INTRO + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    path = Path((argv or sys.argv[1:] or [PAGE])[0])
    path.write_text(page())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
