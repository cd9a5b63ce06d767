"""docs/settings.md is made from the settings' declarations: the file in the repository must be current."""

from roundel.common.settings import SPECS, Settings
from roundel.runner import settings_reference


def test_the_settings_page_is_what_the_code_makes():
    assert settings_reference.PAGE.read_text() == settings_reference.page(), (
        "docs/settings.md is stale: run `python -m roundel.runner.settings_reference` and commit the page")


def test_every_setting_has_a_row_with_its_meaning_flags_and_config_key():
    text = settings_reference.page()
    for spec in SPECS:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{spec.suffix}` |"))
        assert spec.meaning in row, spec.suffix
        if spec.flag is not None:
            assert all(f"`{name}`" in row for name in spec.flag.names + spec.flag.off), row
            assert f"`{spec.flag.config or spec.flag.dest}`" in row, row
    fields = [spec.field for spec in SPECS if spec.field is not None]
    assert sorted(fields) == sorted(Settings.__dataclass_fields__)  # each field declared once
    assert len({spec.suffix for spec in SPECS}) == len(SPECS)
