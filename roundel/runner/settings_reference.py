"""The settings reference page, ``docs/settings.md``, made from the settings' own declarations.

Each row comes from the settings table, ``roundel.common.settings.SPECS``
(variable, flags, config key, default, meaning), so
the page cannot drift from the code: ``tests/test_settings_reference.py`` fails when
the file differs from what this makes. After changing a setting, run
``python -m roundel.runner.settings_reference`` to write the page again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from roundel.common.settings import SPECS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

INTRO = """\
# Settings

## How a setting is given

Each setting is an environment variable under its `ROUNDEL_` name or the
`HOROVOD_` name job scripts already use (`ROUNDEL_` wins when both are set),
and most are `roundelrun` flags too. A flag given on the command line beats
the config file (`--config-file` takes Horovod's YAML; see
[roundelrun](roundelrun.md#the-config-file)), which beats the
environment. Bad values stop `hvd.init()` and `roundelrun` with an error
naming the variable. A setting without a `Settings` field is accepted
and handed to the workers but has no effect in roundel. The config-file key
is the one of Horovod's config file where it has one; each flag's long name
(without `--`, with `-` or `_`) is a top-level key too. This page is made from the code
(`python -m roundel.runner.settings_reference`).

## Every setting

| variable suffix (`ROUNDEL_`/`HOROVOD_`) | flag | config key | default | meaning |
| --- | --- | --- | --- | --- |
"""


def _flags(spec) -> str:
    flag = spec.flag
    if flag is None:
        return ""
    shown = ", ".join(f"`{name}`" for name in flag.names + flag.off)
    if flag.implied_by is not None:
        dest, value = flag.implied_by
        shown += f", `--{dest.replace('_', '-')}` (= {str(value).lower()})"
    return shown


def page() -> str:
    """The whole page, as it should be in ``docs/settings.md``."""
    rows = []
    for spec in SPECS:
        config = "" if spec.flag is None else f"`{spec.flag.config or spec.flag.dest}`"
        rows.append(f"| `{spec.suffix}` | {_flags(spec)} | {config} | {spec.default_text()} | {spec.meaning} |")
    return INTRO + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    """Write the page to the path given (default ``docs/settings.md``); return the exit status."""
    parser = argparse.ArgumentParser(description="Write the settings reference page from roundel's settings table.")
    parser.add_argument("path", nargs="?", default=str(PAGE), help="where to write it (default: %(default)s)")
    path = Path(parser.parse_args(argv).path)
    path.write_text(page())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
