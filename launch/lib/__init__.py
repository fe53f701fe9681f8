"""Application code of the launchers: benchmark runs and reports, the device report."""
