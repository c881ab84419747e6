"""The settings reference stays true: every setting's flag and environment variable is in docs/settings.md."""

from __future__ import annotations

from engine_worker import settings
from tests.procs import ROOT


def test_every_setting_has_its_flag_and_environment_variable_in_the_settings_page() -> None:
    page = (ROOT / settings.SETTINGS_DOC).read_text()
    for s in settings.SETTINGS:
        assert f"`{s.option}`" in page, s.option
        assert f"`{s.env_var}`" in page, s.env_var
