"""The roof: the umbrella CLI (:mod:`tokenfan.cli`: ``tokenfan serve|gateway|engine|bench|...``) and the
supervisor of ``tokenfan serve`` (the engine child, the gateway workers). Everything else is below it; the
settings table both processes stand on is :mod:`tokenfan_settings`."""
