"""What the tokenfan processes share: the settings table (:mod:`tokenfan.settings`), the umbrella CLI
(:mod:`tokenfan.cli`: ``tokenfan serve|gateway|engine|bench|...``) and the engine supervisor of ``tokenfan serve``."""
