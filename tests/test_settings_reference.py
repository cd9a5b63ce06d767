"""docs/settings.md is made from the settings' declarations: the file in the repository must be current."""

from roundel.common.settings import SPECS, Settings
from roundel.runner import settings_reference


def test_the_settings_page_is_what_the_code_makes():
    assert settings_reference.PAGE.read_text() == settings_reference.page(), (
        "docs/settings.md is stale: run `python -m roundel.runner.settings_reference` and commit the page")


def test_every_setting_has_a_row_with_its_meaning():
    text = settings_reference.page()
    for spec in SPECS:
        assert f"| `{spec.suffix}` |" in text and spec.meaning in text, spec.suffix
    assert len(SPECS) == len(Settings.__dataclass_fields__)
